"""Singular values of many 128×128 head states: gdnviz.gpu.symeig (tridiagonalisation and bisection in the CUDA
kernels gdnviz.gpu.cuda_tridiag and gdnviz.gpu.cuda_bisect by default, else Triton) vs torch.linalg on the same
states.

    python bench/bench_spectra.py --device cuda

One JSON line per measurement. The capture of a 16K-token document on a Qwen3.5-0.8B shape needs the spectra of
64 boundaries × 288 heads = 18,432 states.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import device_name, emit, timeit  # noqa: E402


def gdn_like_states(n, k=128, v=128, device="cuda", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    U = torch.linalg.qr(torch.randn(n, k, k, generator=g, dtype=torch.float64))[0]
    W = torch.linalg.qr(torch.randn(n, v, v, generator=g, dtype=torch.float64))[0]
    rate = torch.rand(n, 1, generator=g, dtype=torch.float64) * 0.3 + 0.02
    s = torch.exp(-rate * torch.arange(min(k, v), dtype=torch.float64))
    return ((U[:, :, :min(k, v)] * s[:, None, :]) @ W[:, :, :min(k, v)].transpose(-1, -2)).float().to(device)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--big", type=int, default=18432)
    ap.add_argument("--candidates", action="store_true",
                    help="also time what might replace the Triton tridiagonalisation (issue #6, capture ≤ 1.5×): "
                         "cuSOLVER's batched gesvda (torch.linalg.svd driver='gesvda', f64 and f32) on 288 states; "
                         "on the big batch the CUDA tridiagonalisation (shared-memory, register and split forms), the "
                         "CUDA bisection (LDLᵀ pivots and leading minors), each against its Triton kernel")
    args = ap.parse_args()
    from gdnviz.gpu import symeig

    dev = torch.device(args.device)
    S = gdn_like_states(288, device=dev)
    ref = torch.linalg.svdvals(S.double())
    t_svd = timeit(lambda: torch.linalg.svdvals(S.double()), dev, repeats=3)
    t_eigh = timeit(lambda: torch.linalg.eigvalsh(symeig.gram(S)), dev, repeats=3)
    t_ours = timeit(lambda: symeig.svdvals(S), dev, repeats=5)
    err = ((symeig.svdvals(S) - ref).abs() / ref[:, :1]).max().item()
    base = dict(device=device_name(dev), k=128, v=128)
    emit(what="svdvals_288", n=288, baseline="torch.linalg.svdvals(float64)", baseline_ms=t_svd * 1e3,
         ours_ms=t_ours * 1e3, ratio=t_svd / t_ours, eigvalsh_f64_ms=t_eigh * 1e3, max_abs_err_rel_sigma_max=err, **base)
    if args.big:
        B = gdn_like_states(args.big, device=dev, seed=1)
        t_big = timeit(lambda: symeig.svdvals(B), dev, repeats=3)
        G = symeig.gram(B)
        t_gram = timeit(lambda: symeig.gram(B), dev, repeats=3)
        D = torch.empty(args.big, 128, dtype=torch.float64, device=dev)
        E, W = torch.empty_like(D), torch.empty_like(D)
        t_tri_triton = timeit(lambda: symeig._tridiag_kernel[(args.big,)](G, D, E, N=128, num_warps=16), dev,
                              repeats=3)
        from gdnviz.gpu import cuda_tridiag

        # the tridiagonalisation symeig.svdvals used above (the CUDA kernel by default since the sixth session)
        use_cuda = bool(dev.type == "cuda" and cuda_tridiag.enabled() and cuda_tridiag._kernel(128, dev) is not None)
        t_tri = timeit(lambda: cuda_tridiag.tridiag(G), dev, repeats=3) if use_cuda else t_tri_triton
        emit(what=f"svdvals_{args.big}", n=args.big, ours_ms=t_big * 1e3, gram_ms=t_gram * 1e3,
             tridiag="cuda" if use_cuda else "triton", tridiag_ms=t_tri * 1e3, bisect_ms=(t_big - t_gram - t_tri) * 1e3,
             baseline="torch.linalg.svdvals(float64), extrapolated from 288", baseline_ms=t_svd * 1e3 * args.big / 288,
             ratio=t_svd * args.big / 288 / t_big, **base)
    if args.candidates and dev.type == "cuda":
        for dt in (torch.float64, torch.float32):
            try:
                X = S.to(dt)
                sv = torch.linalg.svd(X, full_matrices=False, driver="gesvda")[1].double()
                t = timeit(lambda: torch.linalg.svd(X, full_matrices=False, driver="gesvda"), dev, repeats=3)
                emit(what="candidate_gesvda_288", dtype=str(dt), ms=t * 1e3, ours_ms=t_ours * 1e3,
                     max_abs_err_rel_sigma_max=((sv - ref).abs() / ref[:, :1]).max().item(), **base)
            except Exception as e:  # noqa: BLE001 - a candidate that does not run is a result too
                emit(what="candidate_gesvda_288", dtype=str(dt), error=repr(e)[:300], **base)
        if args.big:
            from gdnviz.gpu import cuda_bisect

            W1 = torch.empty_like(D)
            symeig._tridiag_kernel[(args.big,)](G, D, E, N=128, num_warps=16)
            bm = max(1, 512 // 128)
            bisect_triton = lambda d_, e_, w_: symeig._bisect_kernel[((args.big + bm - 1) // bm,)](  # noqa: E731
                d_, e_, w_, args.big, N=128, BM=bm, STEPS=symeig.BISECT_STEPS, num_warps=4)
            bisect_triton(D, E, W1)
            scale = W1.abs().amax(dim=1, keepdim=True).clamp_min(1e-300)
            # threads per row of the CUDA tridiagonalisation, matrix in shared memory or in registers
            for tpr, regs in ((4, False), (2, True), (4, True), (2, cuda_tridiag.SPLIT)):
                try:
                    t = timeit(lambda: cuda_tridiag.tridiag(G, tpr, regs), dev, repeats=3)
                    D2, E2 = cuda_tridiag.tridiag(G, tpr, regs)
                    W2 = torch.empty_like(D)
                    bisect_triton(D2, E2, W2)
                    emit(what="candidate_tridiag_cuda", tpr=tpr, regs=regs, n=args.big, ms=t * 1e3,
                         triton_tridiag_ms=t_tri_triton * 1e3, ratio=t_tri_triton / t,
                         max_eig_diff_rel=((W2 - W1).abs() / scale).max().item(), **base)
                except Exception as e:  # noqa: BLE001
                    emit(what="candidate_tridiag_cuda", tpr=tpr, regs=regs, error=repr(e)[:300],
                         reason=cuda_tridiag.KERNELS.reason,
                         **base)
            # the CUDA bisection (tridiagonal in shared memory) in both Sturm-count forms (LDLᵀ pivots, leading
            # minors) against the Triton one, on the same (D, E)
            t_b_triton = timeit(lambda: bisect_triton(D, E, W1), dev, repeats=3)
            for form in cuda_bisect.FORMS:
                try:
                    t_b = timeit(lambda: cuda_bisect.bisect(D, E, symeig.BISECT_STEPS, form), dev, repeats=3)
                    W3 = cuda_bisect.bisect(D, E, symeig.BISECT_STEPS, form)
                    emit(what="candidate_bisect_cuda", form=form, n=args.big, ms=t_b * 1e3,
                         triton_bisect_ms=t_b_triton * 1e3, ratio=t_b_triton / t_b,
                         max_eig_diff_rel=((W3 - W1).abs() / scale).max().item(), **base)
                except Exception as e:  # noqa: BLE001
                    emit(what="candidate_bisect_cuda", form=form, error=repr(e)[:300],
                         reason=cuda_bisect.KERNELS.reason, **base)


if __name__ == "__main__":
    main()
