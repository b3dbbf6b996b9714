"""All eigenvalues of many symmetric tridiagonal float64 matrices (n = 64 or 128) by bisection on Sturm counts, on
CUDA, compiled at run time with NVRTC: the second half of ``gdnviz.gpu.symeig.eigvalsh``.

``bisect(D, E, steps=STEPS, skip=None)``: float64 CUDA ``D, E [N, n]`` (diagonal; subdiagonal ``E[:, i] =
T[i+1, i]``, ``E[:, n-1]`` ignored), n in :data:`SIZES` → the eigenvalues ``W [N, n]`` float64, ascending; absolute
accuracy ≈ ε_f64·‖T‖. ``skip`` (an integer or bool ``[N]`` on D's device, nonzero = skipped): those blocks write
zeros and return before any work; the other rows are the same bits as without it. Asynchronous (no host sync).
ValueError for any other input; RuntimeError if the kernel cannot be compiled (``KERNELS.reason``). Compiled once
per (n, device) on first use. Design notes, tests and timings: docs/kernels-spectra.md.
"""
from __future__ import annotations

import torch

from gdnviz.gpu.cuda_tridiag import skip_args
from gdnviz.gpu.nvrtc import Kernels

SIZES = (64, 128)
#: Halvings of the Gershgorin interval. Those beyond ~53 resolve the small eigenvalues of graded matrices to the
#: relative accuracy the tests ask for (docs/kernels-spectra.md).
STEPS = 64
KERNELS = Kernels()  # KERNELS.available / KERNELS.reason

# One block of n threads per matrix, thread j bisecting for the j-th smallest eigenvalue; the tridiagonal in shared
# memory (every thread reads the same entry at each step: a broadcast). The Gershgorin interval widened by 1e-12 of its
# span, and pivmin = 1e-300 + 4.9e-32 max_i(|d_i| + |e_i|) (every thread computes the same, in the same order).
PREAMBLE = r"""
#define NN %(N)d
__device__ __forceinline__ void load_tridiagonal(const double* __restrict__ D, const double* __restrict__ E,
                                                 long long base, int j, double* ds, double* es)
{
    const double ej = (j < NN - 1) ? E[base + j] : 0.0;
    ds[j] = D[base + j];
    es[j] = ej;
}

// [a, b] contains every eigenvalue; scale = max_i(|d_i| + |e_i|); pivmin = 1e-300 + 4.9e-32 scale
__device__ __forceinline__ void gershgorin(const double* ds, const double* es, double& a, double& b, double& scale,
                                           double& pivmin)
{
    double lo = 1e300, hi = -1e300, e_prev = 0.0;
    scale = 0.0;
    for (int i = 0; i < NN; ++i) {
        const double di = ds[i], ei = es[i];
        const double rad = fabs(ei) + fabs(e_prev);
        lo = fmin(lo, di - rad);
        hi = fmax(hi, di + rad);
        scale = fmax(scale, fabs(di) + fabs(ei));
        e_prev = ei;
    }
    const double span = fmax(hi - lo, 1e-300);
    a = lo - 1e-12 * span;
    b = hi + 1e-12 * span;
    pivmin = 1e-300 + 4.9e-32 * scale;
}
"""

# The Sturm count of T - x I from the signs of the leading principal minors p_i = det(T[:i, :i] - x I): the three-term
# recurrence p_i = (d_i - x) p_{i-1} - e_{i-1}^2 p_{i-2} needs no division (the LDL^T pivots q_i = p_i / p_{i-1} would:
# a float64 division is a 10-instruction sequence around MUFU.RCP64H with a slow-path branch, ~30 instructions per
# Sturm step against ~13 here). The pivmin rule, written on the minors: |p_i| < pivmin |p_{i-1}| (|q_i| < pivmin) ->
# p_i = -pivmin p_{i-1} (q_i = -pivmin); a negative pivot is a sign change between p_{i-1} and p_i. In floating point
# each step is the LDL^T step of T with d_i - x and e_{i-1}^2 perturbed by a few ulps relatively, so the count is exact
# for a matrix as close to T. Range: T, x and pivmin are scaled by a power of two sigma >= max_i(|d_i| + |e_i|)
# (exact), so every pivot lies in [pivmin/sigma, 3 + sigma/pivmin] ~ [2^-105, 2^106]; every 4 steps p_i and p_{i-1}
# are multiplied by 2^-exponent(p_i) (exact), which keeps 4 further steps inside float64's range (2^-1022 .. 2^1023)
# with a margin of 2^400.
SOURCE = PREAMBLE + r"""
extern "C" __global__ void __launch_bounds__(NN)
gdnviz_bisect(const double* __restrict__ D, const double* __restrict__ E, double* __restrict__ W, int steps,
              const int* SKIP, int skip_on)
{
    __shared__ double ds[NN];
    __shared__ double es[NN];
    __shared__ double2 de[NN];  // (d_i / sigma, e_{i-1}^2 / sigma^2), e_{-1} = 0
    const int j = threadIdx.x;
    const long long base = (long long)blockIdx.x * NN;
    if (skip_on && SKIP[blockIdx.x] != 0) {  // a skipped matrix (block-uniform, before any barrier): W = 0
        W[base + j] = 0.0;
        return;
    }
    load_tridiagonal(D, E, base, j, ds, es);
    __syncthreads();
    double a, b, scale, pivmin;
    gershgorin(ds, es, a, b, scale, pivmin);
    // sigma = 2^(ilogb(max(scale, 1e-280)) + 1): a power of two, so the scaling below is exact
    const int sexp = ilogb(fmax(scale, 1e-280)) + 1;
    const double inv = ldexp(1.0, -sexp);
    {
        const double em = (j > 0) ? es[j - 1] * inv : 0.0;
        de[j] = make_double2(ds[j] * inv, em * em);
    }
    __syncthreads();
    const double npiv = -pivmin * inv;  // negated: the replacement -pivmin p_{i-1} is one multiplication
    for (int s = 0; s < steps; ++s) {
        const double mid = 0.5 * (a + b);
        const double x = mid * inv;
        int cnt = 0;
        double p1 = 1.0, p2 = 0.0;  // p_{i-1}, p_{i-2}
#pragma unroll 4
        for (int i = 0; i < NN; ++i) {
            const double2 v = de[i];
            double p = fma(v.x - x, p1, -(v.y * p2));
            const double m = npiv * p1;
            p = (fabs(p) < fabs(m)) ? m : p;
            cnt += ((__double2hiint(p) ^ __double2hiint(p1)) < 0) ? 1 : 0;  // a sign change: a negative pivot
            p2 = p1;
            p1 = p;
            if ((i & 3) == 3) {  // p_i to [1, 2), p_{i-1} by the same power of two
                const int ex = (__double2hiint(p1) >> 20) & 0x7ff;
                const double f = __hiloint2double((2046 - ex) << 20, 0);
                p1 *= f;
                p2 *= f;
            }
        }
        if (cnt > j) b = mid; else a = mid;  // more than j eigenvalues below mid: the j-th is left of mid
    }
    W[base + j] = 0.5 * (a + b);
}
"""


def source(n: int) -> str:
    """The kernel's CUDA source (entry ``gdnviz_bisect``, ``n`` threads per block) for tridiagonals of size n."""
    return SOURCE % {"N": n}


def supports(D: torch.Tensor) -> bool:
    """float64 CUDA ``[N, n]`` with n in :data:`SIZES`, on an NVIDIA build."""
    return (D.is_cuda and torch.version.hip is None and D.dim() == 2 and D.dtype == torch.float64
            and D.shape[-1] in SIZES)


def kernel(n: int, device: torch.device):
    """The compiled kernel for size n on ``device``, or None once a compilation has failed."""
    return KERNELS.get((n, device.index), device, source(n), "gdnviz_bisect")


def bisect(D: torch.Tensor, E: torch.Tensor, steps: int = STEPS, skip: torch.Tensor | None = None) -> torch.Tensor:
    """Ascending eigenvalues ``[N, n]`` of the tridiagonals (D, E) after ``steps`` halvings, the tridiagonals with a
    nonzero ``skip`` entry skipped (module docstring)."""
    if not supports(D) or E.shape != D.shape or E.dtype != D.dtype or E.device != D.device:
        raise ValueError(f"bisect takes float64 CUDA D, E [N, n] with n in {SIZES}; got {D.dtype} {tuple(D.shape)} "
                         f"and {E.dtype} {tuple(E.shape)} on {D.device}")
    N, n = D.shape
    k = kernel(n, D.device)
    if k is None:
        raise RuntimeError(f"the CUDA bisection kernel is unavailable: {KERNELS.reason}")
    W = torch.empty_like(D)
    tail = skip_args(skip, N, W)
    if N:
        with torch.cuda.device(D.device):
            k(grid=(N, 1, 1), block=(n, 1, 1), args=[D.contiguous(), E.contiguous(), W, int(steps), *tail])
    return W
