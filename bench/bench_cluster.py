"""A sweep on the Dask backend (``--cluster local``: one worker process per visible GPU) vs the same sweep in this
process on the same device: prompts/s of each, their ratio, and whether the rows are identical.

The in-process sweep runs first (after the kernel warm-up and one small warm sweep), then its model is freed and a
local cluster is started (``gdnviz.cluster.executor("local", ...)``: each worker loads the model from the same
folder and warms its kernels up); after one small warm sweep through the cluster the same sweep is timed there.
``cluster_start_s`` is the cluster's start with the workers' load and warm-up. Both sweeps use the same batch size
(``--batch``), so the batches, and therefore the rows, are the same; the ratio is what Dask's scheduling and the
transfer of prompts and answers cost. ``--batch 0`` leaves it to each side (this process's free memory, the
workers' ``ClusterExecutor.batch_size``; ``batch_local`` / ``batch_cluster`` say what each chose, after the warm
sweeps). On a CPU machine ``--workers`` worker processes answer instead.

``--model 0.8b`` saves the random-initialised Qwen3.5-0.8B shape (bench/common.py) with the demo tokenizer to
``--dir`` first, so that the workers load the same weights by path.

    python bench/bench_cluster.py --device cuda --model 0.8b --length 4096 --n 64 --batch 16
    python bench/bench_cluster.py --device cpu --model demo --length 1024 --n 4 --batch 2 --workers 2   # CPU smoke
"""
from __future__ import annotations

import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import device_name, emit, retrieval_dtype, retrieval_model, retrieval_parser, sync  # noqa: E402


def checkpoint(model: str, folder: str, dev, dtype: str) -> str:
    """The path the workers load: ``demo``, or the random 0.8B shape saved to ``folder``."""
    if model == "demo":
        return "demo"
    lm = retrieval_model(model, dev, dtype)
    lm.model.save_pretrained(folder)
    lm.tokenizer.save_pretrained(folder)
    del lm
    gc.collect()
    return folder


def main():
    ap = retrieval_parser(__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--ranks", default="4")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="rows per batch (0: chosen from free memory, here and on "
                    "the workers)")
    ap.add_argument("--workers", type=int, default=2, help="CPU worker processes (no GPU)")
    ap.add_argument("--dir", default="/tmp/gdnviz-bench-0.8b")
    a = ap.parse_args()

    from gdnviz import cluster
    from gdnviz.models import load
    from gdnviz.probes import ruler
    from gdnviz.probes.batch_size import auto_batch_size
    from gdnviz.probes.sweep import SweepSpec, run_sweep, samples_for
    from gdnviz.warmup import needs_warm_up, warm_up

    dev = torch.device(a.device)
    dtype = retrieval_dtype(a, dev)
    path = checkpoint(a.model, a.dir, dev, dtype)
    ranks = tuple(int(x) for x in a.ranks.split(",") if x)

    def spec(n):
        return SweepSpec(model=path, tasks=(a.task,), lengths=(a.length,), ranks=ranks, n=n, batch_size=a.batch or None,
                         chat_template=None)

    lm = load(path, device=str(dev), dtype=dtype)
    if needs_warm_up(lm):
        warm_up(lm)
    run_sweep(lm, spec(min(a.n, a.batch or a.n)))
    longest = max(s.n_tokens for smp in samples_for(lm.tokenizer, spec(a.n)).values() for s in smp)
    new_tokens = int(ruler.TASKS[a.task]["tokens_to_generate"])
    rows_local = a.batch or auto_batch_size(lm, longest, new_tokens)
    sync(dev)
    t = time.perf_counter()
    local = run_sweep(lm, spec(a.n))
    sync(dev)
    t_local = time.perf_counter() - t
    del lm
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    t = time.perf_counter()
    ex = cluster.executor("local", path, str(dev), dtype, workers=a.workers)
    view = ex.model_view()
    t_start = time.perf_counter() - t
    run_sweep(view, spec(min(a.n, a.batch or a.n)), executor=ex)
    rows_cluster = a.batch or ex.batch_size(longest, new_tokens)
    t = time.perf_counter()
    remote = run_sweep(view, spec(a.n), executor=ex)
    t_remote = time.perf_counter() - t

    cols = ["task", "length", "setting", "r", "seed", "score", "pred", "n_tokens", "n_generated"]
    same = local[cols].reset_index(drop=True).equals(remote[cols].reset_index(drop=True))
    answers = len(local)
    emit(what="cluster_vs_process", device=device_name(dev), model=a.model, dtype=dtype, task=a.task,
         length=a.length, n=a.n, batch_local=rows_local, batch_cluster=rows_cluster, ranks=ranks, answers=answers, workers=len(ex.workers),
         process_s=round(t_local, 3), process_prompts_per_s=round(answers / t_local, 3),
         cluster_s=round(t_remote, 3), cluster_prompts_per_s=round(answers / t_remote, 3),
         ratio=round(t_local / t_remote, 3), rows_identical=bool(same), cluster_start_s=round(t_start, 3),
         worker_warm_up=ex.warm_up)
    ex.client.close()


if __name__ == "__main__":
    main()
