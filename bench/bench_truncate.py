"""Guard benchmark: one boundary's head states truncated by gdnviz.truncation.truncate_states against torch.linalg.svd.

One boundary of Qwen3.5-0.8B = 288 states of 128×128 (18 GDN layers × 16 heads); a truncated run truncates one
layer's 16 heads at a time. For each r, on n states and on 16: ``truncate_states`` (on CUDA the CUDA kernel and
its exact check against the contract, one host sync; on CPU the certified torch path) eagerly and, on CUDA, the
kernel as a run's graph window calls it (its states copied for the deferred check) replayed from a CUDA graph, and
the same truncation through ``torch.linalg.svd`` in float32 and float64 in the same run. One JSON line per
measurement:

    {"what", "device", "n", "k", "v", "r", "baseline": "torch.linalg.svd", "baseline_ms", "ours_ms", "ratio",
     "max_energy_err", ...}

``ratio`` = baseline_ms / ours_ms; ``max_energy_err`` = max over states of |‖S_r‖² − ‖S_r^exact‖²| / ‖S‖² against a
float64 SVD (the contract: ≤ 1e-5). On CUDA also where a call first syncs the host (``host_sync``) and whether it
replays from a graph, the deferred check's time for one call's states and how many of them it checked exactly
(``states_checked``) or skipped as certified by the kernel (``states_certified``). States: GDN-like
(``tests.support.states.gdn_like_states``, float32) or ``--states`` (.npy).

    python bench/bench_truncate.py --device cpu --quick
    python bench/bench_truncate.py --device cuda --quick
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import emit, sync, time_ms  # noqa: E402
from gdnviz.truncation import contract, energy_error, truncate_states  # noqa: E402
from gdnviz.truncation.dispatch import kernel_truncate  # noqa: E402
from tests.support.states import gdn_like_states  # noqa: E402

F64 = torch.float64


def svd_truncate(S: torch.Tensor, r: int) -> torch.Tensor:
    """The baseline: the same truncation through a full batched SVD in S's precision."""
    U = torch.linalg.svd(S, full_matrices=False)[0][..., :r]
    return U @ (U.mT @ S)


def line(what, dev, S, r, base_ms, ours_ms, err, **extra):
    n, k, v = S.shape
    emit(
        what=what,
        device=str(dev),
        n=n,
        k=k,
        v=v,
        r=r,
        baseline="torch.linalg.svd",
        baseline_ms=round(base_ms, 3),
        ours_ms=round(ours_ms, 4),
        ratio=round(base_ms / ours_ms, 1),
        max_energy_err=float(f"{err:.3e}"),
        **extra,
    )


# ------------------------------------------------------------------------------------------ GPU checks
def sync_check(S: torch.Tensor, r: int) -> str:
    """Run one call with ``torch.cuda.set_sync_debug_mode('error')``: 'none' or where the first host sync happens."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        truncate_states(S, r)
        return "none"
    except RuntimeError as e:
        frames = [f for f in traceback.extract_tb(e.__traceback__) if "truncate" in f.filename]
        where = f"{frames[-1].name}:{frames[-1].lineno} `{frames[-1].line}`" if frames else "?"
        return f"{where}: {str(e).splitlines()[0][:160]}"
    finally:
        torch.cuda.set_sync_debug_mode(0)


def graph_replay_ms(S: torch.Tensor, r: int, warmup: int, repeats: int):
    """A boundary as a truncated run's graph window makes it: the kernel (``kernel_truncate``) inside
    ``contract.window``, its states and ``done`` flags copied for the deferred check, captured in a CUDA graph.
    (replay ms, error, ms of the deferred check of the call's states on the side stream, timed alone, and
    ``{"states_checked", "states_certified"}`` of one such check) — error is set when capture fails."""
    slots = contract.Slots()

    def windowed(x):
        with contract.window(slots):
            return kernel_truncate(x, r)

    ms, out = capture_replay_ms(windowed, S.clone(), warmup, repeats)
    if ms is None:
        return None, out, None, {}
    c0 = contract.counts(S.device)
    contract.check_window(slots)
    c1 = contract.counts(S.device)
    split = {"states_checked": c1["checked"] - c0["checked"], "states_certified": c1["certified"] - c0["certified"]}
    check_ms = time_ms(lambda: contract.check_window(slots) or contract.counts(S.device), S.device, 1, repeats)
    ok = torch.allclose(out, kernel_truncate(S, r, iters=None), rtol=0, atol=1e-6 * S.abs().max().item())
    return ms, None if ok else "replay differs from eager", check_ms, split


def capture_replay_ms(fn, static_in: torch.Tensor, warmup: int, repeats: int):
    """Capture ``fn(static_in)`` in a CUDA graph: (replay ms, static output), or (None, error text) if capture fails."""
    from tests.support.cuda_graph import capture

    try:
        g, static_out = capture(fn, static_in)
        return time_ms(g.replay, static_in.device, warmup, repeats), static_out
    except Exception as e:  # noqa: BLE001 - report, do not crash the benchmark
        torch.cuda.synchronize()
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"



# ------------------------------------------------------------------------------------------------ main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--states", help=".npy of states [..., K, V] (else random GDN-like states)")
    ap.add_argument("--n", type=int, default=288, help="number of random states (default 288 = one boundary)")
    ap.add_argument("--ranks", default="1,4,12,32")
    ap.add_argument("--quick", action="store_true", help="fewer repeats; the CPU run stays under ~1 minute")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--profile", type=int, default=0,
                    help="print the top N ops (torch.profiler, by device time) of one truncate_states call at r=4")
    a = ap.parse_args()

    dev = torch.device(a.device)
    cpu = dev.type == "cpu"
    if a.threads or (cpu and a.quick):
        # --quick on CPU: one thread unless told otherwise (small batched LAPACK calls run slower with OpenMP
        # threads on a shared 2-core machine)
        torch.set_num_threads(a.threads or 1)
    repeats = a.repeats or (2 if a.quick else (5 if cpu else 50))
    svd_repeats = 1 if (a.quick and cpu) else (3 if cpu else 5)
    warmup = (0 if a.quick else 1) if cpu else 3
    ranks = [int(x) for x in a.ranks.split(",")]
    if a.states:
        import numpy as np

        arr = torch.from_numpy(np.load(a.states))
        S64 = arr.reshape(-1, *arr.shape[-2:]).to(F64)
        source = "npy:" + os.path.basename(a.states)
    else:
        S64 = gdn_like_states(a.n, 128, 128, seed=0)
        source = "gdn_like"
    S_all = S64.float().to(dev)
    N, K, V = S_all.shape
    emit(what="setup", device=str(dev), torch=torch.__version__, n=N, k=K, v=V, source=source,
         threads=torch.get_num_threads() if cpu else None,
         gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else None, repeats=repeats)

    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        truncate_states(S_all, 4)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(10):
                truncate_states(S_all, 4)
            sync(dev)
        key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        print(f"# profile: 10 calls of truncate_states({N} states, r=4), sorted by {key}", flush=True)
        print(prof.key_averages().table(sort_by=key, row_limit=a.profile), flush=True)

    summary = {}
    for n in sorted({min(16, N), N}):
        S, S64n = S_all[:n].contiguous(), S64[:n]
        base = {"fp32": time_ms(lambda: svd_truncate(S, 4), dev, 0 if cpu else 1, svd_repeats),
                "fp64": time_ms(lambda: svd_truncate(S64n.to(dev), 4), dev, 0 if cpu else 1, svd_repeats)}
        for r in ranks:
            out = truncate_states(S, r)  # also compiles and caches the constants before any capture
            err = energy_error(S64n, out.cpu(), r).max().item()
            ms = time_ms(lambda: truncate_states(S, r), dev, warmup, repeats)
            for prec, bms in base.items():
                line(f"{source}:eager:vs_svd_{prec}", dev, S, r, bms, ms, err, dtype="float32")
            best = ms
            if dev.type == "cuda":
                where = sync_check(S, r)
                gms, gerr, cms, split = graph_replay_ms(S, r, warmup, repeats)
                emit(what=f"{source}:cuda_checks", device=str(dev), n=n, r=r, host_sync=where,
                     graph_replay_ms=None if gms is None else round(gms, 4), graph_error=gerr,
                     deferred_check_ms=None if cms is None else round(cms, 4), **split)
                if gms is not None:
                    for prec, bms in base.items():
                        line(f"{source}:cuda_graph:vs_svd_{prec}", dev, S, r, bms, gms, err)
                    best = min(best, gms)
            summary.setdefault(n, {})[r] = (best, err, base)
    for n, rows in summary.items():
        emit(what="summary", device=str(dev), n=n,
             ms_per_call={str(r): round(v[0], 4) for r, v in rows.items()},
             speedup_vs_svd_fp32={str(r): round(v[2]["fp32"] / v[0], 1) for r, v in rows.items()},
             max_energy_err={str(r): float(f"{v[1]:.3e}") for r, v in rows.items()},
             target_le_1ms=all(v[0] <= 1.0 for v in rows.values()) if n == 288 else None)


if __name__ == "__main__":
    main()
