"""Float64 Gram matrices of many head states on CUDA, skipping the ones a caller does not need, compiled at run time
with NVRTC: the fast path of ``gdnviz.gpu.symeig.finite_gram``.

``gram(X, skip=None)``: float32 / float64 CUDA states ``X [N, K, V]``, K and V in :data:`DIMS` → ``(G [N, n, n]
float64, bad [N] bool)``, n = min(K, V): ``G = X Xᵀ`` if K ≤ V, else ``Xᵀ X``, each entry a chain of fused
multiply-adds over the inner index in ascending order, so ``G`` is exactly symmetric (``fma(a, b, c)`` is
``fma(b, a, c)``) and, for float32 states, every product is exact. ``bad``: G has a non-finite entry (a NaN/inf state
entry, or a float64 state whose Gram matrix overflows); such a G is written as zeros. ``skip`` (an integer or bool
``[N]`` on X's device, nonzero = skipped): those blocks write ``bad = False`` and return before any work, leaving
their rows of ``G`` unwritten (uninitialised memory: callers must not read them). The other rows are the same bits
as without ``skip``. Asynchronous (no host sync). ValueError for any other input; RuntimeError if the kernel cannot be
compiled (``KERNELS.reason``). Compiled once per (K, V, dtype, device) on first use (call outside a CUDA-graph
capture). The reference is ``symeig.gram`` (float64 torch); design notes: docs/kernels-spectra.md.
"""
from __future__ import annotations

import torch

from gdnviz.gpu.cuda_tridiag import skip_args
from gdnviz.gpu.nvrtc import Kernels

DIMS = (64, 128)
CTYPES = {torch.float32: "float", torch.float64: "double"}
THREADS = 256
KERNELS = Kernels()  # KERNELS.available / KERNELS.reason

# One block of 256 threads per state. The state goes to shared memory in its own dtype as XS[k][i] (k the inner
# index, i the output index; rows padded by 16 bytes so that they stay 16-byte aligned), then thread (ti, tj) =
# (t / 16, t % 16) accumulates the TS x TS tile G[ti TS + p][tj TS + q] (TS = n / 16) in registers: per k it loads TS
# entries of row k for its rows and TS for its columns, converts them to double and does TS^2 fused multiply-adds.
# Entry (i, j) and entry (j, i) see the same operands in the same order, so G is symmetric bit for bit. A non-finite
# entry anywhere sets a shared flag; the block then writes zeros.
SOURCE = r"""
#define NN %(N)d
#define MM %(M)d
#define TRANS %(TRANS)d
#define T %(T)s
#define TS (NN / 16)
#define LD (NN + 16 / (int)sizeof(T))

__device__ __forceinline__ bool finite64(double x) { return fabs(x) <= 1.7976931348623157e308; }

extern "C" __global__ void __launch_bounds__(256, 1)
gdnviz_gram(const T* __restrict__ X, double* __restrict__ G, int* __restrict__ BAD, const int* SKIP, int skip_on)
{
    const int t = threadIdx.x;
    if (skip_on && SKIP[blockIdx.x] != 0) {
        if (t == 0) BAD[blockIdx.x] = 0;
        return;
    }
    extern __shared__ __align__(16) T xs[];
    __shared__ int badflag;
    const long long xbase = (long long)blockIdx.x * NN * MM;
    if (t == 0) badflag = 0;
    for (int e = t; e < NN * MM; e += 256) {
#if TRANS
        const int k = e / NN, i = e %% NN;   // X is [MM][NN]: G = X^T X
#else
        const int i = e / MM, k = e %% MM;   // X is [NN][MM]: G = X X^T
#endif
        xs[k * LD + i] = X[xbase + e];
    }
    __syncthreads();
    const int ti = t >> 4, tj = t & 15;
    double acc[TS][TS];
#pragma unroll
    for (int p = 0; p < TS; ++p)
#pragma unroll
        for (int q = 0; q < TS; ++q) acc[p][q] = 0.0;
    for (int k = 0; k < MM; ++k) {
        const T* row = xs + k * LD;
        double a[TS], b[TS];
#pragma unroll
        for (int p = 0; p < TS; ++p) a[p] = (double)row[ti * TS + p];
#pragma unroll
        for (int q = 0; q < TS; ++q) b[q] = (double)row[tj * TS + q];
#pragma unroll
        for (int p = 0; p < TS; ++p)
#pragma unroll
            for (int q = 0; q < TS; ++q) acc[p][q] = fma(a[p], b[q], acc[p][q]);
    }
    bool ok = true;
#pragma unroll
    for (int p = 0; p < TS; ++p)
#pragma unroll
        for (int q = 0; q < TS; ++q) ok = ok && finite64(acc[p][q]);
    if (!ok) badflag = 1;
    __syncthreads();
    const bool bad = badflag != 0;
    const long long gbase = (long long)blockIdx.x * NN * NN;
#pragma unroll
    for (int p = 0; p < TS; ++p)
#pragma unroll
        for (int q = 0; q < TS; ++q)
            G[gbase + (long long)(ti * TS + p) * NN + tj * TS + q] = bad ? 0.0 : acc[p][q];
    if (t == 0) BAD[blockIdx.x] = bad ? 1 : 0;
}
"""


def source(K: int, V: int, ctype: str) -> str:
    """The kernel's CUDA source (entry ``gdnviz_gram``, :data:`THREADS` threads per block) for ``[K, V]`` states of
    C type ``ctype`` ("float" or "double")."""
    return SOURCE % {"N": min(K, V), "M": max(K, V), "TRANS": int(K > V), "T": ctype}


def smem_bytes(K: int, V: int, ctype: str) -> int:
    """Dynamic shared memory of a block: the state, rows padded by 16 bytes."""
    size = 4 if ctype == "float" else 8
    return max(K, V) * (min(K, V) + 16 // size) * size


def supports(X: torch.Tensor) -> bool:
    """float32 / float64 CUDA ``[N, K, V]`` with K and V in :data:`DIMS`, on an NVIDIA build."""
    return (X.is_cuda and torch.version.hip is None and X.dim() == 3 and X.dtype in CTYPES
            and X.shape[-2] in DIMS and X.shape[-1] in DIMS)


def kernel(K: int, V: int, ctype: str, device: torch.device):
    """The compiled kernel for ``[K, V]`` states of ``ctype`` on ``device``, or None once a compilation failed."""
    return KERNELS.get((K, V, ctype, device.index), device, source(K, V, ctype), "gdnviz_gram",
                       shared_mem=smem_bytes(K, V, ctype))


def gram(X: torch.Tensor, skip: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G [N, n, n] float64, bad [N] bool)`` of float32 / float64 CUDA states ``X [N, K, V]`` (module
    docstring)."""
    if not supports(X):
        raise ValueError(f"cuda_gram.gram takes float32 / float64 CUDA [N, K, V] with K, V in {DIMS}; got "
                         f"{X.dtype} {tuple(X.shape)} on {X.device}")
    N, K, V = X.shape
    ctype = CTYPES[X.dtype]
    k = kernel(K, V, ctype, X.device)
    if k is None:
        raise RuntimeError(f"the CUDA Gram kernel is unavailable: {KERNELS.reason}")
    n = min(K, V)
    X = X.contiguous()
    G = torch.empty(N, n, n, dtype=torch.float64, device=X.device)
    bad = torch.empty(N, dtype=torch.int32, device=X.device)
    tail = skip_args(skip, N, bad)
    if N:
        with torch.cuda.device(X.device):
            k(grid=(N, 1, 1), block=(THREADS, 1, 1), args=[X, G, bad, *tail], shared_mem=smem_bytes(K, V, ctype))
    return G, bad.bool()
