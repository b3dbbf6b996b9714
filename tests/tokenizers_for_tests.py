"""Small local tokenizers for probe tests: a byte-level BPE trained on RULER-style text from gdnviz's own generators.

``build(dir)`` trains once and saves two loadable tokenizer folders under ``dir``: ``plain/`` (adds a BOS
``<s>`` like Llama's tokenizers do) and ``chat/`` (same vocabulary, plus a ChatML-like Jinja chat template that
starts with the BOS text). ``load(folder)`` reads one back (also from a subprocess). Nothing is downloaded.
"""
from __future__ import annotations

import random
from pathlib import Path

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def corpus(n_seeds: int = 24) -> list[str]:
    """RULER-style prompts (plain, no tokenizer needed), a few hundred KB in all."""
    from gdnviz.probes import ruler

    texts = []
    for seed in range(n_seeds):
        for task, size, target in (("niah_single_1", 30, 2048), ("niah_multikey_2", 40, 2048),
                                   ("niah_multikey_3", 25, 2048), ("cwe", 120, 2048), ("cwe", 60, 8192),
                                   ("fwe", 900, 8192)):
            job = ruler._Job(task, None, target, seed, False, None)
            texts.append(job.render(size)[0])
        job = ruler._Job("vt", None, 2048, seed, False, None)
        text, prefix, names = job._vt_text(random.Random(seed), 20, is_icl=bool(seed % 2))
        texts.append(text + prefix + " " + " ".join(names))
    return texts


def build(root: str | Path, vocab_size: int = 1200) -> tuple[Path, Path]:
    """Train the BPE and save ``root/plain`` and ``root/chat``; returns both folders."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(corpus(), trainer=trainer)
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                      special_tokens=[("<s>", tk.token_to_id("<s>"))])
    root = Path(root)
    out = []
    for name, template in (("plain", None), ("chat", CHAT_TEMPLATE)):
        tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tk.to_str()), bos_token="<s>",
                                      eos_token="</s>", additional_special_tokens=SPECIALS[2:],
                                      model_max_length=1 << 24)
        if template is not None:
            tok.chat_template = template
        tok.save_pretrained(root / name)
        out.append(root / name)
    return out[0], out[1]


def load(folder: str | Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(folder))
