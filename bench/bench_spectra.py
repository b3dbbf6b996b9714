"""Guard benchmark: the spectra of a 16K-token capture's states (64 boundaries × 288 heads = 18,432 states 128×128,
the Qwen3.5-0.8B shape) through ``gdnviz.gpu.symeig.svdvals`` (the CUDA kernels where they run, else the float64
``torch.linalg.eigvalsh`` fallback) against float64 ``torch.linalg.svdvals`` in the same run.

    python bench/bench_spectra.py --device cuda

One JSON line per measurement: ``svdvals_288`` (288 states, both timed, the largest error on σ relative to σ_max,
and float64 ``torch.linalg.eigvalsh`` of the Gram matrices: the fallback's solver)
and ``svdvals_<big>`` (``--big`` states: the whole call and its Gram / tridiagonalisation / bisection parts; the
baseline extrapolated from the 288 states, float64 svdvals takes minutes there). ``path`` says which path ran.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import device_name, emit, timeit  # noqa: E402


def gdn_like_states(n, k=128, v=128, device="cuda", seed=0):
    """``[n, k, v]`` float32 states with exponentially decaying spectra (rates 0.02–0.32 per index)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    U = torch.linalg.qr(torch.randn(n, k, k, generator=g, dtype=torch.float64))[0]
    W = torch.linalg.qr(torch.randn(n, v, v, generator=g, dtype=torch.float64))[0]
    rate = torch.rand(n, 1, generator=g, dtype=torch.float64) * 0.3 + 0.02
    s = torch.exp(-rate * torch.arange(min(k, v), dtype=torch.float64))
    return ((U[:, :, :min(k, v)] * s[:, None, :]) @ W[:, :, :min(k, v)].transpose(-1, -2)).float().to(device)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--big", type=int, default=18432, help="states of the second measurement (0: skip it)")
    args = ap.parse_args()
    from gdnviz.gpu import cuda_bisect, cuda_tridiag, symeig

    dev = torch.device(args.device)
    S = gdn_like_states(288, device=dev)
    path = "cuda_kernels" if symeig.uses_kernels(symeig.gram(S)) else "fallback_eigvalsh"
    ref = torch.linalg.svdvals(S.double())
    t_svd = timeit(lambda: torch.linalg.svdvals(S.double()), dev, repeats=3)
    t_eigh = timeit(lambda: torch.linalg.eigvalsh(symeig.gram(S)), dev, repeats=3)  # the fallback's solver
    t_ours = timeit(lambda: symeig.svdvals(S), dev, repeats=5)
    err = ((symeig.svdvals(S) - ref).abs() / ref[:, :1]).max().item()
    base = dict(device=device_name(dev), k=128, v=128, path=path)
    emit(what="svdvals_288", n=288, baseline="torch.linalg.svdvals(float64)", baseline_ms=t_svd * 1e3,
         ours_ms=t_ours * 1e3, ratio=t_svd / t_ours, eigvalsh_f64_ms=t_eigh * 1e3, max_abs_err_rel_sigma_max=err,
         **base)
    if args.big:
        B = gdn_like_states(args.big, device=dev, seed=1)
        t_big = timeit(lambda: symeig.svdvals(B), dev, repeats=3)
        G = symeig.gram(B)
        t_gram = timeit(lambda: symeig.gram(B), dev, repeats=3)
        parts = {}
        if path == "cuda_kernels":
            D, E = cuda_tridiag.tridiag(G)
            parts = dict(tridiag_ms=timeit(lambda: cuda_tridiag.tridiag(G), dev, repeats=3) * 1e3,
                         bisect_ms=timeit(lambda: cuda_bisect.bisect(D, E), dev, repeats=3) * 1e3)
        emit(what=f"svdvals_{args.big}", n=args.big, ours_ms=t_big * 1e3, gram_ms=t_gram * 1e3, **parts,
             baseline="torch.linalg.svdvals(float64), extrapolated from 288", baseline_ms=t_svd * 1e3 * args.big / 288,
             ratio=t_svd * args.big / 288 / t_big, **base)


if __name__ == "__main__":
    main()
