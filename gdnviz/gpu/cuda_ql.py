"""All eigenvalues of many symmetric tridiagonal float64 matrices by the implicit QL method with Wilkinson shifts
(eigenvalues only), one thread per matrix, in a CUDA kernel compiled at run time with NVRTC — an alternative to the
bisection of ``gdnviz.gpu.cuda_bisect`` with ~50× less arithmetic (O(n²) rotations per matrix instead of 64
Sturm sweeps per eigenvalue).

``ql_eigvals(D, E)`` for float64 CUDA ``D, E [N, n]`` (diagonal; ``E[:, i] = T[i+1, i]``, ``E[:, n-1]`` ignored)
returns the eigenvalues ``W [N, n]`` ascending. The algorithm is EISPACK's ``tql1`` as written in Numerical Recipes'
``tqli`` without eigenvectors: for each l, find the first negligible off-diagonal ``|e_m| ≤ ε(|d_m| + |d_{m+1}|)``,
and while m > l apply one implicit QL sweep from m − 1 down to l with the Wilkinson shift from the leading 2×2
(``hypot`` for every rotation, so nothing overflows). Backward stable: each eigenvalue within a few ε_f64·‖T‖ (the
bisection's accuracy). A matrix that needs more than ``max_iter`` sweeps for one eigenvalue (never seen on the test
batteries; NaN input is one way) is redone by bisection in the same thread, so the answer never depends on
convergence. Then an insertion sort.

Layout: one warp per block, each lane one matrix, d and e in shared memory (rows of 2n + 1 doubles, so 32 lanes at
the same index hit different banks); 64 KB per block for n = 128, three blocks per SM. Lanes of a warp diverge (each
matrix has its own deflation pattern), which is the price of one matrix per thread.

Status: ``symeig.eigvalsh_tridiag`` uses it when ``GDNVIZ_EIG_QL=1`` (a candidate, timed against the bisection by
``bench/bench_spectra.py --candidates``). ``tests/test_cuda_ql.py`` pins it to float64 ``eigvalsh`` on the CPU
(its source run through ``gdnviz.gpu.cuda_emul``), with the bisection fallback forced too, and to the bisection on
CUDA.
"""
from __future__ import annotations

import os

import torch

from gdnviz.gpu.nvrtc import Kernels

SOURCE = r"""
#define NN %(N)d
#define STRIDE (2 * NN + 1)
#define EPS 2.220446049250313e-16
extern "C" __global__ void __launch_bounds__(32)
gdnviz_ql(const double* __restrict__ Dg, const double* __restrict__ Eg, double* __restrict__ W, int nmat,
          int max_iter, int bisect_steps)
{
    extern __shared__ double sm[];
    const int lane = threadIdx.x;
    const long long mat = (long long)blockIdx.x * 32 + lane;
    if (mat >= nmat) return;  // no barrier below: lanes are independent
    double* d = sm + lane * STRIDE;
    double* e = d + NN;
    const long long base = mat * NN;
    for (int i = 0; i < NN; ++i) {
        d[i] = Dg[base + i];
        e[i] = (i < NN - 1) ? Eg[base + i] : 0.0;
    }
    bool failed = false;
    for (int l = 0; l < NN && !failed; ++l) {
        int iter = 0;
        int m;
        do {
            for (m = l; m < NN - 1; ++m) {
                const double dd = fabs(d[m]) + fabs(d[m + 1]);
                if (fabs(e[m]) <= EPS * dd) break;
            }
            if (m != l) {
                if (iter++ >= max_iter) { failed = true; break; }
                double g = (d[l + 1] - d[l]) / (2.0 * e[l]);
                double r = hypot(g, 1.0);
                g = d[m] - d[l] + e[l] / (g + (g >= 0.0 ? fabs(r) : -fabs(r)));
                double s = 1.0, c = 1.0, p = 0.0;
                int i;
                for (i = m - 1; i >= l; --i) {
                    double f = s * e[i];
                    const double b = c * e[i];
                    r = hypot(f, g);
                    e[i + 1] = r;
                    if (r == 0.0) {  // underflow: recover and restart this l
                        d[i + 1] -= p;
                        e[m] = 0.0;
                        break;
                    }
                    s = f / r;
                    c = g / r;
                    g = d[i + 1] - p;
                    r = (d[i] - g) * s + 2.0 * c * b;
                    p = s * r;
                    d[i + 1] = g + p;
                    g = c * r - b;
                }
                if (r == 0.0 && i >= l) continue;
                d[l] -= p;
                e[l] = g;
                e[m] = 0.0;
            }
        } while (m != l);
    }
    if (failed || !(d[0] == d[0])) {  // no convergence (or NaN): bisection on Sturm counts, as cuda_bisect does
        for (int i = 0; i < NN; ++i) {
            d[i] = Dg[base + i];
            e[i] = (i < NN - 1) ? Eg[base + i] : 0.0;
        }
        double lo = 1e300, hi = -1e300, scale = 0.0, e_prev = 0.0;
        for (int i = 0; i < NN; ++i) {
            const double rad = fabs(e[i]) + fabs(e_prev);
            lo = fmin(lo, d[i] - rad);
            hi = fmax(hi, d[i] + rad);
            scale = fmax(scale, fabs(d[i]) + fabs(e[i]));
            e_prev = e[i];
        }
        const double span = fmax(hi - lo, 1e-300);
        const double pivmin = 1e-300 + 4.9e-32 * scale;
        for (int j = 0; j < NN; ++j) {
            double a = lo - 1e-12 * span, b = hi + 1e-12 * span;
            for (int st = 0; st < bisect_steps; ++st) {
                const double mid = 0.5 * (a + b);
                int cnt = 0;
                double q = 1.0;
                for (int i = 0; i < NN; ++i) {
                    const double e2 = (i > 0) ? e[i - 1] * e[i - 1] : 0.0;
                    q = (d[i] - mid) - e2 / q;
                    q = (fabs(q) < pivmin) ? -pivmin : q;
                    cnt += (q < 0.0) ? 1 : 0;
                }
                if (cnt > j) b = mid; else a = mid;
            }
            W[base + j] = 0.5 * (a + b);
        }
        return;
    }
    for (int i = 1; i < NN; ++i) {  // insertion sort, ascending
        const double v = d[i];
        int j = i - 1;
        while (j >= 0 && d[j] > v) { d[j + 1] = d[j]; --j; }
        d[j + 1] = v;
    }
    for (int i = 0; i < NN; ++i) W[base + i] = d[i];
}
"""

SIZES = (64, 128)
MAX_ITER = 30  # sweeps per eigenvalue before the bisection fallback (Numerical Recipes' limit)
KERNELS = Kernels()


def source(n: int) -> str:
    return SOURCE % {"N": n}


def smem_bytes(n: int) -> int:
    """32 lanes × (2n + 1) doubles."""
    return 8 * 32 * (2 * n + 1)


def enabled() -> bool:
    """Off unless ``GDNVIZ_EIG_QL=1`` (a candidate until measured), while compilation has not failed, on NVIDIA."""
    return os.environ.get("GDNVIZ_EIG_QL", "").strip() == "1" and KERNELS.usable()


def supports(D: torch.Tensor) -> bool:
    return D.is_cuda and D.dim() == 2 and D.dtype == torch.float64 and D.shape[-1] in SIZES


def _kernel(n: int, device: torch.device):
    return KERNELS.get((n, device.index), device, source(n), "gdnviz_ql", shared_mem=smem_bytes(n))


def ql_eigvals(D: torch.Tensor, E: torch.Tensor, bisect_steps: int = 64, max_iter: int = MAX_ITER) -> torch.Tensor:
    """Ascending eigenvalues ``[N, n]`` of the tridiagonals (D, E) (module docstring)."""
    if not supports(D) or E.shape != D.shape or E.dtype != D.dtype or E.device != D.device:
        raise ValueError(f"ql_eigvals takes float64 CUDA D, E [N, n] with n in {SIZES}; got {D.dtype} "
                         f"{tuple(D.shape)} and {E.dtype} {tuple(E.shape)} on {D.device}")
    N, n = D.shape
    k = _kernel(n, D.device)
    if k is None:
        raise RuntimeError(f"the CUDA QL kernel is unavailable: {KERNELS.reason}")
    W = torch.empty_like(D)
    if N:
        with torch.cuda.device(D.device):
            k(grid=((N + 31) // 32, 1, 1), block=(32, 1, 1),
              args=[D.contiguous(), E.contiguous(), W, N, int(max_iter), int(bisect_steps)], shared_mem=smem_bytes(n))
    return W
