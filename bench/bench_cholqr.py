"""Truncation of one layer (16 states) and one boundary (288 states) with the subspace pass's Cholesky-QRs in torch
vs in one NVRTC-compiled CUDA kernel (gdnviz.gpu.cuda_cholqr; its shared-memory form, variant ``cuda_cholqr`` — the
name kept from the fifth session's rows — and its shuffle form, ``cuda_cholqr_shfl``, the default since the sixth
session), and the whole truncation as one CUDA kernel (gdnviz.gpu.cuda_truncate, variant ``cuda_truncate``) or as the Triton
fused kernel it replaces (``triton_fused``), each captured in a CUDA graph and replayed; then the building blocks alone, per launch (100 launches
replayed from one graph): Cholesky-QR in torch and in the CUDA kernel (both forms), the Triton Jacobi Rayleigh–Ritz
eigensolver (gdnviz.gpu.jacobi) on random 32×32 SPD matrices, a batched GEMM.

    python bench/bench_cholqr.py --device cuda

One JSON line per (variant, states, rank): replay ms, ratio to the torch path in the same run, max energy error
against the exact float64 SVD energies, and whether replay equals the eager call.

(The fifth session's split/fused Triton Cholesky-QR kernels, measured with this script at commits 53f9ec5 and a2ec8d3 and found
slower — bench/RESULTS.md — were removed afterwards; so was the one-warp CUDA Jacobi, variant ``cuda_shfl_jacobi`` and
kernel ``jacobi_32_cuda``, measured slower than the Triton Jacobi in the sixth session at commit 6e49d9f.)
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench_truncate import capture_replay_ms, gdn_like_states, time_ms  # noqa: E402
from bench.common import device_name, emit  # noqa: E402
from gdnviz import truncate as tr  # noqa: E402
from gdnviz.gpu import cuda_cholqr  # noqa: E402
from gdnviz.gpu import cuda_truncate as ct  # noqa: E402

FULL_JACOBI_TOL = ct.FULL_JACOBI_TOL  # the default, restored after the "cuda_truncate_prev" variant

# variant: GDNVIZ_CUDA_CHOLQR — the torch Cholesky-QR path; the CUDA Cholesky-QR kernel with the shared-memory /
# the shuffle factorisation (named explicitly: "1" means the default form, which changed from smem to shfl)
# "cuda_truncate": the whole truncation as one CUDA kernel, one thread block per state (gdnviz.gpu.cuda_truncate)
# "triton_fused": the Triton fused kernel (gdnviz.gpu.fused_truncate with GDNVIZ_CUDA_TRUNCATE=0), one program per state
# "cuda_truncate_fused" / "cuda_truncate_split": the CUDA kernel with its split launches forced off / on
# (GDNVIZ_CUDA_TRUNCATE_SPLIT; "cuda_truncate" takes the default: split for at most SPLIT_MAX_STATES states)
VARIANTS = {"torch": "0", "cuda_cholqr": "smem", "cuda_cholqr_shfl": "shfl", "cuda_truncate": "shfl",
            "cuda_truncate_fused": "shfl", "cuda_truncate_split": "shfl",
            "cuda_truncate_full": "shfl", "triton_fused": "shfl",  # cuda_truncate_full: without the certified attempts
            "cuda_truncate_entry_jacobi": "shfl", "cuda_truncate_prev": "shfl", "cuda_truncate_unphased": "shfl",
            "cuda_truncate_phased2": "shfl", "cuda_truncate_separate_sketch": "shfl"}
# the kernel switches a variant sets (the others stay at the library's defaults)
VARIANT_ENV = {
    "cuda_truncate_fused": {"GDNVIZ_CUDA_TRUNCATE_SPLIT": "0"},
    "cuda_truncate_split": {"GDNVIZ_CUDA_TRUNCATE_SPLIT": "1"},
    "cuda_truncate_entry_jacobi": {"GDNVIZ_CUDA_TRUNCATE_PAIR_JACOBI": "0"},
    "cuda_truncate_unphased": {"GDNVIZ_CUDA_TRUNCATE_PHASED": "0"},
    "cuda_truncate_prev": {"GDNVIZ_CUDA_TRUNCATE_PHASED": "0"},
    "cuda_truncate_phased2": {"GDNVIZ_CUDA_TRUNCATE_PHASED": "2"},
    "cuda_truncate_separate_sketch": {"GDNVIZ_CUDA_TRUNCATE_FUSED_SKETCH": "0"},
}
SWITCHES = ("GDNVIZ_CUDA_TRUNCATE_SPLIT", "GDNVIZ_CUDA_TRUNCATE_PAIR_JACOBI", "GDNVIZ_CUDA_TRUNCATE_PHASED",
            "GDNVIZ_CUDA_TRUNCATE_FUSED_SKETCH")
# "cuda_truncate_entry_jacobi": the kernel with the per-entry Jacobi rounds of 32-column blocks
# (GDNVIZ_CUDA_TRUNCATE_PAIR_JACOBI=0; the pair-block rounds, the default since the sixteenth session, measured 6-10%
# faster at r = 4 / 12 / 32); its outputs must equal "cuda_truncate"'s bit for bit (same_as_default)
# "cuda_truncate_unphased": one thread block per state for the whole algorithm (GDNVIZ_CUDA_TRUNCATE_PHASED=0; the
# phased launch, the default since the eighteenth session for more states than SMs at ranks > 16, splits each state
# into three blocks); "cuda_truncate_phased2": two blocks per state (GDNVIZ_CUDA_TRUNCATE_PHASED=2); both must equal
# "cuda_truncate"'s outputs bit for bit (same_as_default)
# "cuda_truncate_separate_sketch": the first pass's sketch S Ω₀ as its own pass over S
# (GDNVIZ_CUDA_TRUNCATE_FUSED_SKETCH=0; fused into the Gram matrix's loop since the eighteenth session); same_as_default
# too
# "cuda_truncate_prev": the kernel with the sixteenth session's defaults — 6 filter steps in the second pass (r > 16;
# 4 since the seventeenth) and the full algorithm's Jacobi stop at 1e-10 (1e-8 since) — for the same-run ratio
# (the thirteenth session's "cuda_truncate_warp_jacobi", the Jacobi in warps, measured 1.8-2x slower and removed:
# bench/RESULTS.md)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ranks", default="4,1,12,32")
    ap.add_argument("--sizes", default="16,288")
    ap.add_argument("--variants", default=",".join(VARIANTS))  # dict keys
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--alone", default="", help="comma-separated names of the kernels-alone cases to run (default all)")
    a = ap.parse_args()
    dev = torch.device(a.device)
    sizes = [int(x) for x in a.sizes.split(",")]
    ranks = [int(x) for x in a.ranks.split(",")]
    wanted = a.variants.split(",")
    S64 = gdn_like_states(max(sizes), 128, 128, seed=0)
    s2 = torch.linalg.svdvals(S64).square()
    base = dict(device=device_name(dev))

    def energy_err(S, out, r):
        n = S.shape[0]
        exact = s2[:n, :r].sum(-1)
        got = out.double().cpu().square().sum((-1, -2))
        return ((got - exact).abs() / s2[:n].sum(-1)).max().item()

    for n in sizes:
        S = S64[:n].float().to(dev).contiguous()
        for r in ranks:
            ref_ms = default_out = None
            for name in VARIANTS:
                if name not in wanted:
                    continue
                os.environ["GDNVIZ_CUDA_CHOLQR"] = VARIANTS[name]
                os.environ["GDNVIZ_CUDA_TRUNCATE"] = "0" if name == "triton_fused" else "1"
                os.environ["GDNVIZ_CUDA_TRUNCATE_ATTEMPT"] = "0" if name == "cuda_truncate_full" else "1"
                for env in SWITCHES:  # this variant's settings; the library defaults for the others
                    if env in VARIANT_ENV.get(name, {}):
                        os.environ[env] = VARIANT_ENV[name][env]
                    else:
                        os.environ.pop(env, None)
                ct.FULL_JACOBI_TOL = 1e-10 if name == "cuda_truncate_prev" else FULL_JACOBI_TOL
                if name == "cuda_truncate_prev":
                    fn = lambda x, r=r: ct.truncate_cuda(x, r, iters=6 if r > 16 else None)  # noqa: E731
                elif name.startswith("cuda_truncate"):
                    fn = lambda x, r=r: ct.truncate_cuda(x, r)  # noqa: E731
                elif name == "triton_fused":
                    from gdnviz.gpu.fused_truncate import truncate_fused

                    fn = lambda x, r=r: truncate_fused(x, r)  # noqa: E731
                else:
                    fn = lambda x, r=r: tr.truncate_states(x, r)  # noqa: E731
                try:
                    eager = fn(S)
                    torch.cuda.synchronize()
                    err = energy_err(S64[:n], eager, r)
                    ms, out = capture_replay_ms(fn, S.clone(), 3, a.repeats)
                except Exception as e:  # noqa: BLE001 - report and go on
                    emit(what="subspace_kernels", variant=name, n=n, r=r, error=f"{type(e).__name__}: {e}"[:300],
                         **base)
                    continue
                if ms is None:
                    emit(what="subspace_kernels", variant=name, n=n, r=r, error=out, energy_err=err, **base)
                    continue
                if name == "torch":
                    ref_ms = ms
                if name == "cuda_truncate":
                    default_out = eager
                extra = {}
                if (name in ("cuda_truncate_entry_jacobi", "cuda_truncate_unphased", "cuda_truncate_phased2",
                             "cuda_truncate_separate_sketch") and default_out is not None):
                    extra["same_as_default"] = bool(torch.equal(eager, default_out))
                emit(what="subspace_kernels", variant=name, n=n, r=r, replay_ms=round(ms, 4),
                     vs_torch=None if ref_ms is None else round(ref_ms / ms, 2), energy_err=float(f"{err:.3e}"),
                     replay_equals_eager=bool(torch.equal(out, eager)), **extra, **base)
    os.environ["GDNVIZ_CUDA_CHOLQR"] = "0"
    for env in SWITCHES:
        os.environ.pop(env, None)
    ct.FULL_JACOBI_TOL = FULL_JACOBI_TOL
    emit(what="cuda_kernels_status", cholqr_available=cuda_cholqr.KERNELS.available,
         cholqr_reason=cuda_cholqr.KERNELS.reason, **base)

    # the kernels alone, per launch: 100 launches in one graph
    for n in sizes:
        g = torch.Generator().manual_seed(0)
        Y = torch.randn(n, 128, 32, generator=g, dtype=torch.float64).to(dev)
        P = torch.randn(n, 128, 128, generator=g, dtype=torch.float64).to(dev) * 0.01
        from gdnviz.gpu.jacobi import eigh_jacobi

        T = (Y.mT @ Y).contiguous()  # random SPD 32×32: 7–8 sweeps (the truncation's Rayleigh quotients: 3–6)
        cases = [("jacobi_32", lambda: eigh_jacobi(T)), ("torch_bmm_128x128x32", lambda: torch.bmm(P, Y)),
                 ("torch_cholqr", lambda: tr._cholqr(Y))]
        if cuda_cholqr.KERNELS.available:
            cases.append(("cuda_cholqr", lambda: cuda_cholqr.cholqr(Y, form="smem")))
            cases.append(("cuda_cholqr_shfl", lambda: cuda_cholqr.cholqr(Y, form="shfl")))
        for name, fn in cases:
            if a.alone and name not in a.alone.split(","):
                continue
            try:
                fn()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(100):
                        fn()
                ms = time_ms(graph.replay, dev, 2, 5) / 100
                emit(what="kernel_alone", name=name, n=n, us_per_launch=round(ms * 1e3, 2), **base)
            except Exception as e:  # noqa: BLE001
                emit(what="kernel_alone", name=name, n=n, error=f"{type(e).__name__}: {e}"[:300], **base)


if __name__ == "__main__":
    main()
