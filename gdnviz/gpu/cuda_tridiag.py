"""Householder tridiagonalisation of many symmetric 128×128 (or 64×64) float64 matrices, one thread block per matrix,
in a CUDA kernel compiled at run time with NVRTC — the expensive half of ``gdnviz.gpu.symeig.svdvals`` (the
capture's per-boundary spectra) without Triton.

``tridiag(G)`` for float64 CUDA ``G [N, n, n]`` (n ∈ {64, 128}, symmetric) returns ``(D [N, n], E [N, n])``: the
diagonal and the subdiagonal (``E[:, i] = T[i+1, i]``, ``E[:, n-1] = 0``) of the tridiagonal matrix similar to
``G`` — the outputs of ``symeig._tridiag_kernel``, by the same reflections in the same order (step k: x = G[k+1:, k],
α = −sign(x₀)‖x‖, u = (x − α e₀)/‖x − α e₀‖, p = G u, q = p − (uᵀp) u, G ← G − 2(u qᵀ + q uᵀ)), so the bisection
kernel that follows is unchanged.

Three forms of one algorithm. Each gives a row of G to TPR threads (register and shared-memory forms: thread h owns
the columns j ≡ h (mod TPR); split form: one contiguous half each): p_i = Σ_j G[i][j] u_j is TPR partial sums, and the
rank-2 update of row i is private to its TPR threads. The two scalars per step (‖x‖² and uᵀp) are warp sums whose
per-warp partials are published by the barrier the step needs anyway, and ‖x − αe₁‖² = 2(‖x‖² + |x₁|‖x‖) needs no
reduction of its own: three barriers per reflection.

- register form (``SOURCE_REG``, the default until the tenth session, TPR = 2: 256 threads, 64 doubles of G in
  each thread's registers, 200 registers, no spills): the matrix never touches shared memory; every loop over a
  thread's columns is unrolled, so the register array is indexed by constants only and column k is picked out by
  predicated selects;
- shared-memory form (``SOURCE``, ``GDNVIZ_CUDA_TRIDIAG=smem``, TPR = 4: the matrix in shared memory, rows padded
  to n + TPR doubles, 135 KB for n = 128): step k touches only the trailing block (rows and columns ≥ k), a third
  of the arithmetic of updating the whole matrix;
- split form (``SOURCE_SPLIT``, the default since the eleventh session; its comment has the layout): the register
  form's arithmetic in 32-row × 64-column warp tiles, so that warps whose rows or columns are finished skip a step,
  and two fused multiply-adds per entry of the update. H200: 30.9 ms for the 18,432 matrices against 41.4 ms for the
  register form in the same run, eigenvalues equal to 1.8e-15 relative.

Measured on an H200 (``bench/bench_spectra.py --candidates``, seventh session, the 18,432 Gram matrices of a 16K
capture, one run): register form 41.8 ms, shared-memory form 47.0 ms, the Triton kernel (the whole matrix in the
registers of one 16-warp program, reductions and layout conversions across warps) 205.9 ms, so 4.9× faster; the
first CUDA version (sixth session: one thread per row, the whole matrix updated every step, eight barriers per step)
took 105.6 ms. Eigenvalues after the same bisection equal to 1.8e-15 relative.

Status: used by ``gdnviz.gpu.symeig.eigvalsh_tridiag`` (so by ``svdvals`` and the capture's spectra) on NVIDIA CUDA
builds for float64 64×64 and 128×128 matrices by default; ``GDNVIZ_CUDA_TRIDIAG=0`` keeps the Triton kernel. Compiled
with NVRTC once per (n, device) on first use (outside a CUDA-graph capture); if compilation fails (no NVRTC, an
unsupported GPU, too little shared memory), ``KERNELS.available`` is False (reason in ``KERNELS.reason``) and the
Triton kernel is used. ``tests/test_cuda_tridiag.py`` pins its singular values to float64 ``torch.linalg.svdvals``
and to the Triton path's on CUDA; on CPU the source is compiled for sm_90 where an NVRTC library is found, and run
through ``tests.support.cuda_emul`` (g++ and an emulation of CUDA's threads), whose tridiagonal keeps G's eigenvalues.
"""
from __future__ import annotations

import os

import torch

from gdnviz.gpu.nvrtc import Kernels

SIZES = (64, 128)

# Shared by both forms: the block layout and the two per-step block scalars. Block sums are warp shuffles, one partial
# per warp in shared memory, and the barrier that publishes them is the one the step needs anyway.
WARP_SUM = r"""
__device__ __forceinline__ double warp_sum(double v)
{
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Row i's entry of step k's unit reflector u = (x - alpha e_{k+1}) / ||x - alpha e_{k+1}||, from x_i, ||x||^2 and
// x_{k+1} (every form's arithmetic, in this order)
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

PREAMBLE = WARP_SUM + r"""
#define NN %(N)d
#define TPR %(TPR)d
#define NT (NN * TPR)
#define NWARP (NT / 32)

// Row i's entry u_i of step k's unit reflector, from x_i = A[i][k] (0 for i <= k): publishes ||x||^2 (red1) and
// x_{k+1} (sc[0]), then stores u in us[]; two barriers.
__device__ __forceinline__ double reflector(double x, int i, int h, int k, double* red1, double* sc, double* us)
{
    if (h == 0 && i == k + 1) sc[0] = x;
    const double s1 = warp_sum(h == 0 ? x * x : 0.0);
    if ((threadIdx.x & 31) == 0) red1[threadIdx.x >> 5] = s1;
    __syncthreads();
    double nrm2 = 0.0;
#pragma unroll
    for (int w = 0; w < NWARP; ++w) nrm2 += red1[w];
    const double u = reflector_entry(x, i, k, nrm2, sc[0]);
    if (h == 0) us[i] = u;
    __syncthreads();
    return u;
}

// u^T p from every row's (u_i, p_i), with p_i (TPR lanes' partial sums, joined here) stored in ps[]; one barrier.
__device__ __forceinline__ double publish_p(double u, double& p, int i, int h, double* red2, double* ps)
{
#pragma unroll
    for (int o = TPR / 2; o > 0; o >>= 1) p += __shfl_xor_sync(0xffffffffu, p, o);
    const double s2 = warp_sum(h == 0 ? u * p : 0.0);
    if ((threadIdx.x & 31) == 0) red2[threadIdx.x >> 5] = s2;
    if (h == 0) ps[i] = p;
    __syncthreads();
    double kk = 0.0;
#pragma unroll
    for (int w = 0; w < NWARP; ++w) kk += red2[w];
    return kk;
}
"""

SOURCE = PREAMBLE + r"""
#define NP (NN + TPR)

extern "C" __global__ void __launch_bounds__(NT)
gdnviz_tridiag(const double* __restrict__ G, double* __restrict__ D, double* __restrict__ E)
{
    extern __shared__ double sm[];
    double* A = sm;                 // [NN][NP]
    double* us = A + NN * NP;       // [NN] u
    double* ps = us + NN;           // [NN] p = A u
    double* red1 = ps + NN;         // [NWARP] partial ||x||^2
    double* red2 = red1 + NWARP;    // [NWARP] partial u^T p
    double* sc = red2 + NWARP;      // [1] x_{k+1}
    const int t = threadIdx.x;
    const int i = t / TPR, h = t %% TPR;  // row i, columns j = h (mod TPR)
    const long long base = (long long)blockIdx.x * NN * NN;
    for (int idx = t; idx < NN * NN; idx += NT) A[(idx / NN) * NP + idx %% NN] = G[base + idx];  // coalesced
    __syncthreads();
    for (int k = 0; k < NN - 2; ++k) {
        const double x = (i > k) ? A[i * NP + k] : 0.0;  // column k below the diagonal (row i's copy: A symmetric)
        const double u = reflector(x, i, h, k, red1, sc, us);
        double p = 0.0;  // rows i >= k only (u vanishes on j <= k; rows above k are finished)
        if (i >= k)
            for (int j = k + 1 + ((h - (k + 1) %% TPR + TPR) %% TPR); j < NN; j += TPR)
                p = fma(A[i * NP + j], us[j], p);
        const double kk = publish_p(u, p, i, h, red2, ps);
        // A <- A - 2 (u q^T + q u^T), q = p - (u^T p) u, on the trailing block rows/columns >= k
        const double q = p - kk * u;
        if (i >= k)
            for (int j = k + ((h - k %% TPR + TPR) %% TPR); j < NN; j += TPR)
                A[i * NP + j] -= 2.0 * (u * (ps[j] - kk * us[j]) + q * us[j]);
        __syncwarp();  // the next step's x = A[i][k+1] may have been written by another lane of row i's group
    }
    __syncthreads();
    if (h == 0) {
        D[(long long)blockIdx.x * NN + i] = A[i * NP + i];
        E[(long long)blockIdx.x * NN + i] = (i < NN - 1) ? A[(i + 1) * NP + i] : 0.0;
    }
}
"""

# The register form (module docstring); the arithmetic per step is the shared-memory form's, but the update runs
# over the whole row (u and p vanish outside the trailing block, so it adds exact zeros there).
SOURCE_REG = PREAMBLE + r"""
#define NC (NN / TPR)

extern "C" __global__ void __launch_bounds__(NT, 1)
gdnviz_tridiag(const double* __restrict__ G, double* __restrict__ D, double* __restrict__ E)
{
    extern __shared__ double sm[];
    double* us = sm;                // [NN] u
    double* ps = us + NN;           // [NN] p = A u
    double* red1 = ps + NN;         // [NWARP] partial ||x||^2
    double* red2 = red1 + NWARP;    // [NWARP] partial u^T p
    double* sc = red2 + NWARP;      // [1] x_{k+1}
    const int t = threadIdx.x;
    const int i = t / TPR, h = t %% TPR;  // row i, columns j = h + TPR c
    const int lane0 = (t & 31) - h;         // the first lane of row i's group
    const long long base = (long long)blockIdx.x * NN * NN;
    double a[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) a[c] = G[base + i * NN + h + TPR * c];
    for (int k = 0; k < NN - 2; ++k) {
        const int kc = k / TPR, kh = k %% TPR;
        double mine = 0.0;  // A[i][k] if this lane holds column k
#pragma unroll
        for (int c = 0; c < NC; ++c) mine = (c == kc) ? a[c] : mine;
        double x = __shfl_sync(0xffffffffu, mine, lane0 + kh);
        x = (i > k) ? x : 0.0;
        const double u = reflector(x, i, h, k, red1, sc, us);
        double p = 0.0;
#pragma unroll
        for (int c = 0; c < NC; ++c) p = fma(a[c], us[h + TPR * c], p);
        p = (i >= k) ? p : 0.0;  // rows above k are finished (their lanes' partial sums are all zeroed alike)
        const double kk = publish_p(u, p, i, h, red2, ps);
        const double q = p - kk * u;
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const int j = h + TPR * c;
            a[c] -= 2.0 * (u * (ps[j] - kk * us[j]) + q * us[j]);
        }
    }
    double d = 0.0, e = 0.0;  // D[i] = A[i][i] (column i), E[i-1] = A[i][i-1] (column i-1)
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        const int j = h + TPR * c;
        d = (j == i) ? a[c] : d;
        e = (j == i - 1) ? a[c] : e;
    }
    if (h == i %% TPR) D[(long long)blockIdx.x * NN + i] = d;
    if (i > 0 && h == (i - 1) %% TPR) E[(long long)blockIdx.x * NN + i - 1] = e;
    if (i == NN - 1 && h == 0) E[(long long)blockIdx.x * NN + NN - 1] = 0.0;
}
"""

# The split form (``SOURCE_SPLIT``, ``GDNVIZ_CUDA_TRIDIAG=split``): two threads per row as in the register form, but
# thread (warp w, lane l) holds row i = 32 (w / 2) + l, columns j = HALF (w % 2) + c, c < HALF = n / 2 — each warp a
# 32-row × HALF-column tile, so that a step's work can be skipped a whole warp at a time: a warp whose rows are all
# < k or whose columns are all < k has nothing to compute at step k (its u, p are 0 or its entries are final), which
# leaves ~54% of the register form's warp-steps for n = 128. Column k (the reflector's x) is read from the registers
# by a switch on the block-uniform k % HALF (one indirect branch, not HALF selects), published in shared memory with
# ||x||^2; p = A u is two half sums (4 interleaved partial sums each), kept apart in shared memory and added where used;
# the rank-2 update is A_ij += c1_i p_j + c2_i u_j with c1 = -2 u_i, c2 = 4 (u^T p) u_i - 2 p_i, i.e.
# A - 2 (u q^T + q u^T) with q = p - (u^T p) u, in two fused multiply-adds per entry. Three barriers per step.
SOURCE_SPLIT = WARP_SUM + r"""
#define NN %(N)d
#define HALF (NN / 2)
#define NT (2 * NN)
#define NWARP (NT / 32)
#define RB (NN / 32)

extern "C" __global__ void __launch_bounds__(NT, 1)
gdnviz_tridiag(const double* __restrict__ G, double* __restrict__ D, double* __restrict__ E)
{
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


KERNELS = Kernels()  # KERNELS.available / KERNELS.reason: whether compilation worked, and why not


# The defaults, measured on an H200 (bench/bench_spectra.py --candidates, 18,432 matrices 128×128, one run each):
# eleventh session: split form 30.9 ms, register form at 2 threads per row 41.4 ms, shared-memory form at 4 per row
# 47.0 ms, the Triton kernel 205.9 ms; seventh session: shared memory at 2 per row 52.7, 1 per row 69.4; register
# form at 4 per row 56.7 ms.
REGS = "split"  # the split form (SOURCE_SPLIT; True: the register form SOURCE_REG, False: shared memory)
TPR_REGS = 2  # threads per row in the register form (64 doubles of G per thread for n = 128: 200 registers)
TPR_SMEM = 4  # threads per row in the shared-memory form


SPLIT = "split"  # ``regs=SPLIT``: the split form (SOURCE_SPLIT, 2 threads per row, static shared memory only)


def default_regs() -> bool | str:
    """The form ``tridiag`` uses unless told: ``GDNVIZ_CUDA_TRIDIAG=regs``, ``=smem`` or ``=split`` pick one (True,
    False, ``SPLIT``), else ``REGS``."""
    env = os.environ.get("GDNVIZ_CUDA_TRIDIAG", "").strip()
    return True if env == "regs" else False if env == "smem" else SPLIT if env == SPLIT else REGS


def _switch(half: int) -> str:
    return "\n".join(f"            case {c}: x = a[{c}]; break;" for c in range(half))


def source(n: int, tpr: int, regs: bool | str) -> str:
    """The kernel's CUDA source for n × n matrices and ``tpr`` threads per row (``n * tpr`` threads per block), the
    matrix in shared memory, (``regs``) in registers, or (``regs=SPLIT``, tpr 2) the split form."""
    if regs == SPLIT:
        if tpr != 2:
            raise ValueError("the split form has 2 threads per row")
        return SOURCE_SPLIT % {"N": n, "SWITCH": _switch(n // 2)}
    return (SOURCE_REG if regs else SOURCE) % {"N": n, "TPR": tpr}


def smem_bytes(n: int, tpr: int, regs: bool | str) -> int:
    """Dynamic shared memory of the kernel for n × n matrices: the matrix (shared-memory form only; rows padded to
    n + tpr doubles, which spreads a warp's reads of tpr adjacent columns of 32 / tpr rows over all banks), u, p,
    two partial sums per warp and one scalar; 0 for the split form (static arrays only)."""
    if regs == SPLIT:
        return 0
    return 8 * ((0 if regs else n * (n + tpr)) + 2 * n + 2 * (n * tpr // 32) + 1)


DEFAULT_ON = True  # measured faster than the Triton kernel on an H200 (module docstring)


def enabled() -> bool:
    """On unless ``GDNVIZ_CUDA_TRIDIAG=0`` (``=1``, ``=regs`` or ``=smem`` force it on), while compilation
    has not failed, on NVIDIA builds (the block reductions assume 32-lane warps)."""
    return KERNELS.switched_on("GDNVIZ_CUDA_TRIDIAG", DEFAULT_ON)


def supports(G: torch.Tensor) -> bool:
    """float64 CUDA ``[N, n, n]`` with n in SIZES."""
    return G.is_cuda and G.dim() == 3 and G.dtype == torch.float64 and G.shape[-1] in SIZES and G.shape[-2] == G.shape[-1]


def _form(tpr: int | None, regs: bool | str | None) -> tuple[int, bool | str]:
    regs = default_regs() if regs is None else regs
    return (tpr if tpr is not None else 2 if regs == SPLIT else TPR_REGS if regs else TPR_SMEM), regs


def _kernel(n: int, device: torch.device, tpr: int | None = None, regs: bool | None = None):
    tpr, regs = _form(tpr, regs)
    return KERNELS.get((n, tpr, regs, device.index), device, source(n, tpr, regs), "gdnviz_tridiag",
                       shared_mem=smem_bytes(n, tpr, regs))


def tridiag(G: torch.Tensor, tpr: int | None = None, regs: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(D [N, n], E [N, n])`` of float64 CUDA symmetric ``G [N, n, n]`` (module docstring); ``regs``: the register
    form (None: :func:`default_regs`), ``tpr``: threads per row (None: that form's default). RuntimeError if the
    kernel is unavailable."""
    tpr, regs = _form(tpr, regs)
    if not supports(G):
        raise ValueError(f"tridiag takes float64 CUDA [N, n, n] with n in {SIZES}; got {G.dtype} {tuple(G.shape)} "
                         f"on {G.device}")
    N, n, _ = G.shape
    k = _kernel(n, G.device, tpr, regs)
    if k is None:
        raise RuntimeError(f"the CUDA tridiagonalisation kernel is unavailable: {KERNELS.reason}")
    G = G.contiguous()
    D = torch.empty(N, n, dtype=torch.float64, device=G.device)
    E = torch.empty_like(D)
    if N:
        with torch.cuda.device(G.device):
            k(grid=(N, 1, 1), block=(n * tpr, 1, 1), args=[G, D, E], shared_mem=smem_bytes(n, tpr, regs))
    return D, E
