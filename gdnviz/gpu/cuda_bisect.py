"""All eigenvalues of many symmetric tridiagonal float64 matrices by bisection on Sturm counts, in a CUDA kernel
compiled at run time with NVRTC — the second half of ``gdnviz.gpu.symeig.eigvalsh_tridiag`` (after the
tridiagonalisation of ``gdnviz.gpu.cuda_tridiag``).

``bisect(D, E, steps)`` for float64 CUDA ``D, E [N, n]`` (diagonal; subdiagonal ``E[:, i] = T[i+1, i]``, ``E[:, n-1]``
ignored) returns the eigenvalues ``W [N, n]`` ascending. The algorithm of ``symeig._bisect_kernel`` (the Triton
kernel): the Gershgorin interval widened by 1e-12 of its span, then ``steps`` halvings for the j-th smallest
eigenvalue by thread j, each counting the negative pivots of the LDLᵀ factorisation of T − x·I (pivots smaller
than ``pivmin = 1e-300 + 4.9e-32·max_i(|d_i| + |e_i|)`` replaced by −pivmin). Absolute accuracy ≈ ε_f64·‖T‖; the
halvings beyond ~53 resolve the small eigenvalues of graded matrices to a relative accuracy the tests rely on (a
stop at a bracket of 5.5e-17 of the span failed them on the H200, ninth session).

Layout: one block of n threads per matrix, D and e² in shared memory (2 KB for n = 128, so up to 16 blocks per SM),
every thread reading the same entry at each step (a broadcast). Why: the Triton kernel re-reads D and E from global
memory at every Sturm step of every lane; on an H200 it took 53 ms of a 16K capture's 345 ms of GPU time (sixth
session's profile). Measured: bench/RESULTS.md (``bench/bench_spectra.py --candidates`` times both in one run).

Two forms of the Sturm count (``FORMS``; ``GDNVIZ_CUDA_BISECT=ldl`` or ``=det`` picks one): the LDLᵀ pivots above
(one float64 division per step) and, the default, the signs of the leading principal minors (``SOURCE_DET``: no
division, the same backward error; its comment says how the minors stay in range). Measured on an H200
(``bench/bench_spectra.py --candidates``, eleventh session, 18,432 tridiagonals of a 16K capture): 11.6 ms for the
minors against 24.1 ms for the pivots (Triton: 30.2 ms), eigenvalues equal to 4.4e-16 of each matrix's largest.

Status: used by ``symeig.eigvalsh_tridiag`` on NVIDIA CUDA builds by default (``GDNVIZ_CUDA_BISECT=0`` keeps the
Triton kernel); compiled once per (n, device) on first use; if compilation fails ``KERNELS.available`` is False
and the Triton kernel is used. ``tests/test_cuda_bisect.py`` pins it to float64 ``eigvalsh`` on CPU (its source run
through ``tests.support.cuda_emul``) and to the Triton kernel on CUDA.
"""
from __future__ import annotations

import os

import torch

from gdnviz.gpu.nvrtc import Kernels

# Shared by both forms: the block's tridiagonal in shared memory and the Gershgorin interval widened by 1e-12 of its
# span, with pivmin (every thread computes the same, in the same order).
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

SOURCE = PREAMBLE + r"""
extern "C" __global__ void __launch_bounds__(NN)
gdnviz_bisect(const double* __restrict__ D, const double* __restrict__ E, double* __restrict__ W, int steps)
{
    __shared__ double ds[NN];
    __shared__ double e2s[NN];  // e2s[i] = E[i-1]^2 (e2s[0] = 0): the term the pivot at row i subtracts
    __shared__ double es[NN];
    const int j = threadIdx.x;
    const long long base = (long long)blockIdx.x * NN;
    load_tridiagonal(D, E, base, j, ds, es);
    __syncthreads();
    e2s[j] = (j > 0) ? es[j - 1] * es[j - 1] : 0.0;
    __syncthreads();
    double a, b, scale, pivmin;
    gershgorin(ds, es, a, b, scale, pivmin);
    for (int s = 0; s < steps; ++s) {
        const double mid = 0.5 * (a + b);
        int cnt = 0;
        double q = 1.0;
#pragma unroll 8
        for (int i = 0; i < NN; ++i) {
            q = (ds[i] - mid) - e2s[i] / q;
            q = (fabs(q) < pivmin) ? -pivmin : q;
            cnt += (q < 0.0) ? 1 : 0;
        }
        if (cnt > j) b = mid; else a = mid;  // more than j eigenvalues below mid: the j-th is left of mid
    }
    W[base + j] = 0.5 * (a + b);
}
"""

# The same bisection (interval, halvings, pivmin rule, count) with the Sturm count taken from the signs of the leading
# principal minors p_i = det(T[:i, :i] - x I) instead of the LDL^T pivots q_i = p_i / p_{i-1}: the three-term
# recurrence p_i = (d_i - x) p_{i-1} - e_{i-1}^2 p_{i-2} needs no division (a float64 division is a 10-instruction
# sequence around MUFU.RCP64H with a slow-path branch: ~30 instructions per Sturm step against ~13 here). The pivmin
# rule is the LDL form's, written on the minors: |p_i| < pivmin |p_{i-1}| (|q_i| < pivmin) -> p_i = -pivmin p_{i-1}
# (q_i = -pivmin); a negative pivot is a sign change between p_{i-1} and p_i. In floating point each step is the LDL
# step of T with d_i - x and e_{i-1}^2 perturbed by a few ulps relatively (the same backward error as the LDL form's),
# so the count is exact for a matrix as close to T; the eigenvalues agree with the LDL form's to a few eps*||T||.
# Range: T, x and pivmin are scaled by a power of two sigma >= max_i(|d_i| + |e_i|) (exact), so every pivot lies in
# [pivmin/sigma, 3 + sigma/pivmin] ~ [2^-105, 2^106]; every 4 steps p_i and p_{i-1} are multiplied by 2^-exponent(p_i)
# (exact), which keeps 4 further steps inside float64's range (2^-1022 .. 2^1023) with a margin of 2^400.
SOURCE_DET = PREAMBLE + r"""
extern "C" __global__ void __launch_bounds__(NN)
gdnviz_bisect(const double* __restrict__ D, const double* __restrict__ E, double* __restrict__ W, int steps)
{
    __shared__ double ds[NN];
    __shared__ double es[NN];
    __shared__ double2 de[NN];  // (d_i / sigma, e_{i-1}^2 / sigma^2), e_{-1} = 0
    const int j = threadIdx.x;
    const long long base = (long long)blockIdx.x * NN;
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

SIZES = (64, 128)
FORMS = ("ldl", "det")  # SOURCE (LDL^T pivots, divisions) and SOURCE_DET (signs of the leading minors)
KERNELS = Kernels()  # KERNELS.available / KERNELS.reason
DEFAULT_ON = True
DEFAULT_FORM = "det"  # H200, eleventh session: 11.6 ms vs 24.1 ms (ldl) for 18,432 tridiagonals of 128


def default_form() -> str:
    """``GDNVIZ_CUDA_BISECT=ldl`` or ``=det`` picks the Sturm count's form, else ``DEFAULT_FORM``."""
    env = os.environ.get("GDNVIZ_CUDA_BISECT", "").strip()
    return env if env in FORMS else DEFAULT_FORM


def source(n: int, form: str | None = None) -> str:
    form = form or default_form()
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    return (SOURCE_DET if form == "det" else SOURCE) % {"N": n}


def enabled() -> bool:
    """On unless ``GDNVIZ_CUDA_BISECT=0``, while compilation has not failed, on NVIDIA builds."""
    return KERNELS.switched_on("GDNVIZ_CUDA_BISECT", DEFAULT_ON)


def supports(D: torch.Tensor) -> bool:
    """float64 CUDA ``[N, n]`` with n in SIZES."""
    return D.is_cuda and D.dim() == 2 and D.dtype == torch.float64 and D.shape[-1] in SIZES


def _kernel(n: int, device: torch.device, form: str | None = None):
    form = form or default_form()
    return KERNELS.get((n, form, device.index), device, source(n, form), "gdnviz_bisect")


def bisect(D: torch.Tensor, E: torch.Tensor, steps: int, form: str | None = None) -> torch.Tensor:
    """Ascending eigenvalues ``[N, n]`` of the tridiagonals (D, E) (module docstring) by the Sturm counts of ``form``
    (None: :func:`default_form`); RuntimeError if the kernel is unavailable."""
    if not supports(D) or E.shape != D.shape or E.dtype != D.dtype or E.device != D.device:
        raise ValueError(f"bisect takes float64 CUDA D, E [N, n] with n in {SIZES}; got {D.dtype} {tuple(D.shape)} "
                         f"and {E.dtype} {tuple(E.shape)} on {D.device}")
    N, n = D.shape
    k = _kernel(n, D.device, form)
    if k is None:
        raise RuntimeError(f"the CUDA bisection kernel is unavailable: {KERNELS.reason}")
    W = torch.empty_like(D)
    if N:
        with torch.cuda.device(D.device):
            k(grid=(N, 1, 1), block=(n, 1, 1), args=[D.contiguous(), E.contiguous(), W, int(steps)])
    return W
