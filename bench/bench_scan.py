"""Head sensitivity scan prompts per second (``gdnviz.probes.scan.run_scan``) against the plain batched prefill of the
same prompts, in the same run.

    python bench/bench_scan.py --device cuda --model 0.8b --lengths 4096,16384 --n 8 --batch 8 --by layer
    python bench/bench_scan.py --device cpu --model demo --lengths 1024 --n 2 --batch 2   # CPU smoke run

A layer scan answers every sample untouched and with each GDN layer's heads cut to ``--r`` (one setting per layer);
a head scan with one head cut per setting (``--layers`` narrows it). ``ceiling`` rows time transformers' own forward
(left padding, attention mask, no cache, no gdnviz) on the same prompts in the same batches; ``scan`` rows give the
scan's answered prompts/s and its ratio to the ceiling's prompts/s. No memo: every answer is computed. One warm-up
scan at the smallest length first (compilation, autotuning, graph capture are not counted).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import ceiling_seconds, device_name, retrieval_model, emit, sync  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", choices=["demo", "0.8b"], default="0.8b")
    ap.add_argument("--task", default="niah_single_1")
    ap.add_argument("--lengths", default="4096,16384")
    ap.add_argument("--r", type=int, default=4)
    ap.add_argument("--by", choices=["layer", "head"], default="layer")
    ap.add_argument("--layers", default="", help="comma-separated GDN layers whose units are scanned (default all)")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    a = ap.parse_args()

    from gdnviz.probes.scan import ScanSpec, run_scan

    dev = torch.device(a.device)
    dtype = "bfloat16" if dev.type == "cuda" else "float32"
    lm = retrieval_model(a.model, dev, dtype)
    lengths = [int(x) for x in a.lengths.split(",") if x]
    layers = tuple(int(x) for x in a.layers.split(",") if x) or None
    base = dict(device=device_name(dev), model=a.model, dtype=dtype, task=a.task, r=a.r, by=a.by,
                gdn_layers=len(lm.info.gdn_layers), heads=lm.info.num_heads)

    def spec(length, n):
        return ScanSpec(model=lm.info.name, task=a.task, length=length, r=a.r, by=a.by, layers=layers, n=n,
                        batch_size=a.batch, max_new_tokens=a.max_new_tokens, chat_template=None, max_prompts=10**9)

    t = time.perf_counter()
    run_scan(lm, spec(min(lengths), min(a.n, a.batch)))
    sync(dev)
    emit(what="warmup", seconds=round(time.perf_counter() - t, 2), **base)
    for length in lengths:
        c = ceiling_seconds(lm, a.task, length, a.n, a.batch, dev)
        emit(what="ceiling", length=length, batch=a.batch, prompts=a.n, seconds=round(c, 3),
             prompts_per_s=round(a.n / c, 3), **base)
        sync(dev)
        t = time.perf_counter()
        res = run_scan(lm, spec(length, a.n))
        sync(dev)
        s = time.perf_counter() - t
        answers = len(res.rows)
        emit(what="scan", length=length, batch=a.batch, units=len(res.table), prompts=answers, seconds=round(s, 3),
             prompts_per_s=round(answers / s, 3), scan_vs_ceiling=round(answers / s / (a.n / c), 3), **base)


if __name__ == "__main__":
    main()
