"""Householder tridiagonalisation of many symmetric float64 matrices (n = 64 or 128) on CUDA, one thread block per
matrix, compiled at run time with NVRTC: the first half of ``gdnviz.gpu.symeig.eigvalsh``.

``tridiag(G, skip=None)``: float64 CUDA symmetric ``G [N, n, n]``, n in :data:`SIZES` → ``(D [N, n], E [N, n])``
float64, the diagonal and subdiagonal (``E[:, i] = T[i+1, i]``, ``E[:, n-1] = 0``) of a tridiagonal T similar to G.
``skip`` (an integer or bool ``[N]`` on G's device, nonzero = skipped): those blocks return before any work and
their rows stay zero; the other rows are the same bits as without it. Asynchronous (no host sync). ValueError for any other
input; RuntimeError if the kernel cannot be compiled (``KERNELS.reason``). The kernel is compiled once per
(n, device) on first use (call outside a CUDA-graph capture). Design notes, tests and timings: docs/kernels-spectra.md.
"""
from __future__ import annotations

import torch

from gdnviz.gpu.nvrtc import Kernels

SIZES = (64, 128)
KERNELS = Kernels()  # KERNELS.available / KERNELS.reason: whether compilation worked, and why not

# Step k's reflector: x = G[k+1:, k], alpha = -sign(x_0) ||x||, u = (x - alpha e_0) / ||x - alpha e_0||, p = G u,
# q = p - (u^T p) u, G <- G - 2 (u q^T + q u^T). Block sums are warp shuffles, one partial per warp in shared memory,
# published by the barrier the step needs anyway.
WARP_SUM = r"""
__device__ __forceinline__ double warp_sum(double v)
{
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Row i's entry of step k's unit reflector u = (x - alpha e_{k+1}) / ||x - alpha e_{k+1}||, from x_i, ||x||^2 and
// x_{k+1} (in this order)
__device__ __forceinline__ double reflector_entry(double x, int i, int k, double nrm2, double xk1)
{
    const double nrm = sqrt(nrm2);
    const double alpha = (xk1 >= 0.0) ? -nrm : nrm;
    // ||x - alpha e_{k+1}||^2 = 2 (||x||^2 + |x_{k+1}| ||x||): alpha has x_{k+1}'s opposite sign, no cancellation
    const double vn2 = 2.0 * (nrm2 + fabs(xk1) * nrm);
    const double v = x - ((i == k + 1) ? alpha : 0.0);
    return (vn2 > 0.0) ? v / sqrt(vn2) : 0.0;
}
"""

# Layout: two threads per row; thread (warp w, lane l) holds row i = 32 (w / 2) + l, columns j = HALF (w % 2) + c,
# c < HALF = n / 2, in registers -- each warp a 32-row x HALF-column tile, so that a step's work can be skipped a whole
# warp at a time: a warp whose rows are all < k or whose columns are all < k has nothing to compute at step k (its u, p
# are 0 or its entries are final), which leaves ~54% of the warp-steps of updating every tile for n = 128. Column k
# (the reflector's x) is read from the registers by a switch on the block-uniform k % HALF (one indirect branch, not
# HALF selects), published in shared memory with ||x||^2; p = A u is two half sums (4 interleaved partial sums each),
# kept apart in shared memory and added where used; the rank-2 update is A_ij += c1_i p_j + c2_i u_j with
# c1 = -2 u_i, c2 = 4 (u^T p) u_i - 2 p_i, i.e. A - 2 (u q^T + q u^T) with q = p - (u^T p) u, in two fused
# multiply-adds per entry. ||x - alpha e_1||^2 = 2 (||x||^2 + |x_1| ||x||) needs no reduction of its own: three
# barriers per step. Static shared memory only.
SOURCE = WARP_SUM + r"""
#define NN %(N)d
#define HALF (NN / 2)
#define NT (2 * NN)
#define NWARP (NT / 32)
#define RB (NN / 32)

extern "C" __global__ void __launch_bounds__(NT, 1)
gdnviz_tridiag(const double* __restrict__ G, double* __restrict__ D, double* __restrict__ E, const int* SKIP,
               int skip_on)
{
    // a skipped matrix: no work, nothing written (tridiag() starts D, E at zero). The test comes first and writes
    // nothing: placed later, or writing zeros, it costs spills in the step loop for n = 128 (255 registers)
    if (skip_on && SKIP[blockIdx.x] != 0) return;
    __align__(16) __shared__ double us[NN];     // u (0 for rows <= k)
    __align__(16) __shared__ double pp[2 * NN];  // pp[2 j + h]: half h's partial sum of p_j = (A u)_j (0 for j < k)
    __shared__ double xs[NN];                 // x = A[i][k] for rows i > k, 0 elsewhere
    __shared__ double red1[RB];               // per row block: partial ||x||^2
    __shared__ double red2[NWARP];            // per warp: partial u^T p
    const int t = threadIdx.x, w = t >> 5, lane = t & 31;
    const int h = w & 1, rb = w >> 1;
    const int i = 32 * rb + lane;             // this thread's row
    const int jb = HALF * h;                  // its columns jb .. jb + HALF - 1
    const long long base = (long long)blockIdx.x * NN * NN;
    double a[HALF];
    {
        const double2* g2 = reinterpret_cast<const double2*>(G + base + (long long)i * NN + jb);
#pragma unroll
        for (int c = 0; c < HALF / 2; ++c) {
            const double2 v = g2[c];
            a[2 * c] = v.x;
            a[2 * c + 1] = v.y;
        }
    }
    for (int k = 0; k < NN - 2; ++k) {
        const int hk = k / HALF, ck = k %% HALF;  // block-uniform: the half and the column that hold column k
        if (h == hk) {
            double x = 0.0;
            switch (ck) {
%(SWITCH)s
            }
            x = (i > k) ? x : 0.0;
            xs[i] = x;
            const double s1 = warp_sum(x * x);
            if (lane == 0) red1[rb] = s1;
        }
        __syncthreads();
        double nrm2 = 0.0;
#pragma unroll
        for (int r = 0; r < RB; ++r) nrm2 += red1[r];
        const double u = reflector_entry(xs[i], i, k, nrm2, xs[k + 1]);
        if (h == 0) us[i] = u;
        __syncthreads();
        // rows < k are finished (p = 0 there); columns < k hold no u and no p: such warps skip the step
        const bool active = (32 * rb + 31 >= k) && (jb + HALF - 1 >= k);
        double p = 0.0;
        if (active) {
            const double2* u2 = reinterpret_cast<const double2*>(us + jb);
            double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
#pragma unroll
            for (int c = 0; c < HALF; c += 4) {
                const double2 ua = u2[c / 2], ub = u2[c / 2 + 1];
                s0 = fma(a[c], ua.x, s0);
                s1 = fma(a[c + 1], ua.y, s1);
                s2 = fma(a[c + 2], ub.x, s2);
                s3 = fma(a[c + 3], ub.y, s3);
            }
            p = (i >= k) ? (s0 + s1) + (s2 + s3) : 0.0;
        }
        pp[2 * i + h] = p;
        const double s2w = warp_sum(u * p);
        if (lane == 0) red2[w] = s2w;
        __syncthreads();
        if (active) {
            double kk = 0.0;
#pragma unroll
            for (int r = 0; r < NWARP; ++r) kk += red2[r];
            const double2 pi2 = reinterpret_cast<const double2*>(pp)[i];
            const double pi = pi2.x + pi2.y;
            const double c1 = -2.0 * u, c2 = 4.0 * kk * u - 2.0 * pi;
            const double2* p2 = reinterpret_cast<const double2*>(pp) + jb;
            const double2* u2 = reinterpret_cast<const double2*>(us + jb);
#pragma unroll
            for (int c = 0; c < HALF; c += 2) {
                const double2 ua = u2[c / 2], pa = p2[c], pb = p2[c + 1];
                a[c] = fma(c1, pa.x + pa.y, fma(c2, ua.x, a[c]));
                a[c + 1] = fma(c1, pb.x + pb.y, fma(c2, ua.y, a[c + 1]));
            }
        }
    }
    double d = 0.0, e = 0.0;  // D[i] = A[i][i] (column i), E[i-1] = A[i][i-1] (column i-1)
#pragma unroll
    for (int c = 0; c < HALF; ++c) {
        const int j = jb + c;
        d = (j == i) ? a[c] : d;
        e = (j == i - 1) ? a[c] : e;
    }
    if (i >= jb && i < jb + HALF) D[(long long)blockIdx.x * NN + i] = d;
    if (i > 0 && i - 1 >= jb && i - 1 < jb + HALF) E[(long long)blockIdx.x * NN + i - 1] = e;
    if (i == NN - 1 && h == 0) E[(long long)blockIdx.x * NN + NN - 1] = 0.0;
}
"""


def _switch(half: int) -> str:
    return "\n".join(f"            case {c}: x = a[{c}]; break;" for c in range(half))


def source(n: int) -> str:
    """The kernel's CUDA source (entry ``gdnviz_tridiag``, ``2 n`` threads per block) for n × n matrices."""
    return SOURCE % {"N": n, "SWITCH": _switch(n // 2)}


def supports(G: torch.Tensor) -> bool:
    """float64 CUDA ``[N, n, n]`` with n in :data:`SIZES`, on an NVIDIA build (the block sums assume 32-lane warps)."""
    return (G.is_cuda and torch.version.hip is None and G.dim() == 3 and G.dtype == torch.float64
            and G.shape[-1] in SIZES and G.shape[-2] == G.shape[-1])


def kernel(n: int, device: torch.device):
    """The compiled kernel for n × n matrices on ``device``, or None once a compilation has failed."""
    return KERNELS.get((n, device.index), device, source(n), "gdnviz_tridiag")


def skip_args(skip: torch.Tensor | None, N: int, placeholder: torch.Tensor) -> list:
    """The kernels' last two arguments (``const int* SKIP, int skip_on``) for a skip mask: ``skip`` None → the
    ``placeholder`` tensor (not read) and 0; else an integer or bool tensor ``[N]`` on the placeholder's device,
    nonzero = skipped → it as int32 and 1. ValueError for another shape or device."""
    if skip is None:
        return [placeholder, 0]
    if skip.shape != (N,) or skip.device != placeholder.device or skip.is_floating_point() or skip.is_complex():
        raise ValueError(f"skip must be an integer or bool tensor [{N}] on {placeholder.device}; got {skip.dtype} "
                         f"{tuple(skip.shape)} on {skip.device}")
    return [skip.to(torch.int32).contiguous(), 1]


def tridiag(G: torch.Tensor, skip: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(D [N, n], E [N, n])`` of float64 CUDA symmetric ``G [N, n, n]``, matrices with a nonzero ``skip`` entry
    skipped (module docstring)."""
    if not supports(G):
        raise ValueError(f"tridiag takes float64 CUDA [N, n, n] with n in {SIZES}; got {G.dtype} {tuple(G.shape)} "
                         f"on {G.device}")
    N, n, _ = G.shape
    k = kernel(n, G.device)
    if k is None:
        raise RuntimeError(f"the CUDA tridiagonalisation kernel is unavailable: {KERNELS.reason}")
    G = G.contiguous()
    D = (torch.empty if skip is None else torch.zeros)(N, n, dtype=torch.float64, device=G.device)
    E = torch.empty_like(D) if skip is None else torch.zeros_like(D)
    tail = skip_args(skip, N, D)
    if N:
        with torch.cuda.device(G.device):
            k(grid=(N, 1, 1), block=(2 * n, 1, 1), args=[G, D, E, *tail])
    return D, E
