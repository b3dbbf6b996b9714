#!/usr/bin/env python3
"""Train gdnviz's bundled demo model: a small Qwen3.5 GDN hybrid that answers RULER-style retrieval prompts.

Recipe (after shared/probes/demo_calibration2.py, which learned single-needle retrieval in ~2 H200 minutes):
- ``Qwen3_5ForCausalLM``: GDN layers with full attention every 4th layer, GDN heads d_k = d_v = 128, tied
  embeddings, vocabulary of our BPE (digits are single tokens).
- Rows of ``T`` tokens packed with many samples: RULER-format prompts (niah_single_1, niah_multikey_2,
  niah_multikey_3, vt, cwe, fwe; built by synth.py, identical text to ruler.py's) followed by their answer and
  EOS, plus slices of English text (the corpus). Every sample starts with BOS.
- Loss = mean next-token loss over all tokens + mean loss over answer tokens (the reference answer after the
  answer prefix, up to and including EOS).
- Curriculum over sample length (``--curriculum``, piecewise linear in the fraction of planned steps): the
  longest sample starts at ~200 tokens (a needle and one noise line: rows packed with ~15 samples each, as in
  the calibration), reaches 1K at 50%, 2K at 70% and ``--max-len`` (4K) at 85% of the steps (the first H200
  run, which reached 4K-token rows at 35%, learned no retrieval by step 400; half the steps on cheap 1K rows is
  what the calibration did); sample lengths
  are uniform up to that bound (``--long-frac`` of them at the bound); rows grow 1024 -> 2048 -> 4096 tokens;
  tokens per step stay fixed, so early steps carry many short samples (dense answer signal) and are cheap.
- GDN decay gates initialised Mamba-style (``--gate-init mamba``: horizons ~1-1000 tokens at init) and the
  full-attention layers' output zeroed with probability ``--attn-drop`` (0.5) per layer and step, so that the GDN
  heads learn to carry retrieval too (v2). Run 2 (shipped as demo v1) had neither: it answered every task through
  its two attention layers while 11 of its 12 GDN heads kept a horizon of ~1 token (alpha ~ 1e-5 from
  transformers' init, where the decay gradient vanishes), so cutting the GDN state changed no answer.
  ``--preset v3`` (32 GDN heads) instead spreads the heads' initial horizons over 2-4096 tokens (``--gate-init
  spread``) and zeroes attention per packed sample with a chance by task (``--attn-drop-mode sample``): its
  recipe is ``RECIPES["v3"]``, argued in scripts/demo/README.md.
- AdamW(0.9, 0.95), wd 0.01, lr 1e-3, linear warm-up, linear decay to 0.1x over the last ``--decay-frac``;
  bf16 autocast; grad clip 1.0; fixed seed. transformers' own PyTorch GDN kernels (fla is never used).
- Data of step s is a pure function of (seed, s): DataLoader workers build whole batches, so resuming at step s
  replays exactly the stream an uninterrupted run would have seen.
- Every ``--eval-every`` steps: ruler.py prompts (``generate_many`` on held-out seeds, our tokenizer, plain
  template) scored with ruler.py's scorer on the greedy (argmax) answer under teacher forcing, plus held-out
  perplexity, the same prompts with every attention layer zeroed (``tf_no_attention``: what the GDN heads carry
  alone) and each GDN head's horizon at a = 0 (``gate_horizons``); one JSON line each. Early stop when
  niah_single_1 has not started to work by ``--early-stop-step``.
- Checkpoint (``--out``: ckpt-NN.safetensors shards <= 15 MiB, meta.json, loss.csv, evals.jsonl) every
  ``--ckpt-minutes`` and at the end: weights and Adam's second moment (bf16 for matrices, fp32 for vectors), step,
  RNG states, eval history. ``--resume [DIR]`` continues from it (same args; data stream continues at the step).
- ``--export DIR``: a Hugging Face directory (config.json, model.safetensors <= 25 MB: bf16 matrices, fp32
  vectors; tokenizer files; generation_config.json; metrics.json; loss_curve.csv). ``--export-only`` makes it from
  the checkpoint in ``--resume``/``--out`` without training.

CPU smoke test:  python scripts/demo/train.py --smoke --out out/demo/smoke --minutes 1.5
H200:           see scripts/demo/README.md
"""
from __future__ import annotations

import argparse
import csv
import gzip
import hashlib
import inspect
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

PRESETS = {
    # demo v2 (shipped): ~9.3M parameters with an 8K vocabulary, 18.7 MB in bf16; 12 GDN heads (6 layers x 2)
    "full": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=2),
    # demo v3: 13.8M parameters, 27.7 MB in bf16; 32 GDN heads (8 layers x 4, at 0-2, 4-6, 8, 9), attention at 3, 7
    "v3": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=10, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=4),
    # CPU smoke test: same layer pattern and GDN head size, narrower and shallower
    "smoke": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=64, linear_num_key_heads=1, linear_num_value_heads=1),
}
PRESETS["v3b"] = PRESETS["v3"]  # demo v3b (prepared, not trained): v3's architecture, another recipe
# Per preset, the defaults of the recipe arguments it was (or is to be) trained with; the command line overrides
# them. v2 ("full") and the smoke model use the plain argument defaults. v3's choices are argued, and marked as
# guesses to check, in scripts/demo/README.md ("v3 recipe").
RECIPES = {
    "full": {}, "smoke": {},
    "v3": dict(task_weights="niah_single_1:0.12,niah_multikey_2:0.26,niah_multikey_3:0.16,vt:0.14,cwe:0.18,"
                            "fwe:0.14",
               attn_drop_mode="sample",
               attn_drop_by_task="niah_single_1:0.75,vt:0.75,niah_multikey_2:0.1,niah_multikey_3:0.1,cwe:0.25,"
                                 "fwe:0.5,text:0.5",
               gate_init="spread", horizons="2:4096"),
    # v3 with attention never zeroed in the first 35% of the plan (v1's setting, which learned multi-key by step
    # 700), then never on a multi-key sample (v3 zeroed it in 10% of them), and a plan of 24 training minutes
    # (three 8-minute device calls, ~2,200 steps at v3's benchmark) instead of 16 (1,460 steps).
    "v3b": dict(task_weights="niah_single_1:0.12,niah_multikey_2:0.26,niah_multikey_3:0.16,vt:0.14,cwe:0.18,"
                             "fwe:0.14",
                attn_drop_mode="sample",
                attn_drop_by_task="niah_single_1:0.75,vt:0.75,niah_multikey_2:0,niah_multikey_3:0,cwe:0.25,"
                                  "fwe:0.5,text:0.5",
                attn_keep_until=0.35, gate_init="spread", horizons="2:4096", plan_minutes=24.0),
}
RECIPE_DEFAULTS = dict(task_weights="niah_single_1:0.30,niah_multikey_2:0.25,niah_multikey_3:0.05,vt:0.18,"
                                    "cwe:0.11,fwe:0.11",
                       attn_drop=0.5, attn_drop_mode="layer", attn_drop_by_task="", attn_keep_until=0.0,
                       gate_init="mamba",
                       horizons="2:4096", plan_minutes=None)
TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "vt", "cwe", "fwe")
TASK_IDS = {t: i + 1 for i, t in enumerate(TASKS)}  # answer-mask values (0: not an answer token)
EVAL_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "vt", "cwe", "fwe")
EVAL_SEED0 = 500_000  # in-training eval seeds; evaluate.py uses 1_000_000+; training draws 62-bit random seeds
SHARD_BYTES = 15 * 2 ** 20


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="Train the gdnviz demo GDN hybrid (see module docstring).")
    ap.add_argument("--out", default=None, help="checkpoint/log directory (written; required unless --describe)")
    ap.add_argument("--corpus", default="out/demo/corpus", help="dir with train.jsonl.gz and heldout.jsonl.gz")
    ap.add_argument("--tokenizer", default="out/demo/tokenizer")
    ap.add_argument("--pylib", default=None, help="extra sys.path entry (e.g. a carried wonderwords package)")
    ap.add_argument("--cache-dir", default=None, help="tokenized-corpus cache (default: <out>/../.cache-<name>)")
    ap.add_argument("--resume", nargs="?", const="__out__", default=None,
                    help="continue from the checkpoint in DIR (default: --out)")
    ap.add_argument("--export", default=None, help="write the Hugging Face model directory here at the end")
    ap.add_argument("--export-only", action="store_true", help="only export the checkpoint (needs --export)")
    ap.add_argument("--describe", action="store_true",
                    help="print the preset's size (parameters, shipped bytes, GDN heads) and recipe, then exit")
    ap.add_argument("--smoke", action="store_true", help="CPU smoke test: small model, 1K rows, frequent evals")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None)
    ap.add_argument("--minutes", type=float, default=8.0, help="wall-clock budget of this run's training loop")
    ap.add_argument("--total-steps", default=None,
                    help="planned steps (curriculum, lr decay), or 'auto': fit them into --minutes from a short "
                         "throughput benchmark of each row length (default auto; smoke 40; a resumed run keeps "
                         "the checkpoint's)")
    ap.add_argument("--tokens-per-step", type=int, default=None, help="default 65536 (smoke 2048)")
    ap.add_argument("--max-len", type=int, default=None, help="curriculum: longest sample at the end (4096)")
    ap.add_argument("--curriculum", default=None,
                    help="knots 'frac:len,...' of the longest sample vs fraction of --total-steps (lengths are "
                         "capped at --max-len); default 0:200,0.5:1024,0.7:2048,0.85:4096 (smoke 0:200,0.6:1024)")
    ap.add_argument("--long-frac", type=float, default=0.15, help="share of samples at the current max length")
    ap.add_argument("--text-frac", type=float, default=0.15, help="chance that a segment is corpus text")
    ap.add_argument("--task-weights", default=None,
                    help="'task:w,...' share of each task among task samples (default: the preset's recipe)")
    ap.add_argument("--gate-init", choices=["mamba", "spread", "hf"], default=None,
                    help="GDN decay init: 'mamba' = dt log-uniform in [1e-3, 0.1] (dt_bias = softplus^-1(dt)), "
                         "A uniform in [1, 16]: horizons ~1..1000 tokens; 'spread' = every head a horizon of its "
                         "own, log-spaced over --horizons, each layer spanning the whole range (see "
                         "init_gdn_gates_spread); 'hf' = transformers' init (dt_bias 1, A in [0.01, 16]: most "
                         "heads start with alpha ~ 1e-5 and stayed there in run 1)")
    ap.add_argument("--horizons", default=None, help="'lo:hi' tokens, the horizon range of --gate-init spread")
    ap.add_argument("--attn-drop", type=float, default=None,
                    help="modes 'layer'/'all': chance per step (and layer) that attention output is zeroed "
                         "(stochastic depth on attention only), so that the GDN heads learn to carry retrieval")
    ap.add_argument("--attn-drop-mode", choices=["layer", "all", "sample"], default=None,
                    help="'layer': each attention layer dropped independently per step; 'all': every attention "
                         "layer dropped together (GDN-only steps with chance --attn-drop); 'sample': every "
                         "attention layer's output zeroed on the tokens of one packed sample, with the chance "
                         "--attn-drop-by-task gives its task (or 'text')")
    ap.add_argument("--attn-drop-by-task", default=None,
                    help="mode 'sample': 'task:p,...,text:p', the chance that a sample's tokens get no attention")
    ap.add_argument("--attn-keep-until", type=float, default=None,
                    help="fraction of the planned steps before which attention is never zeroed (every mode); the "
                         "drop draws are made all the same, so later steps see the same drops as without it")
    ap.add_argument("--plan-minutes", type=float, default=None,
                    help="with --total-steps auto: the training-loop minutes to plan the steps for, summed over "
                         "all the calls the run will take (default: --minutes, one call)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=None, help="default 200 (smoke 5)")
    ap.add_argument("--decay-frac", type=float, default=0.25)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--eval-every", type=int, default=None, help="default 100 (smoke 25)")
    ap.add_argument("--eval-n", type=int, default=None, help="prompts per task x length (default 16, smoke 2)")
    ap.add_argument("--eval-lens", default=None, help="default 1024,2048,4096 (smoke 1024)")
    ap.add_argument("--early-stop-step", type=int, default=None, help="default 50%% of --total-steps")
    ap.add_argument("--early-stop-min", type=float, default=5.0,
                    help="stop if niah_single_1 (best eval length) scores below this at --early-stop-step")
    ap.add_argument("--ckpt-minutes", type=float, default=3.0)
    ap.add_argument("--ckpt-momentum", action="store_true", help="also keep Adam's first moment (+50%% size)")
    ap.add_argument("--final-greedy-n", type=int, default=None,
                    help="free-running greedy decode check at the end, prompts per task at the longest eval "
                         "length (default 4 on CUDA, 1 on CPU)")
    ap.add_argument("--workers", type=int, default=None, help="DataLoader workers (default: cores - 2, max 12)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=10)
    a = ap.parse_args(argv)
    if a.out is None and not a.describe:
        ap.error("the following arguments are required: --out")
    sm = a.smoke
    if a.preset is None:
        a.preset = "smoke" if sm else "full"
    for k, v in {**RECIPE_DEFAULTS, **RECIPES[a.preset]}.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.task_weights = parse_shares(a.task_weights, TASKS, "--task-weights")
    a.attn_drop_by_task = parse_shares(a.attn_drop_by_task, TASKS + ("text",), "--attn-drop-by-task")
    if a.attn_drop_mode == "sample" and not a.attn_drop_by_task:
        raise SystemExit("--attn-drop-mode sample needs --attn-drop-by-task 'task:p,...'")
    if not 0.0 <= a.attn_keep_until <= 1.0:
        raise SystemExit(f"--attn-keep-until {a.attn_keep_until}: need a fraction in [0, 1]")
    lo, hi = (float(x) for x in str(a.horizons).split(":"))
    if not 1.0 < lo < hi:
        raise SystemExit(f"--horizons {a.horizons!r}: need 1 < lo < hi (tokens)")
    dflt = dict( total_steps="40" if sm else "auto",
                tokens_per_step=2048 if sm else 65536,
                max_len=1024 if sm else 4096, warmup=5 if sm else 200, eval_every=25 if sm else 100,
                eval_n=2 if sm else 16, eval_lens="1024" if sm else "1024,2048,4096")
    for k, v in dflt.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.curriculum is None:
        a.curriculum = "0:200,0.6:1024" if sm else "0:200,0.5:1024,0.7:2048,0.85:4096"
    knots = sorted((float(f), int(n)) for f, n in (k.split(":") for k in a.curriculum.split(",")))
    a.knots = [(f, min(n, a.max_len)) for f, n in knots]
    a.total_steps = int(a.total_steps) if str(a.total_steps).isdigit() else "auto"
    a.eval_lens = [int(x) for x in str(a.eval_lens).split(",") if x]
    if a.resume == "__out__" or (a.export_only and not a.resume):
        a.resume = a.out
    return a


def parse_shares(text, names, flag: str) -> dict[str, float]:
    """'name:x,...' -> {name: x}; a clear SystemExit on an unknown name or a value outside [0, 1]."""
    if isinstance(text, dict):
        return text
    out = {}
    for item in (x for x in str(text).split(",") if x.strip()):
        name, _, val = item.partition(":")
        if name not in names:
            raise SystemExit(f"{flag}: unknown name {name!r} (known: {', '.join(names)})")
        try:
            out[name] = float(val)
        except ValueError:
            raise SystemExit(f"{flag}: {item!r} is not name:number") from None
        if not 0.0 <= out[name] <= 1.0:
            raise SystemExit(f"{flag}: {item!r} is outside [0, 1]")
    return out


def attention_dropping(a) -> bool:
    return a.attn_drop_mode == "sample" or a.attn_drop > 0


# --- schedules ----------------------------------------------------------------------------------------------------
def row_lengths(a) -> list[int]:
    out, t = [], 1024
    while t < a.max_len:
        out.append(t)
        t *= 2
    return out + [a.max_len]


def attention_kept(step: int, a) -> bool:
    """True while no attention output may be zeroed: steps before ``--attn-keep-until`` x the planned steps (an int
    by the time batches are drawn: 'auto' is planned before the data loader starts)."""
    return int(step) < a.attn_keep_until * int(a.total_steps)


def shape_at(step: int, a) -> tuple[int, int, int]:
    """(longest sample, row length T, rows B) at ``step``."""
    f = step / max(1.0, float(a.total_steps))
    k = a.knots
    if f <= k[0][0]:
        cur = k[0][1]
    elif f >= k[-1][0]:
        cur = k[-1][1]
    else:
        j = next(i for i in range(1, len(k)) if f < k[i][0])
        (f0, n0), (f1, n1) = k[j - 1], k[j]
        cur = int(n0 + (n1 - n0) * (f - f0) / max(1e-9, f1 - f0))
    T = next(t for t in row_lengths(a) if t >= cur)
    return cur, T, max(1, a.tokens_per_step // T)


def lr_at(step: int, a) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    d0 = int(a.total_steps * (1 - a.decay_frac))
    if step < d0:
        return a.lr
    f = min(1.0, (step - d0) / max(1, a.total_steps - d0))
    return a.lr * (1 - 0.9 * f)


# --- data ---------------------------------------------------------------------------------------------------------
def read_docs(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def tokenize_stream(tk, docs: list[str], bos: int, eos: int):
    import numpy as np

    out = []
    for i in range(0, len(docs), 2048):
        for e in tk.encode_batch(docs[i:i + 2048], add_special_tokens=False):
            out.append([bos] + e.ids + [eos])
    flat = np.fromiter((t for d in out for t in d), dtype=np.uint16)
    return flat


class Batches:
    """Map-style dataset: item ``step`` is the whole batch of that step: inputs, targets, answer mask (task id per
    target token, 0 elsewhere), attention-drop mask (1 where every attention layer's output is to be zeroed at that
    input token; all 0 unless ``--attn-drop-mode sample``), stats."""

    def __init__(self, a, tok_file: str, text_file: str, ids: dict):
        self.a, self.tok_file, self.text_file, self.ids = a, tok_file, text_file, ids
        self._ready = False

    def _init(self):
        if self._ready:
            return
        import numpy as np
        from tokenizers import Tokenizer

        import synth

        tk = Tokenizer.from_file(self.tok_file)
        self.encode = lambda t: tk.encode(t, add_special_tokens=False).ids
        self.sampler = synth.Sampler(self.encode)
        self.text = np.load(self.text_file, mmap_mode="r")
        self.min_tok = {t: self.sampler.min_tokens(t) for t in TASKS}
        self.min_tok_cwe_big = self.sampler.min_tokens("cwe", 4096)
        self._ready = True

    def __len__(self):
        return 1 << 40

    def __getitem__(self, step: int):
        import numpy as np
        import torch

        self._init()
        a, bos, eos = self.a, self.ids["bos"], self.ids["eos"]
        rng = random.Random(a.seed * 1_000_003 + int(step))
        cur, T, B = shape_at(int(step), a)
        X = np.zeros((B, T + 1), dtype=np.int64)
        M = np.zeros((B, T + 1), dtype=np.int8)
        D = np.zeros((B, T + 1), dtype=np.int8)
        # the drop draws have their own stream, so the data of a step does not depend on the drop mode
        drop_rng = random.Random(a.seed * 1_000_033 + int(step)) if a.attn_drop_mode == "sample" else None
        st = {"text": 0, "task": 0, "answer": 0, "samples": 0, "attn_dropped": 0}
        tasks = [t for t in TASKS if a.task_weights.get(t, 0.0) > 0]
        weights = [a.task_weights[t] for t in tasks]
        for b in range(B):
            pos = 0
            while pos < T + 1:
                rem = T + 1 - pos
                seg = None
                if rng.random() >= a.text_frac:
                    hi = min(cur, rem)
                    ok = [(t, w) for t, w in zip(tasks, weights) if self.min_tok[t] <= hi]
                    if ok:
                        task = kind = rng.choices([t for t, _ in ok], [w for _, w in ok])[0]
                        lo = self.min_tok[task]
                        L = hi if rng.random() < a.long_frac else rng.randint(lo, hi)
                        if task == "cwe" and 3072 < L < self.min_tok_cwe_big:
                            L = min(L, 3072)
                        r = self.sampler.sample(task, L, rng)
                        if r is not None:
                            p_ids, ans_ids, _ = r
                            seg = [bos] + p_ids + ans_ids + [eos]
                            X[b, pos:pos + len(seg)] = seg
                            M[b, pos + 1 + len(p_ids):pos + len(seg)] = TASK_IDS[task]
                            st["task"] += len(seg)
                            st["answer"] += len(ans_ids) + 1
                            st["samples"] += 1
                if seg is None:
                    L = rem if rem < 160 else min(rem, rng.randint(64, max(64, cur)))
                    off = rng.randrange(0, len(self.text) - L - 1)
                    X[b, pos:pos + L] = self.text[off:off + L]
                    st["text"] += L
                    kind = "text"
                else:
                    L = len(seg)
                if (drop_rng is not None and drop_rng.random() < a.attn_drop_by_task.get(kind, 0.0)
                        and not attention_kept(step, a)):
                    D[b, pos:pos + L] = 1
                    st["attn_dropped"] += L
                pos += L
        X, M, D = torch.from_numpy(X), torch.from_numpy(M), torch.from_numpy(D)
        return X[:, :-1].contiguous(), X[:, 1:].contiguous(), M[:, 1:].contiguous(), D[:, :-1].contiguous(), st


class StepSampler:
    def __init__(self, start: int, stop: int):
        self.start, self.stop = start, stop

    def __iter__(self):
        return iter(range(self.start, self.stop))

    def __len__(self):
        return self.stop - self.start


# --- model --------------------------------------------------------------------------------------------------------
def use_torch_gdn_kernels() -> None:
    """Point transformers' GDN kernel names at their PyTorch bodies (fla is never used, on any device)."""
    import importlib

    for modname in ("transformers.models.qwen3_5.modeling_qwen3_5",):
        mod = importlib.import_module(modname)
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            fn = getattr(mod, name)
            setattr(mod, name, inspect.unwrap(getattr(fn, "__gdnviz_original__", fn)))


def make_config(preset: str, vocab: int, ids: dict):
    from transformers import Qwen3_5TextConfig

    p = PRESETS[preset]
    n = p["num_hidden_layers"]
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    return Qwen3_5TextConfig(vocab_size=vocab, linear_key_head_dim=128, linear_value_head_dim=128,
                             linear_conv_kernel_dim=4, tie_word_embeddings=True, max_position_embeddings=32768,
                             layer_types=layer_types, bos_token_id=ids["bos"], eos_token_id=ids["eos"],
                             pad_token_id=ids["pad"], **p)


def model_size(cfg) -> dict:
    """Parameter count, bytes as shipped (bf16 matrices, fp32 vectors; the tied head counted once) and GDN heads
    of a config, from a model built on the meta device (no memory, no weights)."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    with torch.device("meta"):
        m = Qwen3_5ForCausalLM(cfg)
    ps = list(m.parameters())
    return {"params": sum(p.numel() for p in ps),
            "ship_bytes": sum(p.numel() * (2 if p.dim() >= 2 else 4) for p in ps),
            "gdn_heads": cfg.linear_num_value_heads * cfg.layer_types.count("linear_attention"),
            "gdn_layers": [i for i, t in enumerate(cfg.layer_types) if t == "linear_attention"],
            "attn_layers": [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]}


def ship_dtype(t):
    import torch

    return torch.bfloat16 if t.dim() >= 2 else torch.float32


def benchmark(model, opt, a, dev, vocab: int) -> dict[int, float]:
    """Seconds per optimizer step at each row length (random tokens, same shapes as training)."""
    import torch

    out = {}
    for T in row_lengths(a):
        B = max(1, a.tokens_per_step // T)
        x = torch.randint(0, vocab, (B, T + 1), device=dev)
        times = []
        for i in range(5):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = time.time()
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                logits = model(input_ids=x[:, :-1], use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), x[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.time() - t)
        out[T] = sorted(times[2:])[1]
        del logits, loss, x
    return out


def plan_total_steps(a, sec_per_step: dict[int, float], eval_s: float, budget_s: float) -> int:
    """Largest step count whose curriculum (its share of steps at each row length) + evals fit ``budget_s``."""
    best = 10
    for total in range(10, 100000, 10):
        probe = argparse.Namespace(**{**vars(a), "total_steps": total})
        t = sum(sec_per_step[shape_at(s, probe)[1]] for s in range(0, total, 5)) * 5
        t += (total // a.eval_every) * eval_s
        if t > budget_s:
            break
        best = total
    return best


# --- GDN gates and attention drop ----------------------------------------------------------------------------
def init_gdn_gates(model, dt_min: float = 1e-3, dt_max: float = 0.1) -> None:
    """Mamba-style decay init of every GDN layer (seeded by the caller's torch.manual_seed).

    g = -exp(A_log) * softplus(a + dt_bias) with a ~ 0 at init: dt = softplus(dt_bias) log-uniform in
    [dt_min, dt_max] and A uniform in [1, 16] give -g in [1e-3, 1.6], i.e. horizons 1/(1 - alpha) from ~1 to
    ~1000 tokens. transformers' own init (dt_bias = 1, A in [0.01, 16]) starts most heads at alpha ~ 1e-5, where
    the decay gradient vanishes: in the first demo run 11 of 12 heads never remembered more than one token."""
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            la = getattr(layer, "linear_attn", None)
            if la is None:
                continue
            n = la.dt_bias.numel()
            dt = torch.exp(torch.empty(n).uniform_(math.log(dt_min), math.log(dt_max)))
            la.dt_bias.copy_((dt + torch.log(-torch.expm1(-dt))).to(la.dt_bias))
            la.A_log.copy_(torch.empty(n).uniform_(1.0, 16.0).log().to(la.A_log))


def init_gdn_gates_spread(model, h_lo: float, h_hi: float) -> None:
    """Every GDN head gets a decay horizon of its own at a = 0 (seeded by the caller's torch.manual_seed for A).

    The N heads' horizons h = 1 / (1 - alpha) are log-spaced over [h_lo, h_hi]; head j of GDN layer l (L layers)
    gets the (j * L + l)-th shortest, so every layer has one head in each of the H equal slices of the range (a
    short one, ..., a long one) and within a slice deeper layers are longer. alpha = exp(g), g = -A * softplus(
    a + dt_bias): A is drawn uniform in [1, 16] as in the mamba init and dt_bias = softplus^-1(-log(alpha) / A)."""
    import torch

    layers = [l.linear_attn for l in model.model.layers if getattr(l, "linear_attn", None) is not None]
    L, H = len(layers), layers[0].dt_bias.numel()
    hs = torch.logspace(math.log10(h_lo), math.log10(h_hi), L * H, dtype=torch.float64)
    with torch.no_grad():
        for l, la in enumerate(layers):
            h = hs[torch.arange(H) * L + l]
            A = torch.empty(H, dtype=torch.float64).uniform_(1.0, 16.0)
            dt = -torch.log1p(-1.0 / h) / A
            la.dt_bias.copy_((dt + torch.log(-torch.expm1(-dt))).to(la.dt_bias))
            la.A_log.copy_(A.log().to(la.A_log))


def gate_horizons(model) -> list:
    """Per GDN layer, per head: 1 / (1 - alpha) at a = 0 (alpha = exp(-exp(A_log) softplus(dt_bias))), tokens."""
    import torch

    out = []
    for layer in model.model.layers:
        la = getattr(layer, "linear_attn", None)
        if la is None:
            continue
        g = -la.A_log.detach().float().exp() * torch.nn.functional.softplus(la.dt_bias.detach().float())
        out.append([round(float(1.0 / max(1e-9, 1.0 - math.exp(x))), 1) for x in g.tolist()])
    return out


class AttentionDrop:
    """Forward hooks that zero chosen full-attention layers' attention output (the residual stream then skips
    them). ``set(layers, tokens)`` chooses the layers for the next forward and, optionally, the tokens: ``tokens``
    [B, T] (nonzero = zero the output at that position; None = at every position); ``set(None)`` switches all
    off."""

    def __init__(self, model):
        self.layers = [i for i, l in enumerate(model.model.layers) if getattr(l, "self_attn", None) is not None]
        self.active: set = set()
        self.keep = None
        for i in self.layers:
            model.model.layers[i].self_attn.register_forward_hook(self._hook(i))

    def _hook(self, i):
        def hook(module, args, out):
            if i not in self.active:
                return None
            keep = 0.0 if self.keep is None else self.keep.to(out[0].dtype)
            return (out[0] * keep,) + tuple(out[1:])
        return hook

    def set(self, layers, tokens=None) -> None:
        self.active = set(layers or ())
        self.keep = None if tokens is None else (tokens == 0)[..., None]

    def draw(self, rng, p: float, mode: str = "layer") -> list:
        """Attention layers to zero this step: each with chance ``p`` (``mode="layer"``), or all of them together
        with chance ``p`` (``mode="all"``: the other steps keep every attention layer)."""
        if mode == "all":
            return list(self.layers) if rng.random() < p else []
        return [i for i in self.layers if rng.random() < p]


# --- checkpoints --------------------------------------------------------------------------------------------------
def save_checkpoint(out: Path, model, opt, meta: dict, momentum: bool) -> None:
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, p in model.named_parameters():
        tensors["p/" + name] = p.detach().to(ship_dtype(p)).cpu().contiguous()
        s = opt.state.get(p, {})
        if "exp_avg_sq" in s:
            tensors["v/" + name] = s["exp_avg_sq"].detach().to(ship_dtype(p)).cpu().contiguous()
            if momentum:
                tensors["m/" + name] = s["exp_avg"].detach().to(ship_dtype(p)).cpu().contiguous()
    shards, cur, size = [], {}, 0
    for k, t in tensors.items():
        nb = t.numel() * t.element_size()
        if cur and size + nb > SHARD_BYTES:
            shards.append(cur)
            cur, size = {}, 0
        cur[k], size = t, size + nb
    if cur:
        shards.append(cur)
    names = []
    for i, sh in enumerate(shards):
        fn = f"ckpt-{i:02d}.safetensors"
        save_file(sh, str(out / (fn + ".tmp")), metadata={"format": "pt"})
        names.append(fn)
    for fn in names:
        os.replace(out / (fn + ".tmp"), out / fn)
    for old in out.glob("ckpt-*.safetensors"):
        if old.name not in names:
            old.unlink()
    meta = dict(meta, shards=names)
    if torch.cuda.is_available():
        meta["cuda_rng"] = torch.cuda.get_rng_state().tolist()
    meta["cpu_rng"] = torch.get_rng_state().tolist()
    (out / "meta.json.tmp").write_text(json.dumps(meta))
    os.replace(out / "meta.json.tmp", out / "meta.json")


def load_checkpoint(src: Path):
    from safetensors.torch import load_file

    meta = json.loads((src / "meta.json").read_text())
    tensors = {}
    for fn in meta["shards"]:
        tensors.update(load_file(str(src / fn)))
    return meta, tensors


def restore(model, opt, tensors: dict, opt_steps: int) -> None:
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(tensors["p/" + name].to(p.dtype))
    if opt is None:
        return
    state = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        if "v/" + name not in tensors:
            continue
        v = tensors["v/" + name].to(device=p.device, dtype=p.dtype)
        m = tensors.get("m/" + name)
        m = torch.zeros_like(p) if m is None else m.to(device=p.device, dtype=p.dtype)
        state[i] = {"step": torch.tensor(float(opt_steps)), "exp_avg": m, "exp_avg_sq": v}
    sd = opt.state_dict()
    opt.load_state_dict({"state": state, "param_groups": sd["param_groups"]})


def export_hf(model, cfg, tok_dir: Path, dst: Path, metrics: dict, loss_rows: list[dict]) -> dict:
    """HF directory: config, one safetensors (bf16 matrices, fp32 vectors, tied head omitted), tokenizer."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    dst.mkdir(parents=True, exist_ok=True)
    sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    tensors = {k: v.detach().to(ship_dtype(v)).cpu().contiguous() for k, v in sd.items()}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(dst / "model.safetensors", 0o644)
    cfg = type(cfg).from_dict(cfg.to_dict())
    cfg.dtype = "bfloat16"
    cfg.use_cache = True
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    cfg.save_pretrained(str(dst))
    GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
                     do_sample=False).save_pretrained(str(dst))
    for fn in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tok_dir / fn).exists():
            shutil.copy(tok_dir / fn, dst / fn)
    (dst / "metrics.json").write_text(json.dumps(metrics, indent=1))
    write_csv(dst / "loss_curve.csv", loss_rows)
    return {"dir": str(dst), "weights_bytes": (dst / "model.safetensors").stat().st_size}


def write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    keys = list(rows[0])
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def read_csv(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return [dict(r) for r in csv.DictReader(f)]


# --- evaluation ---------------------------------------------------------------------------------------------------
def build_evalset(hf_tok, a, ids) -> list[dict]:
    """ruler.py prompts on held-out seeds; answer ids appended for teacher-forced greedy scoring."""
    from gdnviz.probes import ruler

    import synth

    items = []
    for L in a.eval_lens:
        for task in EVAL_TASKS:
            try:
                samples = ruler.generate_many(task, hf_tok, L, a.eval_n, seed0=EVAL_SEED0 + L)
            except Exception as e:  # TaskTooShort at tiny lengths
                print(json.dumps({"event": "eval_skip", "task": task, "len": L, "why": str(e)[:200]}), flush=True)
                continue
            for s in samples:
                ans = hf_tok(synth.answer_text(task, s.answers), add_special_tokens=False)["input_ids"]
                items.append({"task": task, "len": L, "prompt_ids": list(s.input_ids), "answer_ids": ans + [ids["eos"]],
                              "answers": s.answers, "seed": s.seed, "prompt": s.prompt})
    return items


def eval_teacher_forced(model, items, hf_tok, dev, ids, max_tokens=65536) -> dict:
    """Greedy answer under teacher forcing, scored with ruler.score: the reference answer up to the first position
    where the argmax differs, plus that argmax token, i.e. exactly what free greedy decoding emits up to its first
    divergence. Equals the free-greedy score when the whole answer is right (niah); a lower bound otherwise."""
    import torch

    from gdnviz.probes import ruler

    model.eval()
    preds: dict[tuple, list] = {}
    order = sorted(range(len(items)), key=lambda i: len(items[i]["prompt_ids"]) + len(items[i]["answer_ids"]))
    i = 0
    ans_nll, ans_n = 0.0, 0
    with torch.no_grad():
        while i < len(order):
            L = len(items[order[i]]["prompt_ids"]) + len(items[order[i]]["answer_ids"])
            bsz = max(1, max_tokens // max(L, 1))
            group = order[i:i + bsz]
            i += len(group)
            Lm = max(len(items[j]["prompt_ids"]) + len(items[j]["answer_ids"]) for j in group)
            x = torch.full((len(group), Lm), ids["pad"], dtype=torch.long)
            for r, j in enumerate(group):
                seq = items[j]["prompt_ids"] + items[j]["answer_ids"]
                x[r, :len(seq)] = torch.tensor(seq)
            x = x.to(dev)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                logits = model(input_ids=x, use_cache=False).logits
            for r, j in enumerate(group):
                it = items[j]
                p, n = len(it["prompt_ids"]), len(it["answer_ids"])
                lg = logits[r, p - 1:p - 1 + n].float()
                tgt = torch.tensor(it["answer_ids"], device=dev)
                ans_nll += torch.nn.functional.cross_entropy(lg, tgt, reduction="sum").item()
                ans_n += n
                am, ref = lg.argmax(-1).tolist(), it["answer_ids"]
                k = next((q for q in range(n) if am[q] != ref[q]), n)
                got = ref[:k] + am[k:k + 1]  # what free greedy decoding emits up to its first divergence
                if ids["eos"] in got:
                    got = got[:got.index(ids["eos"])]
                preds.setdefault((it["task"], it["len"]), []).append((hf_tok.decode(got), it["answers"]))
    model.train()
    scores: dict[str, dict[str, float]] = {}
    for (task, L), pr in sorted(preds.items()):
        scores.setdefault(task, {})[str(L)] = ruler.score(task, [p for p, _ in pr], [r for _, r in pr])
    return {"tf": scores, "answer_nll": ans_nll / max(1, ans_n)}


def heldout_nll(model, heldout_ids, dev, window=1024, max_windows=256, batch=16) -> dict:
    import torch

    n_win = min(max_windows, (len(heldout_ids) - 1) // window)
    if n_win <= 0:
        return {}
    model.eval()
    tot, cnt = 0.0, 0
    with torch.no_grad():
        for s in range(0, n_win, batch):
            rows = [heldout_ids[(s + k) * window:(s + k) * window + window + 1].astype("int64")
                    for k in range(min(batch, n_win - s))]
            x = torch.tensor(rows, device=dev)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                logits = model(input_ids=x[:, :-1], use_cache=False).logits
            ce = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                   x[:, 1:].reshape(-1), reduction="sum")
            tot += ce.item()
            cnt += x[:, 1:].numel()
    model.train()
    return {"heldout_nll": tot / cnt, "heldout_ppl": math.exp(tot / cnt), "heldout_tokens": cnt}


def greedy_check(model, items, hf_tok, dev, ids, per_task: int) -> dict:
    """Free-running greedy decoding (model.generate) on the first prompts of the longest eval length."""
    import torch

    from gdnviz.probes import ruler

    if per_task <= 0 or not items:
        return {}
    L = max(it["len"] for it in items)
    model.eval()
    out: dict[str, list] = {}
    with torch.no_grad():
        for task in EVAL_TASKS:
            sel = [it for it in items if it["task"] == task and it["len"] == L][:per_task]
            for it in sel:
                x = torch.tensor([it["prompt_ids"]], device=dev)
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                    y = model.generate(x, max_new_tokens=len(it["answer_ids"]) + 8, do_sample=False,
                                       eos_token_id=ids["eos"], pad_token_id=ids["pad"])
                pred = hf_tok.decode(y[0, x.shape[1]:].tolist(), skip_special_tokens=True)
                out.setdefault(task, []).append((pred, it["answers"]))
    model.train()
    return {f"{t}@{L}": ruler.score(t, [p for p, _ in v], [r for _, r in v]) for t, v in out.items()}


# --- main ---------------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    a = parse_args(argv)
    if a.pylib:
        sys.path.insert(0, str(Path(a.pylib).resolve()))
    sys.path[:0] = [str(ROOT), str(HERE)]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

    import numpy as np
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM

    import synth

    tok_dir = Path(a.tokenizer)
    hf_tok = AutoTokenizer.from_pretrained(str(tok_dir))
    ids = {"bos": hf_tok.bos_token_id, "eos": hf_tok.eos_token_id, "pad": hf_tok.pad_token_id}
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device)
    use_torch_gdn_kernels()
    torch.manual_seed(a.seed)
    random.seed(a.seed)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"}

    cfg = make_config(a.preset, len(hf_tok), ids)
    size = model_size(cfg)
    if a.describe:
        print(json.dumps({"event": "describe", "preset": a.preset, "vocab": len(hf_tok), **size,
                          "ship_MB": round(size["ship_bytes"] / 1e6, 2),
                          "recipe": {k: getattr(a, k) for k in RECIPE_DEFAULTS}}), flush=True)
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    drop = {}

    def fresh():
        torch.manual_seed(a.seed)
        m = Qwen3_5ForCausalLM(cfg)
        if a.gate_init == "mamba":
            init_gdn_gates(m)
        elif a.gate_init == "spread":
            init_gdn_gates_spread(m, *(float(x) for x in a.horizons.split(":")))
        m = m.to(dev)
        o = torch.optim.AdamW(m.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=a.weight_decay)
        drop["hooks"] = AttentionDrop(m)
        return m, o

    model, opt = fresh()
    n_params = sum(p.numel() for p in model.parameters())

    start_step, tokens_seen, train_s, opt_steps = 0, 0, 0.0, 0
    loss_rows, eval_rows = [], []
    if a.resume:
        src = Path(a.resume)
        meta, tensors = load_checkpoint(src)
        start_step, tokens_seen = meta["step"], meta["tokens_seen"]
        if a.total_steps == "auto":
            a.total_steps = int(meta["args"]["total_steps"])
        train_s, opt_steps = meta["train_seconds"], meta["opt_steps"]
        restore(model, None if a.export_only else opt, tensors, opt_steps)
        if "cpu_rng" in meta:
            torch.set_rng_state(torch.tensor(meta["cpu_rng"], dtype=torch.uint8))
        if dev.type == "cuda" and "cuda_rng" in meta:
            torch.cuda.set_rng_state(torch.tensor(meta["cuda_rng"], dtype=torch.uint8))
        loss_rows = read_csv(src / "loss.csv")
        loss_rows = [r for r in loss_rows if int(r["step"]) < start_step]
        if (src / "evals.jsonl").exists():
            eval_rows = [json.loads(x) for x in (src / "evals.jsonl").read_text().splitlines() if x.strip()]
        if meta.get("args", {}).get("preset") not in (None, a.preset):
            raise SystemExit(f"checkpoint preset {meta['args']['preset']} != {a.preset}")
        print(json.dumps({"event": "resumed", "from": str(src), "step": start_step, "tokens_seen": tokens_seen}),
              flush=True)
    if a.export_only:
        if not a.export:
            raise SystemExit("--export-only needs --export DIR")
        metrics = json.loads((Path(a.resume or a.out) / "meta.json").read_text()).get("final", {})
        info = export_hf(model, cfg, tok_dir, Path(a.export), metrics, loss_rows)
        print(json.dumps({"event": "exported", **info}), flush=True)
        return 0

    # corpus -> token ids (cached)
    cache = Path(a.cache_dir) if a.cache_dir else out.parent / f".cache-{out.name}"
    cache.mkdir(parents=True, exist_ok=True)
    tk = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    tk_hash = hashlib.sha1((tok_dir / "tokenizer.json").read_bytes()).hexdigest()[:12]
    text_file, held_file = cache / f"train_ids_{tk_hash}.npy", cache / f"heldout_ids_{tk_hash}.npy"
    t0 = time.time()
    if not text_file.exists():
        np.save(text_file, tokenize_stream(tk, read_docs(Path(a.corpus) / "train.jsonl.gz"), ids["bos"], ids["eos"]))
    if not held_file.exists():
        np.save(held_file, tokenize_stream(tk, read_docs(Path(a.corpus) / "heldout.jsonl.gz"), ids["bos"], ids["eos"]))
    heldout_ids = np.load(held_file)
    tokenize_s = round(time.time() - t0, 1)
    bench = None
    if a.total_steps == "auto" and not a.export_only:
        t0 = time.time()
        bench = benchmark(model, opt, a, dev, len(hf_tok))
        model, opt = fresh()  # the benchmark's updates are thrown away: training starts from the seeded init
        print(json.dumps({"event": "benchmark", "sec_per_step": bench, "tokens_per_step": a.tokens_per_step,
                          "bench_s": round(time.time() - t0, 1)}), flush=True)
    print(json.dumps({"event": "start", "params": n_params, "ship_bytes": size["ship_bytes"],
                      "gdn_heads": size["gdn_heads"], "preset": a.preset, "vocab": len(hf_tok),
                      "layer_types": cfg.layer_types,
                      "train_text_tokens": int(np.load(text_file, mmap_mode="r").shape[0]),
                      "heldout_tokens": int(heldout_ids.shape[0]), "tokenize_s": tokenize_s,
                      "device": str(dev), **versions}), flush=True)

    bad = synth.check_against_ruler(hf_tok, [("niah_single_1", 9, 3, 2048), ("vt", 12, 4, 2048),
                                             ("cwe", 30, 5, 4096), ("fwe", 20, 6, 2048)])
    if bad:
        print(json.dumps({"event": "warning", "synth_differs_from_ruler": bad}), flush=True)
    t0 = time.time()
    evalset = build_evalset(hf_tok, a, ids)
    print(json.dumps({"event": "evalset", "n": len(evalset), "build_s": round(time.time() - t0, 1)}), flush=True)

    def run_eval(step):
        t = time.time()
        mt = 65536 if dev.type == "cuda" else 8192
        drop["hooks"].set(None)
        r = eval_teacher_forced(model, evalset, hf_tok, dev, ids, max_tokens=mt)
        if attention_dropping(a):  # the same prompts with every attention layer zeroed: what the GDN heads carry alone
            drop["hooks"].set(drop["hooks"].layers)
            r["tf_no_attention"] = eval_teacher_forced(model, evalset, hf_tok, dev, ids, max_tokens=mt)["tf"]
            drop["hooks"].set(None)
        r["gate_horizons"] = gate_horizons(model)
        r.update(heldout_nll(model, heldout_ids, dev, max_windows=256 if dev.type == "cuda" else 16,
                             batch=16 if dev.type == "cuda" else 4))
        row = {"event": "eval", "step": step, "tokens_seen": tokens_seen, "train_seconds": round(train_s, 1), **r,
               "eval_s": round(time.time() - t, 1)}
        print(json.dumps(row), flush=True)
        eval_rows.append(row)
        return row

    def checkpoint(step, final=None):
        meta = {"step": step, "tokens_seen": tokens_seen, "train_seconds": train_s, "opt_steps": opt_steps,
                "params": n_params, "config": cfg.to_dict(), "args": vars(a), "versions": versions,
                "final": final or {}}
        save_checkpoint(out, model, opt, meta, a.ckpt_momentum)
        write_csv(out / "loss.csv", loss_rows)
        (out / "evals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in eval_rows))

    model.train()
    t_run = time.time()
    t_ckpt = time.time()
    step = start_step
    stop_reason = "minutes"
    acc = {"loss": 0.0, "tok": 0.0, "ans": 0.0, "n": 0, "text": 0, "task": 0, "answer": 0, "samples": 0,
           "attn_dropped": 0}
    t_log = time.time()
    task_sum = torch.zeros(len(TASK_IDS) + 1, device=dev)
    task_cnt = torch.zeros(len(TASK_IDS) + 1, device=dev)
    if start_step == 0:
        r0 = run_eval(0)
    if a.total_steps == "auto":
        eval_s = r0["eval_s"] if start_step == 0 else 10.0
        budget = (a.plan_minutes or a.minutes) * 60 - 10 - (time.time() - t_run)
        a.total_steps = plan_total_steps(a, bench, eval_s, budget)
        print(json.dumps({"event": "plan", "total_steps": a.total_steps, "budget_s": round(budget),
                          "eval_s": eval_s, "tokens": a.total_steps * a.tokens_per_step}), flush=True)
    if a.early_stop_step is None:  # smoke runs are far too short to learn anything: never stop them early
        a.early_stop_step = 1 << 30 if a.smoke else int(0.5 * a.total_steps)
    workers = a.workers if a.workers is not None else max(1, min(12, (os.cpu_count() or 2) - 2))
    ds = Batches(a, str(tok_dir / "tokenizer.json"), str(text_file), ids)
    end_step = max(a.total_steps, start_step) + 100000
    loader = torch.utils.data.DataLoader(ds, batch_size=None, sampler=StepSampler(start_step, end_step),
                                         num_workers=workers, prefetch_factor=4 if workers else None,
                                         pin_memory=dev.type == "cuda", persistent_workers=False)
    for x, y, m, d, st in loader:
        if step >= a.total_steps:
            stop_reason = "done"
            break
        if time.time() - t_run > a.minutes * 60:
            break
        ts = time.time()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a)
        x, y, m = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True), m.to(dev, non_blocking=True)
        if a.attn_drop_mode == "sample":
            drop["hooks"].set(drop["hooks"].layers, d.to(dev, non_blocking=True))
        else:
            drop["hooks"].set(drop["hooks"].draw(random.Random(a.seed * 7919 + step), a.attn_drop,
                                                 a.attn_drop_mode) if a.attn_drop > 0 and not attention_kept(step, a)
                              else [])
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            logits = model(input_ids=x, use_cache=False).logits
        drop["hooks"].set(None)
        ce = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                                               reduction="none")
        tok_loss = ce.mean()
        mt = m.reshape(-1).long()
        mf = mt > 0
        ans_loss = ce[mf].mean() if bool(mf.any()) else torch.zeros((), device=dev)
        with torch.no_grad():
            oh = torch.nn.functional.one_hot(mt, len(TASK_IDS) + 1).float()
            task_sum += (ce.detach()[:, None] * oh).sum(0)
            task_cnt += oh.sum(0)
        loss = tok_loss + ans_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if not torch.isfinite(loss):
            stop_reason = "non-finite loss"
            print(json.dumps({"event": "stop", "why": stop_reason, "step": step}), flush=True)
            break
        opt.step()
        opt_steps += 1
        step += 1
        tokens_seen += x.numel()
        acc["loss"] += loss.item()
        acc["tok"] += tok_loss.item()
        acc["ans"] += ans_loss.item()
        acc["n"] += 1
        for k in ("text", "task", "answer", "samples", "attn_dropped"):
            acc[k] += st[k]
        train_s += time.time() - ts
        if step % a.log_every == 0 or step == start_step + 1:
            dt = time.time() - t_log
            n = acc["n"]
            cur, T, B = shape_at(step - 1, a)
            row = {"step": step, "tokens_seen": tokens_seen, "lr": round(lr_at(step - 1, a), 6),
                   "loss": round(acc["loss"] / n, 4), "token_loss": round(acc["tok"] / n, 4),
                   "answer_loss": round(acc["ans"] / n, 4), "grad_norm": round(float(gn), 3), "max_len": cur,
                   "row_len": T, "rows": B, "text_share": round(acc["text"] / max(1, acc["text"] + acc["task"]), 3),
                   "samples_per_step": round(acc["samples"] / n, 1),
                   "attn_dropped_share": round(acc["attn_dropped"] / max(1, acc["text"] + acc["task"]), 3),
                   "answer_loss_by_task": {t: round(float(task_sum[i] / task_cnt[i]), 3)
                                           for t, i in TASK_IDS.items() if task_cnt[i] > 0},
                   "tok_per_s": round(n * T * B / max(dt, 1e-9)), "elapsed_s": round(time.time() - t_run, 1)}
            loss_rows.append(row)
            print(json.dumps({"event": "train", **row}), flush=True)
            acc = {k: 0 for k in acc}
            task_sum.zero_()
            task_cnt.zero_()
            t_log = time.time()
        if step % a.eval_every == 0:
            r = run_eval(step)
            if a.early_stop_step <= step < a.early_stop_step + a.eval_every:
                best = max(r["tf"].get("niah_single_1", {"-": 0.0}).values())
                if best < a.early_stop_min:
                    stop_reason = f"not learning: niah_single_1 {best} < {a.early_stop_min} at step {step}"
                    print(json.dumps({"event": "stop", "why": stop_reason, "step": step}), flush=True)
                    break
        if time.time() - t_ckpt > a.ckpt_minutes * 60:
            checkpoint(step)
            t_ckpt = time.time()
            print(json.dumps({"event": "checkpoint", "step": step}), flush=True)
    del loader

    final = run_eval(step) if not eval_rows or eval_rows[-1]["step"] != step else eval_rows[-1]
    greedy_n = a.final_greedy_n if a.final_greedy_n is not None else (4 if dev.type == "cuda" else 1)
    t = time.time()
    g = greedy_check(model, evalset, hf_tok, dev, ids, greedy_n)
    final = dict(final, greedy=g, greedy_n=greedy_n, greedy_s=round(time.time() - t, 1), stop_reason=stop_reason,
                 params=n_params, steps=step, tokens_seen=tokens_seen, train_seconds=round(train_s, 1),
                 **versions)
    final.pop("event", None)
    print(json.dumps({"event": "final", **final}), flush=True)
    checkpoint(step, final)
    print(json.dumps({"event": "checkpoint", "step": step, "dir": str(out)}), flush=True)
    if a.export:
        info = export_hf(model, cfg, tok_dir, Path(a.export), final, loss_rows)
        print(json.dumps({"event": "exported", **info}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
