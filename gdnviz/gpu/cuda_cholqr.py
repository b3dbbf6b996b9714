"""Shifted Cholesky-QR of many 128×32 (or 64×32) float64 blocks in one CUDA kernel, compiled at run time with NVRTC.

``cholqr(Z)`` for float64 ``Z [N, R, 32]`` (R ∈ {64, 128}) returns ``Z L⁻ᵀ`` with
``L Lᵀ = ZᵀZ + shift·diag(ZᵀZ) + tiny·I`` — ``gdnviz.truncate._cholqr``'s definition — in one launch: one thread
block of R threads per block ``Z[n]``:

1. thread t loads row t of ``Z[n]`` into registers and into shared memory;
2. the R threads form the lower triangle of ``C = ZᵀZ`` (float64 FMAs over shared memory) and shift its diagonal;
3. one warp factors ``C = L Lᵀ`` in place (right-looking Cholesky, lane t owns row t: 32 column steps, each a
   ``__syncwarp`` apart — no block-wide barrier, no cross-warp reduction per step);
4. thread t solves ``L q = z_t`` by forward substitution (``q`` = row t of ``Z L⁻ᵀ``) with ``L`` read from shared
   memory as broadcasts, and stores it.

Why: a Cholesky-QR in torch is ~7 kernels (GEMM, two diagonal updates, ``cholesky_ex``, ``solve_triangular``,
GEMM) and the subspace truncation runs 8–10 of them per call. Triton versions of the same factorisation
(``gdnviz.gpu.cholqr``; the fifth session's split kernels, since removed) were slower (64–190 µs per launch): each of
their 32 column steps is a cross-warp reduction over a register tile. Here a column step is a few warp shuffles
(or shared-memory operations) of one warp.

Measured (H200, bench/bench_cholqr.py, fifth session; 100 launches replayed from a CUDA graph): the first form of
step 3, ``"smem"`` (row t updated in shared memory), 45.8 µs per launch for 16 blocks (torch: 51.8 µs), 73.6 µs for
288 (torch: 70.3 µs); inside ``truncate_states`` replayed from a graph, 1.02–1.12× faster for 16 states and
1.01–1.04× for 288. One launch did not make it cheap: that Cholesky loop is latency-bound — lane t's update of row t
(up to 31 dependent shared-memory read-modify-writes per column step, 32 steps) is ~30 µs by itself (an estimate
from the instruction chain, not a profile). The second form, ``"shfl"``, keeps row t in lane t's registers and
fetches each ``L[k][j]`` by a warp shuffle — the same arithmetic, so the same bits (a CUDA test checks it) — and
compiles without spills (160 registers). Sixth session (H200, same script, both forms in one run; bench/RESULTS.md):
per launch **27.6 µs for 16 blocks** (smem 45.6, torch 52.3) and **54.1 µs for 288** (smem 72.6, torch 71.1);
inside ``truncate_states`` replayed from a graph, r = 1 / 4 / 12 / 32: 16 states 0.583 / 0.578 / 0.609 / 1.380 ms
(smem 0.710 / 0.719 / 0.772 / 1.741, torch 0.716 / 0.810 / 0.793 / 1.869), 288 states 1.048 / 1.090 / 1.185 /
2.710 ms (smem 1.172 / 1.233 / 1.340 / 3.069, torch 1.196 / 1.291 / 1.351 / 3.150) — faster than both in all 8
cases (1.14–1.40× the torch path), energy error ≤ 2.5e-8 (the smem form's, bit for bit).

Compiled with ``torch.cuda._compile_kernel`` (NVRTC, bundled with CUDA builds of PyTorch; no ``nvcc`` needed), once
per (R, device), on first use — call it once outside a CUDA-graph capture (``truncate_states``' callers do: the
first window of ``gdnviz.gpu.scan_graph`` and ``tests.support.cuda_graph.capture`` run eagerly first). The launch
goes to the current stream, so graphs capture it. If compilation fails (no NVRTC, an unsupported GPU),
``KERNELS.available`` is False with the reason in ``KERNELS.reason`` and ``gdnviz.truncate`` keeps its torch path.

Status: used by ``gdnviz.truncate._cholqr`` on CUDA for float64 ``[N, 64|128, 32]`` blocks by default, in the
``"shfl"`` form (``DEFAULT_ON``; measured above). ``GDNVIZ_CUDA_CHOLQR=0`` turns it off (torch's kernels),
``=smem`` picks the shared-memory form, ``=1`` or ``=shfl`` the default form.
Accuracy: same definition as the torch path, other summation order; the CUDA tests in tests/test_cuda_cholqr.py pin
it to ``truncate._cholqr`` (1e-12 relative on well-conditioned blocks) and keep the 1e-5 energy criterion inside
``truncate_states``; on CPU the same source runs through ``tests.support.cuda_emul`` (g++, CUDA's threads emulated)
against the same criteria, both forms bit for bit equal.
"""
from __future__ import annotations

import os

import torch

from gdnviz.gpu.nvrtc import Kernels

SHAPES_R = (64, 128)
Q = 32
DEFAULT_ON = True  # measured on an H200 (module docstring)
DEFAULT_FORM = "shfl"  # the faster form on the H200 (sixth session), same bits as "smem"

SOURCE = r"""
#define RROWS %(R)d
#define QC 32
#define QP 33
extern "C" __global__ void __launch_bounds__(RROWS)
gdnviz_cholqr(const double* __restrict__ Z, double* __restrict__ OUT, double shift, double tiny)
{
    __shared__ double zs[RROWS][QP];
    __shared__ double cs[QC][QP];
    const int t = threadIdx.x;
    const long long base = (long long)blockIdx.x * RROWS * QC + (long long)t * QC;
    double z[QC];
#pragma unroll
    for (int i = 0; i < QC; ++i) {
        z[i] = Z[base + i];
        zs[t][i] = z[i];
    }
    __syncthreads();
    // lower triangle of C = Z^T Z, diagonal shifted: C_ii (1 + shift) + tiny
    for (int e = t; e < QC * QC; e += RROWS) {
        const int i = e / QC, j = e %% QC;
        if (j <= i) {
            double acc = 0.0;
            for (int k = 0; k < RROWS; ++k) acc = fma(zs[k][i], zs[k][j], acc);
            if (i == j) acc = acc * (1.0 + shift) + tiny;
            cs[i][j] = acc;
        }
    }
    __syncthreads();
%(CHOL)s    __syncthreads();
    // row t of Z L^{-T}: forward substitution L q = z_t
    double q[QC];
#pragma unroll
    for (int i = 0; i < QC; ++i) {
        double s = z[i];
#pragma unroll
        for (int k = 0; k < i; ++k) s = fma(-cs[i][k], q[k], s);
        q[i] = s / cs[i][i];
    }
#pragma unroll
    for (int i = 0; i < QC; ++i) OUT[base + i] = q[i];
}
"""

# Step 3, the factorisation C = L Lᵀ by one warp (lane t owns row t), in two forms with the same arithmetic (the same
# fma / division / sqrt sequence per entry, so the same bits): "smem" updates row t in shared memory; "shfl" keeps row t
# in registers and fetches L[k][j] from lane k by a warp shuffle (no shared-memory round trip in the dependent chain).
CHOL = {
    "smem": r"""
    // C = L L^T in place (lower triangle), one warp, lane t owns row t
    if (t < 32) {
        for (int j = 0; j < QC; ++j) {
            if (t == j) cs[j][j] = sqrt(cs[j][j]);
            __syncwarp();
            if (t > j) cs[t][j] = cs[t][j] / cs[j][j];
            __syncwarp();
            if (t > j) {
                const double ltj = cs[t][j];
                for (int k = j + 1; k <= t; ++k) cs[t][k] = fma(-ltj, cs[k][j], cs[t][k]);
            }
            __syncwarp();
        }
    }
""",
    "shfl": r"""
    // C = L L^T, one warp, row t of C in lane t's registers; L[k][j] from lane k by __shfl_sync
    if (t < 32) {
        double c[QC];
#pragma unroll
        for (int k = 0; k < QC; ++k) c[k] = (k <= t) ? cs[t][k] : 0.0;
#pragma unroll
        for (int j = 0; j < QC; ++j) {
            const double ljj = sqrt(__shfl_sync(0xffffffffu, c[j], j));
            const double l = (t == j) ? ljj : c[j] / ljj;  // L[t][j] (lanes t < j: unused)
            c[j] = l;
#pragma unroll
            for (int k = j + 1; k < QC; ++k) c[k] = fma(-l, __shfl_sync(0xffffffffu, l, k), c[k]);
        }
#pragma unroll
        for (int k = 0; k < QC; ++k)
            if (k <= t) cs[t][k] = c[k];
    }
""",
}

KERNELS = Kernels()  # KERNELS.available / KERNELS.reason: whether compilation worked, and why not


def variant() -> str | None:
    """The factorisation used by ``gdnviz.truncate._cholqr`` on CUDA, from ``GDNVIZ_CUDA_CHOLQR``: ``0`` → None (torch's
    kernels), unset, ``1`` or ``shfl`` → ``"shfl"`` (``DEFAULT_FORM``; unset only if ``DEFAULT_ON``), ``smem`` →
    ``"smem"``. None also once compilation failed, and on ROCm builds (the factorisation assumes 32-lane warps)."""
    env = os.environ.get("GDNVIZ_CUDA_CHOLQR", "").strip().lower()
    v = {"": DEFAULT_FORM if DEFAULT_ON else None, "1": DEFAULT_FORM, "smem": "smem", "shfl": "shfl"}.get(env)
    return v if KERNELS.usable() else None


def enabled() -> bool:
    """Whether ``gdnviz.truncate._cholqr`` uses this kernel on CUDA (see ``variant``)."""
    return variant() is not None


def supports(Z: torch.Tensor) -> bool:
    """float64 CUDA ``[N, R, 32]`` with R in SHAPES_R."""
    return Z.is_cuda and Z.dim() == 3 and Z.dtype == torch.float64 and Z.shape[1] in SHAPES_R and Z.shape[2] == Q


def _kernel(R: int, device: torch.device, form: str | None = None):
    """The compiled kernel for R rows on ``device`` in ``form`` ("smem" / "shfl"; default: ``variant()`` or
    ``DEFAULT_FORM``), compiled on first use, or None if compilation failed."""
    form = form or variant() or DEFAULT_FORM
    return KERNELS.get((R, device.index, form), device, source(R, form), "gdnviz_cholqr")


def source(R: int, form: str = DEFAULT_FORM) -> str:
    """The CUDA source for R rows with the factorisation ``form``."""
    return SOURCE % {"R": R, "CHOL": CHOL[form]}


def cholqr(Z: torch.Tensor, shift: float = 1e-13, tiny: float = 1e-300, form: str | None = None) -> torch.Tensor:
    """``Z L⁻ᵀ`` (module docstring) for float64 CUDA ``Z [N, R, 32]``; ``form`` as in ``_kernel``; RuntimeError if
    the kernel is unavailable."""
    if not supports(Z):
        raise ValueError(f"cholqr takes float64 CUDA [N, R, {Q}] with R in {SHAPES_R}; got {Z.dtype} "
                         f"{tuple(Z.shape)} on {Z.device}")
    N, R, _ = Z.shape
    k = _kernel(R, Z.device, form)
    if k is None:
        raise RuntimeError(f"the CUDA Cholesky-QR kernel is unavailable: {KERNELS.reason}")
    Z = Z.contiguous()
    out = torch.empty_like(Z)
    if N:
        with torch.cuda.device(Z.device):
            k(grid=(N, 1, 1), block=(R, 1, 1), args=[Z, out, float(shift), float(tiny)])
    return out
