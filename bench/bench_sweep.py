"""Retrieval prompts per second: batched sweep (B prompts per forward, per-sample truncation) vs one at a time.

Times ``gdnviz.probes.sweep.run_sweep`` (no memo) on the same prompts with ``batch_size = B``
and ``batch_size = 1``, after one warm-up sweep at the smallest length (kernel compilation and autotuning are not
counted), and checks that both give the same rows (predictions and scores).

Models: ``--model demo`` (the bundled demo model and its tokenizer) or ``--model 0.8b`` (random-initialised
Qwen3.5-0.8B shape — 24 layers, 18 GDN × 16 heads of 128×128 — with the demo tokenizer's 8,192-token vocabulary
instead of 248,320, so the prompts are real RULER prompts; its answers are noise, its speed is the model's).

    python bench/bench_sweep.py --device cuda --model 0.8b --lengths 4096,16384 --n 4 --batch 4
    python bench/bench_sweep.py --device cpu --model demo --lengths 1024 --n 2 --batch 2   # CPU smoke run

Every prompt of a (task, length) is run untouched and with every GDN head truncated to each ``--ranks`` value, so
one (task, length) is ``n × (1 + len(ranks))`` prompts. ``ceiling`` rows time the plain batched prefill of the same
prompts in the same batches (transformers' own forward, left padding and its attention mask, no cache, no logits,
no gdnviz): the prompts/s a sweep can approach, with the sweep's ratio to it (``sweep_vs_ceiling``: answered
prompts/s ÷ ceiling prompts/s). ``prefill_only`` rows time the same prompts and batches with one answer token (the
prefills), and their share of the sweep's time; the rest is decoding. ``--profile N`` prints the top N CUDA ops of
one batch of the first truncated setting (prefill and decode).
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import (ceiling_seconds, device_name, emit, prompt_batches, retrieval_dtype,  # noqa: E402
                          retrieval_model, retrieval_parser, sync)


def main():
    ap = retrieval_parser(__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="4096,16384")
    ap.add_argument("--ranks", default="4")
    ap.add_argument("--n", type=int, default=16, help="samples per length")
    ap.add_argument("--batch", default="8", help="samples per forward, or 'auto' (gdnviz.probes.batch_size)")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--no-prefill-split", action="store_true",
                    help="skip the prefill-only timing (same prompts and batches, one answer token)")
    ap.add_argument("--single-max", type=int, default=1 << 30,
                    help="skip the one-at-a-time sweep (and its row comparison) above this length")
    ap.add_argument("--profile", type=int, default=0, help="print the top N CUDA ops of one truncated batch")
    a = ap.parse_args()

    from gdnviz.probes.sweep import SweepSpec, run_sweep

    dev = torch.device(a.device)
    dtype = retrieval_dtype(a, dev)
    lm = retrieval_model(a.model, dev, dtype)
    lengths = [int(x) for x in a.lengths.split(",") if x]
    ranks = tuple(int(x) for x in a.ranks.split(",") if x)
    base = dict(device=device_name(dev), model=a.model, dtype=dtype, task=a.task, ranks=ranks,
                gdn_layers=len(lm.info.gdn_layers), heads=lm.info.num_heads, kernel_path=lm.info.kernel_path)

    def rows_for(length):
        if a.batch != "auto":
            return int(a.batch)
        from gdnviz.probes import ruler
        from gdnviz.probes.batch_size import auto_batch_size

        new = a.max_new_tokens or int(ruler.TASKS[a.task]["tokens_to_generate"])
        return auto_batch_size(lm, length, new)

    def spec(length, n, batch):
        return SweepSpec(model=lm.info.name, tasks=(a.task,), lengths=(length,), ranks=ranks, n=n, batch_size=batch,
                         max_new_tokens=a.max_new_tokens, chat_template=None)

    t = time.perf_counter()
    B0 = min(rows_for(min(lengths)), a.n)
    run_sweep(lm, spec(min(lengths), B0, B0))  # warm-up: compile / autotune at batch B and at batch 1
    run_sweep(lm, spec(min(lengths), 1, 1))
    sync(dev)
    emit(what="warmup", seconds=round(time.perf_counter() - t, 2), **base)
    for length in lengths:
        out = {}
        B = rows_for(length)
        c = ceiling_seconds(lm, a.task, length, a.n, B, dev)
        emit(what="ceiling", length=length, batch=B, prompts=a.n, seconds=round(c, 3),
             prompts_per_s=round(a.n / c, 3), **base)
        for b in ((B, 1) if length <= a.single_max else (B,)):
            sync(dev)
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            t = time.perf_counter()
            rows = run_sweep(lm, spec(length, a.n, b))
            sync(dev)
            s = time.perf_counter() - t
            peak = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2) if dev.type == "cuda" else None
            out[b] = (rows, s)
            emit(what="sweep", length=length, batch=b, prompts=len(rows), seconds=round(s, 3),
                 prompts_per_s=round(len(rows) / s, 3), score_mean=round(float(rows["score"].mean()), 2),
                 sweep_vs_ceiling=round(len(rows) / s / (a.n / c), 3), peak_gib=peak, **base)
        rb, sb = out[B]
        if 1 in out:
            r1, s1 = out[1]
            same = (rb[["pred", "score"]].reset_index(drop=True) == r1[["pred", "score"]].reset_index(drop=True))
            emit(what="batched_vs_one_at_a_time", length=length, batch=B, speedup=round(s1 / sb, 2),
                 rows_identical=int(same.all(axis=1).sum()), rows=len(rb), **base)
        if a.profile and length == lengths[0]:
            profile_batch(lm, a.task, length, B, ranks[0], a.max_new_tokens, a.profile, dev)
        if not a.no_prefill_split:
            for b in out:
                p = prefill_seconds(lm, a.task, length, a.n, b, ranks, dev)
                emit(what="prefill_only", length=length, batch=b, prompts=a.n * (1 + len(ranks)), seconds=round(p, 3),
                     share_of_sweep=round(p / out[b][1], 3), **base)


def profile_batch(lm, task: str, length: int, batch: int, rank: int, max_new, top: int, dev) -> None:
    """The top ``top`` CUDA ops of one batch at every head r = ``rank`` (prefill + decode), and its wall split."""
    from gdnviz.probes import ruler
    from gdnviz.probes.batch import batched_greedy
    from gdnviz.truncation import TruncationSpec

    prompts = prompt_batches(lm, task, length, batch, batch)[0]
    spec = TruncationSpec.all_heads(lm.info, rank)
    new = max_new or int(ruler.TASKS[task]["tokens_to_generate"])
    batched_greedy(lm, prompts, new, spec=spec)
    for n_new, what in ((1, "prefill"), (new, "prefill+decode")):
        sync(dev)
        t = time.perf_counter()
        batched_greedy(lm, prompts, n_new, spec=spec)
        sync(dev)
        emit(what="profile_wall", part=what, length=length, batch=len(prompts), rank=rank,
             seconds=round(time.perf_counter() - t, 3))
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        batched_greedy(lm, prompts, new, spec=spec)
        sync(dev)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=70), flush=True)


def prefill_seconds(lm, task: str, length: int, n: int, batch: int, ranks, dev) -> float:
    """Where a sweep's time goes: the same prompts in the same batches (``run_sweep``'s order: longest first) with
    one answer token, i.e. the truncated prefills and one argmax, untouched and at every rank; the rest of the
    sweep's time is decoding."""
    from gdnviz.probes import ruler
    from gdnviz.probes.batch import batched_greedy
    from gdnviz.truncation import TruncationSpec

    smp = ruler.generate_many(task, lm.tokenizer, length, n, 0, chat_template=None)
    order = sorted(range(len(smp)), key=lambda i: -smp[i].n_tokens)
    specs = [None] + [TruncationSpec.all_heads(lm.info, r) for r in ranks]
    sync(dev)
    t = time.perf_counter()
    for spec in specs:
        for b in range(0, len(order), batch):
            batched_greedy(lm, [smp[i].input_ids for i in order[b:b + batch]], 1, spec=spec)
    sync(dev)
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
