#!/usr/bin/env python3
"""Train the demo model's BPE tokenizer (``tokenizers``) on the corpus + RULER-format samples.

Pre-tokenisation: every digit is its own token (``Digits(individual_digits=True)``), then GPT-2 style byte-level
splitting (words with their leading space, punctuation runs, newlines), so decoding is lossless, a 7-digit value
is 7 digit tokens (+ the space before it) and an adjective-noun key is "Ġadj", "-", "noun" pieces. Special tokens:
``<pad>`` (0), ``<bos>`` (1), ``<eos>`` (2); the post-processor prepends ``<bos>`` (what ruler.py counts on the
plain path). No chat template: ruler.py then builds RULER's plain ('base') prompts.

Saved as a ``PreTrainedTokenizerFast`` directory (tokenizer.json, tokenizer_config.json, special_tokens_map.json)
that ``AutoTokenizer.from_pretrained`` loads.

    python scripts/demo/train_tokenizer.py --corpus out/demo/corpus --out out/demo/tokenizer --vocab 8192
"""
from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for gdnviz
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

SPECIALS = ["<pad>", "<bos>", "<eos>"]


def synthetic_texts(n_per_task: int, seed: int) -> list[str]:
    """RULER-format prompts + answers (short haystacks: the templates, needles, keys and values are what counts)."""
    import synth

    r = synth.Renderer(lambda t: int(len(t.split()) * 1.4))  # rough count, only sizes vt's demo here
    rng = random.Random(seed)
    out = []
    for task in synth.TASKS:
        for _ in range(n_per_task):
            if task == "fwe":
                target = rng.choice([1024, 2048, 4096])
                n = rng.randint(200, 600)
                if not r.fwe_valid(n, target):
                    continue
            elif task == "cwe":
                target, n = rng.choice([1024, 4096]), rng.randint(10, 40)
            else:
                target, n = 2048, rng.randint(synth.MIN_UNITS[task], 12)
            prompt, _, answers = r.render(task, n, rng.getrandbits(62), target)
            out.append(prompt + synth.answer_text(task, answers))
    # every key word at least once, so that BPE sees the full adjective and noun lists
    words = list(r.adjs) + list(r.nouns)
    rng.shuffle(words)
    for i in range(0, len(words) - 1, 2):
        value = rng.randint(10 ** 6, 10 ** 7 - 1)
        out.append(f"One of the special magic numbers for {words[i]}-{words[i + 1]} is: {value}.")
    return out


def build(vocab: int, texts_iter, min_frequency: int = 2) -> Tokenizer:
    tk = Tokenizer(models.BPE(unk_token=None, byte_fallback=False, fuse_unk=False))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=min_frequency, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(texts_iter, trainer=trainer)
    bos = tk.token_to_id("<bos>")
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                      special_tokens=[("<bos>", bos)])
    return tk


def save(tk: Tokenizer, out: Path, max_len: int = 32768) -> None:
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   model_max_length=max_len, clean_up_tokenization_spaces=False)
    fast.save_pretrained(str(out))
    stm = out / "special_tokens_map.json"
    if not stm.exists():  # transformers 5 folds this into tokenizer_config.json; write it for older readers
        stm.write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}, indent=2))


def report(path: Path) -> dict:
    """Token counts of a niah prompt's pieces, loaded back through AutoTokenizer (what ruler.py will see)."""
    from transformers import AutoTokenizer

    from gdnviz.probes import ruler

    tok = AutoTokenizer.from_pretrained(str(path))
    s = ruler.generate("niah_single_1", tok, 1024, seed=0)
    m = ruler.generate("niah_multikey_3", tok, 1024, seed=0)
    key = s.prompt.split("What is the special magic number for ")[1].split(" mentioned")[0]
    uuid_key = m.prompt.split("What is the special magic uuid for ")[1].split(" mentioned")[0]
    pieces = lambda t: tok.convert_ids_to_tokens(tok(t, add_special_tokens=False)["input_ids"])  # noqa: E731
    info = {
        "vocab_size": len(tok),
        "bos_eos_pad": [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id],
        "bos_prepended": tok("hello")["input_ids"][0] == tok.bos_token_id,
        "niah_single_1@1024": {"prompt_tokens": s.n_tokens, "key": key, "key_tokens": pieces(" " + key),
                               "value": s.answers[0], "value_tokens": pieces(" " + s.answers[0] + ".")},
        "uuid": {"key": uuid_key, "tokens": len(pieces(" " + uuid_key))},
        "noise_line_tokens": len(pieces(ruler.NOISE + "\n")),
        "roundtrip_ok": tok.decode(s.input_ids, skip_special_tokens=True) == s.prompt,
    }
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", default="out/demo/corpus")
    ap.add_argument("--out", default="out/demo/tokenizer")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--synthetic-per-task", type=int, default=300)
    ap.add_argument("--max-mb", type=float, default=0.0, help="use at most this much corpus text (0: all)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    texts = []
    size = 0
    with gzip.open(Path(args.corpus) / "train.jsonl.gz", "rt", encoding="utf-8") as f:
        for line in f:
            t = json.loads(line)["text"]
            texts.append(t)
            size += len(t)
            if args.max_mb and size > args.max_mb * 1e6:
                break
    syn = synthetic_texts(args.synthetic_per_task, args.seed)
    print(f"training BPE ({args.vocab}) on {len(texts)} corpus docs ({size / 1e6:.1f} MB) + {len(syn)} synthetic "
          f"({sum(map(len, syn)) / 1e6:.1f} MB)", flush=True)
    tk = build(args.vocab, texts + syn)
    out = Path(args.out)
    save(tk, out)
    info = report(out)
    (out / "tokenizer_report.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
