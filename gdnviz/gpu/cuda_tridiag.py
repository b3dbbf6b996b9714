"""Householder tridiagonalisation of many symmetric 128×128 (or 64×64) float64 matrices, one thread block per matrix,
in a CUDA kernel compiled at run time with NVRTC — the expensive half of ``gdnviz.gpu.symeig.svdvals`` (the
capture's per-boundary spectra) without Triton.

``tridiag(G)`` for float64 CUDA ``G [N, n, n]`` (n ∈ {64, 128}, symmetric) returns ``(D [N, n], E [N, n])``: the
diagonal and the subdiagonal (``E[:, i] = T[i+1, i]``, ``E[:, n-1] = 0``) of the tridiagonal matrix similar to
``G`` — the outputs of ``symeig._tridiag_kernel``, by the same reflections in the same order (step k: x = G[k+1:, k],
α = −sign(x₀)‖x‖, u = (x − α e₀)/‖x − α e₀‖, p = G u, q = p − (uᵀp) u, G ← G − 2(u qᵀ + q uᵀ)), so the bisection
kernel that follows is unchanged.

Layout: the matrix in shared memory (rows padded to n + 1 doubles; 132 KB for n = 128, so the kernel asks for that
much dynamic shared memory), thread i owns row i: p_i = Σ_j G[i][j] u_j and the rank-2 update of row i are
thread-private; the three scalars per step (‖x‖, ‖v‖, uᵀp) are block reductions (warp shuffles, then one value per
warp through shared memory). Why: the Triton kernel keeps the whole matrix in registers of one 16-warp program and
every step's reductions and layout conversions cross warps; measured on an H200 at 206 ms for the 18,432 matrices of
a 16K-token capture (bench/RESULTS.md), the largest item of the capture's GPU time.

Measured (H200, ``bench/bench_spectra.py --candidates``, sixth session, both in one run): the 18,432 Gram matrices
128×128 of a 16K-token capture in **105.6 ms vs 205.9 ms** for the Triton kernel (1.95× faster), eigenvalues after
the same bisection equal to 1.8e-15 relative to the largest.

Status: used by ``gdnviz.gpu.symeig.eigvalsh_tridiag`` (so by ``svdvals`` and the capture's spectra) on NVIDIA CUDA
builds for float64 64×64 and 128×128 matrices by default; ``GDNVIZ_CUDA_TRIDIAG=0`` keeps the Triton kernel. Compiled
with NVRTC once per (n, device) on first use (outside a CUDA-graph capture); if compilation fails (no NVRTC, an
unsupported GPU, too little shared memory), ``KERNELS.available`` is False (reason in ``KERNELS.reason``) and the
Triton kernel is used. ``tests/test_cuda_tridiag.py`` pins its singular values to float64 ``torch.linalg.svdvals``
and to the Triton path's on CUDA; on CPU the source is compiled for sm_90 where an NVRTC library is found, and run
through ``gdnviz.gpu.cuda_emul`` (g++ and an emulation of CUDA's threads), whose tridiagonal keeps G's eigenvalues.
"""
from __future__ import annotations

import os

import torch

from gdnviz.gpu.nvrtc import Kernels

SIZES = (64, 128)

SOURCE = r"""
#define NN %(N)d
#define NP (NN + 1)
#define NWARP (NN / 32)
__device__ __forceinline__ double block_sum(double v, double* red)
{
    // sum over the block's NN threads; every thread gets the same value (lane sums in a fixed order)
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int w = threadIdx.x >> 5;
    __syncthreads();  // red[] is free again
    if ((threadIdx.x & 31) == 0) red[w] = v;
    __syncthreads();
    double s = 0.0;
#pragma unroll
    for (int k = 0; k < NWARP; ++k) s += red[k];
    return s;
}

extern "C" __global__ void __launch_bounds__(NN)
gdnviz_tridiag(const double* __restrict__ G, double* __restrict__ D, double* __restrict__ E)
{
    extern __shared__ double sm[];
    double* A = sm;                 // [NN][NP]
    double* us = A + NN * NP;       // [NN]
    double* qs = us + NN;           // [NN]
    double* red = qs + NN;          // [NWARP]
    const int i = threadIdx.x;
    const long long base = (long long)blockIdx.x * NN * NN;
    for (int idx = i; idx < NN * NN; idx += NN) A[(idx / NN) * NP + idx %% NN] = G[base + idx];  // coalesced
    __syncthreads();
    for (int k = 0; k < NN - 2; ++k) {
        const double x = (i > k) ? A[i * NP + k] : 0.0;  // column k below the diagonal (A is symmetric)
        const double nrm = sqrt(block_sum(x * x, red));
        const double xk1 = A[(k + 1) * NP + k];
        const double alpha = (xk1 >= 0.0) ? -nrm : nrm;
        const double v = x - ((i == k + 1) ? alpha : 0.0);
        const double vn2 = block_sum(v * v, red);
        const double u = (vn2 > 0.0) ? v / sqrt(vn2 > 0.0 ? vn2 : 1.0) : 0.0;
        us[i] = u;
        __syncthreads();
        double p = 0.0;
        for (int j = 0; j < NN; ++j) p = fma(A[i * NP + j], us[j], p);
        const double kk = block_sum(u * p, red);
        const double q = p - kk * u;
        qs[i] = q;
        __syncthreads();
        for (int j = 0; j < NN; ++j) A[i * NP + j] -= 2.0 * (u * qs[j] + q * us[j]);
        __syncthreads();
    }
    D[(long long)blockIdx.x * NN + i] = A[i * NP + i];
    E[(long long)blockIdx.x * NN + i] = (i < NN - 1) ? A[(i + 1) * NP + i] : 0.0;
}
"""

KERNELS = Kernels()  # KERNELS.available / KERNELS.reason: whether compilation worked, and why not


def smem_bytes(n: int) -> int:
    """Dynamic shared memory of the kernel for n × n matrices (the padded matrix, u, q, one double per warp)."""
    return 8 * (n * (n + 1) + 2 * n + n // 32)


DEFAULT_ON = True  # measured 1.95× faster than the Triton kernel on an H200 (module docstring)


def enabled() -> bool:
    """On unless ``GDNVIZ_CUDA_TRIDIAG=0`` (``=1`` forces it on even if ``DEFAULT_ON`` is False), while compilation
    has not failed, on NVIDIA builds (the block reductions assume 32-lane warps)."""
    env = os.environ.get("GDNVIZ_CUDA_TRIDIAG", "").strip()
    on = DEFAULT_ON if env == "" else env != "0"
    return on and KERNELS.usable()


def supports(G: torch.Tensor) -> bool:
    """float64 CUDA ``[N, n, n]`` with n in SIZES."""
    return G.is_cuda and G.dim() == 3 and G.dtype == torch.float64 and G.shape[-1] in SIZES and G.shape[-2] == G.shape[-1]


def _kernel(n: int, device: torch.device):
    return KERNELS.get((n, device.index), device, SOURCE % {"N": n}, "gdnviz_tridiag", shared_mem=smem_bytes(n))


def tridiag(G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(D [N, n], E [N, n])`` of float64 CUDA symmetric ``G [N, n, n]`` (module docstring); RuntimeError if the
    kernel is unavailable."""
    if not supports(G):
        raise ValueError(f"tridiag takes float64 CUDA [N, n, n] with n in {SIZES}; got {G.dtype} {tuple(G.shape)} "
                         f"on {G.device}")
    N, n, _ = G.shape
    k = _kernel(n, G.device)
    if k is None:
        raise RuntimeError(f"the CUDA tridiagonalisation kernel is unavailable: {KERNELS.reason}")
    G = G.contiguous()
    D = torch.empty(N, n, dtype=torch.float64, device=G.device)
    E = torch.empty_like(D)
    if N:
        with torch.cuda.device(G.device):
            k(grid=(N, 1, 1), block=(n, 1, 1), args=[G, D, E], shared_mem=smem_bytes(n))
    return D, E
