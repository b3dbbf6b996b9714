"""Time to the first answer of a sweep in a fresh process: load, kernel warm-up, then the first stored result.

The app's worker warms the kernels up when it loads a model (``gdnviz.warmup``, its time shown in the sidebar);
the issue's goal is that the first sweep then starts answering within seconds. In one fresh process this times
the model's load, the warm-up (per step), the first sweep's first stored result after the warm-up ended and its
whole duration; then the same sweep again in the same process (``warm`` row: everything compiled, captured and
tuned), so ``first_result_s - warm.first_result_s`` is what the first sweep still pays for being first.

    python bench/bench_first_result.py --device cuda --model 0.8b --length 16384 --n 16 --batch 16
    python bench/bench_first_result.py --device cpu --model demo --length 1024 --n 2 --batch 2   # CPU smoke run
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import device_name, emit, retrieval_dtype, retrieval_model, retrieval_parser, sync  # noqa: E402


def main():
    ap = retrieval_parser(__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--ranks", default="4")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--batch", type=int, default=0, help="rows per batch (0: chosen from free memory)")
    a = ap.parse_args()

    from gdnviz.probes.sweep import SweepSpec, run_sweep
    from gdnviz.warmup import needs_warm_up, warm_up

    dev = torch.device(a.device)
    dtype = retrieval_dtype(a, dev)
    t0 = time.perf_counter()
    lm = retrieval_model(a.model, dev, dtype)
    sync(dev)
    t_load = time.perf_counter()
    wu = warm_up(lm) if needs_warm_up(lm) else {}
    t_warm = time.perf_counter()
    spec = SweepSpec(model=lm.info.name, tasks=(a.task,), lengths=(a.length,),
                     ranks=tuple(int(x) for x in a.ranks.split(",") if x), n=a.n, batch_size=a.batch or None,
                     chat_template=None)

    def timed():
        first = []
        start = time.perf_counter()

        def progress(done, total):
            if done and not first:
                first.append(time.perf_counter() - start)

        rows = run_sweep(lm, spec, progress=progress)
        return first[0], time.perf_counter() - start, len(rows)

    first, whole, n_rows = timed()
    base = dict(device=device_name(dev), model=a.model, dtype=dtype, task=a.task, length=a.length, n=a.n,
                batch=a.batch or "auto", answers=n_rows)
    emit(what="first_result", load_s=round(t_load - t0, 3), warm_up_s=round(t_warm - t_load, 3), warm_up=wu,
         first_result_s=round(first, 3), sweep_s=round(whole, 3), **base)
    first_w, whole_w, _ = timed()
    emit(what="first_result_warm", first_result_s=round(first_w, 3), sweep_s=round(whole_w, 3),
         first_sweep_extra_s=round(first - first_w, 3), **base)


if __name__ == "__main__":
    main()
