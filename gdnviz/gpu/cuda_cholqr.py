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
their 32 column steps is a cross-warp reduction over a register tile. Here a column step is a few shared-memory
operations of one warp.

Measured (H200, bench/bench_cholqr.py, fifth session; 100 launches replayed from a CUDA graph): 45.8 µs per launch
for 16 blocks (torch: 51.8 µs), 73.6 µs for 288 (torch: 70.3 µs); inside ``truncate_states`` replayed from a graph,
1.02–1.12× faster for 16 states and 1.01–1.04× for 288, same energies. So one launch did not make it cheap: the
Cholesky loop is latency-bound — lane t's update of row t (up to 31 dependent shared-memory read-modify-writes per
column step, 32 steps) is ~30 µs by itself. A register-resident factorisation (lane t holds row t, column entries
broadcast by shuffles) is the next thing to try.

Compiled with ``torch.cuda._compile_kernel`` (NVRTC, bundled with CUDA builds of PyTorch; no ``nvcc`` needed), once
per (R, device), on first use — call it once outside a CUDA-graph capture (``truncate_states``' callers do: the
first window of ``gdnviz.gpu.scan_graph`` and ``gdnviz.gpu.cuda_graph.capture`` run eagerly first). The launch
goes to the current stream, so graphs capture it. If compilation fails (no NVRTC, an unsupported GPU), ``available``
is False with the reason in ``unavailable_reason`` and ``gdnviz.truncate`` keeps its torch path.

Status: used by ``gdnviz.truncate._cholqr`` on CUDA for float64 ``[N, 64|128, 32]`` blocks by default
(``DEFAULT_ON``: inside ``truncate_states`` faster in all 8 measured cases, by 1–12%); ``GDNVIZ_CUDA_CHOLQR=0``
turns it off.
Accuracy: same definition as the torch path, other summation order; the CUDA tests in tests/test_cuda_cholqr.py pin
it to ``truncate._cholqr`` (1e-12 relative on well-conditioned blocks) and keep the 1e-5 energy criterion inside
``truncate_states``.
"""
from __future__ import annotations

import os
import threading

import torch

SHAPES_R = (64, 128)
Q = 32
DEFAULT_ON = True  # measured on an H200 (module docstring)

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
    __syncthreads();
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

_KERNELS: dict = {}
_LOCK = threading.Lock()
available = True
unavailable_reason = ""


def enabled() -> bool:
    """Whether ``gdnviz.truncate._cholqr`` uses this kernel on CUDA (``GDNVIZ_CUDA_CHOLQR``: ``1`` on, ``0`` off;
    unset: ``DEFAULT_ON``), it has not failed to compile, and the build is NVIDIA's (not ROCm: 64-lane wavefronts)."""
    env = os.environ.get("GDNVIZ_CUDA_CHOLQR", "").strip()
    on = DEFAULT_ON if env == "" else env == "1"
    return on and available and torch.version.hip is None  # the factorisation assumes 32-lane warps


def supports(Z: torch.Tensor) -> bool:
    """float64 CUDA ``[N, R, 32]`` with R in SHAPES_R."""
    return Z.is_cuda and Z.dim() == 3 and Z.dtype == torch.float64 and Z.shape[1] in SHAPES_R and Z.shape[2] == Q


def _kernel(R: int, device: torch.device):
    """The compiled kernel for R rows on ``device`` (compiled on first use), or None if compilation failed."""
    global available, unavailable_reason
    key = (R, device.index)
    k = _KERNELS.get(key)
    if k is None:
        with _LOCK:
            k = _KERNELS.get(key)
            if k is None:
                try:
                    with torch.cuda.device(device):
                        k = torch.cuda._compile_kernel(SOURCE % {"R": R}, "gdnviz_cholqr")
                except Exception as e:  # noqa: BLE001 - no NVRTC / unsupported GPU: the torch path stays
                    available = False
                    unavailable_reason = f"{type(e).__name__}: {str(e)[:300]}"
                    return None
                _KERNELS[key] = k
    return k


def cholqr(Z: torch.Tensor, shift: float = 1e-13, tiny: float = 1e-300) -> torch.Tensor:
    """``Z L⁻ᵀ`` (module docstring) for float64 CUDA ``Z [N, R, 32]``; RuntimeError if the kernel is unavailable."""
    if not supports(Z):
        raise ValueError(f"cholqr takes float64 CUDA [N, R, {Q}] with R in {SHAPES_R}; got {Z.dtype} "
                         f"{tuple(Z.shape)} on {Z.device}")
    N, R, _ = Z.shape
    k = _kernel(R, Z.device)
    if k is None:
        raise RuntimeError(f"the CUDA Cholesky-QR kernel is unavailable: {unavailable_reason}")
    Z = Z.contiguous()
    out = torch.empty_like(Z)
    if N:
        with torch.cuda.device(Z.device):
            k(grid=(N, 1, 1), block=(R, 1, 1), args=[Z, out, float(shift), float(tiny)])
    return out
