"""Batched symmetric eigendecomposition of 32×32 float64 matrices, one warp per matrix, in a CUDA kernel compiled at
run time with NVRTC — the Rayleigh–Ritz step of ``gdnviz.truncate`` (``_eigh_small``) without Triton.

``eigh32(T)`` for float64 CUDA ``T [N, 32, 32]`` (lower triangle read, like ``torch.linalg.eigh``) returns
``(eigenvalues [N, 32] ascending, eigenvectors [N, 32, 32] as columns)``, the contract of
``gdnviz.gpu.jacobi.eigh_jacobi``, with the same algorithm and constants: cyclic parallel (round-robin) Jacobi,
symmetric Schur rotations with ``a_pq`` taken as the mean of both triangles (both members of a pair compute the same
rotation), rotations skipped when ``|a_pq| ≤ 2⁻⁵³·sqrt(|a_pp|)·sqrt(|a_qq|)``, Rutishauser's exact diagonal update,
and the stop test once per sweep (``off(A) ≤ 1e-15·‖A‖_F``, or a sweep without rotations, or ``MAX_SWEEPS``);
ascending order, ties by index.

Layout: ``A`` and ``V`` in shared memory (rows padded to 33 doubles: no bank conflicts by row or by column), the
diagonal and each round's rotations (c, σ, partner) in small shared arrays; lane i owns index i. A round is three
lane-private passes — columns (lane r rewrites row r of ``A J``), rows (lane c rewrites column c of ``Jᵀ A``), ``V J``
(lane r, row r of V) — each reading only what its lane writes, so the passes need a ``__syncwarp`` between them and
no block barrier. The Triton kernel does the same work as whole-tile operations whose reductions and gathers cross
warps; measured on an H200 at ~300 µs for 16 matrices (random SPD, 7–8 sweeps; bench/RESULTS.md, fifth session) —
the largest single item of a truncation.

Status: **not measured on a GPU yet** (written when the session's device time had run out); off unless
``GDNVIZ_CUDA_JACOBI=1``. ``bench/bench_cholqr.py`` times it (``jacobi_32_cuda``) and ``tests/test_cuda_jacobi.py``
pins it to ``torch.linalg.eigh`` on CUDA; on CPU the source is only compiled (where an NVRTC library is found).
If compilation fails, ``KERNELS.available`` is False (reason in ``KERNELS.reason``) and the Triton kernel stays.
"""
from __future__ import annotations

import os

import torch

from gdnviz.gpu.nvrtc import Kernels

N = 32
MAX_SWEEPS = 24  # gdnviz.gpu.jacobi.MAX_SWEEPS
TOL = 1e-15  # gdnviz.gpu.jacobi.TOL
SKIP = 2.0**-53  # gdnviz.gpu.jacobi._SKIP

SOURCE = r"""
#define NN 32
#define NP 33
extern "C" __global__ void __launch_bounds__(32)
gdnviz_jacobi32(const double* __restrict__ T, double* __restrict__ W, double* __restrict__ VEC,
                int* __restrict__ SW, int max_sweeps, double tol2, double skip)
{
    __shared__ double A[NN][NP];
    __shared__ double V[NN][NP];
    __shared__ double d[NN];
    __shared__ double cc[NN];
    __shared__ double sg[NN];
    __shared__ int pp[NN];
    __shared__ int rk[NN];
    const unsigned full = 0xffffffffu;
    const int i = threadIdx.x;
    const long long base = (long long)blockIdx.x * NN * NN;
    // row i of the lower-triangle-mirrored input; V = I
    for (int c = 0; c < NN; ++c) {
        A[i][c] = (c <= i) ? T[base + i * NN + c] : T[base + c * NN + i];
        V[i][c] = (c == i) ? 1.0 : 0.0;
    }
    __syncwarp();
    double fro = 0.0, off = 0.0;
    for (int c = 0; c < NN; ++c) {
        const double a = A[i][c];
        fro += a * a;
        if (c != i) off += a * a;
    }
    for (int o = 16; o > 0; o >>= 1) {
        fro += __shfl_xor_sync(full, fro, o);
        off += __shfl_xor_sync(full, off, o);
    }
    fro = __shfl_sync(full, fro, 0);  // every lane the same value (the butterfly already gives it; made explicit)
    off = __shfl_sync(full, off, 0);
    const double thresh = tol2 * fro;
    d[i] = A[i][i];
    __syncwarp();
    int sweep = 0;
    bool any = true;
    while (sweep < max_sweeps && off > thresh && any) {
        bool rotated = false;
        for (int k = 0; k < NN - 1; ++k) {
            // round-robin partner of index i
            const int j = (2 * k - i + (NN - 1)) % (NN - 1);
            const int pr = (i == NN - 1) ? k : ((j == i) ? NN - 1 : j);
            const double a_ip = A[i][pr], a_pi = A[pr][i];
            const double di = d[i], dpr = d[pr];
            const bool is_p = i < pr;
            const double app = is_p ? di : dpr, aqq = is_p ? dpr : di;
            const double apq = 0.5 * (a_ip + a_pi);
            const bool rot = fabs(apq) > skip * (sqrt(fabs(app)) * sqrt(fabs(aqq)));
            const double tau = (aqq - app) / (2.0 * (rot ? apq : 1.0));
            double t = 1.0 / (fabs(tau) + sqrt(1.0 + tau * tau));
            t = rot ? ((tau < 0.0) ? -t : t) : 0.0;
            const double c = 1.0 / sqrt(1.0 + t * t);
            const double s = t * c;
            rotated = rotated || rot;
            __syncwarp();  // every lane has read d and A before anything changes
            cc[i] = c;
            sg[i] = is_p ? -s : s;
            pp[i] = pr;
            d[i] = is_p ? app - t * apq : aqq + t * apq;
            __syncwarp();
            // A <- A J: lane i rewrites row i (x_c <- c_c x_c + s_c x_partner(c))
            double row[NN];
#pragma unroll
            for (int c2 = 0; c2 < NN; ++c2) row[c2] = cc[c2] * A[i][c2] + sg[c2] * A[i][pp[c2]];
#pragma unroll
            for (int c2 = 0; c2 < NN; ++c2) A[i][c2] = row[c2];
            __syncwarp();
            // A <- J^T A: lane i rewrites column i
#pragma unroll
            for (int r = 0; r < NN; ++r) row[r] = cc[r] * A[r][i] + sg[r] * A[pp[r]][i];
#pragma unroll
            for (int r = 0; r < NN; ++r) A[r][i] = row[r];
            // V <- V J: lane i rewrites row i of V
#pragma unroll
            for (int c2 = 0; c2 < NN; ++c2) row[c2] = cc[c2] * V[i][c2] + sg[c2] * V[i][pp[c2]];
#pragma unroll
            for (int c2 = 0; c2 < NN; ++c2) V[i][c2] = row[c2];
            __syncwarp();
            // the rotated 2x2 blocks are diagonal now: set them exactly (lane i: row i)
            A[i][i] = d[i];
            if (rot) A[i][pr] = 0.0;
            __syncwarp();
        }
        off = 0.0;
        for (int c = 0; c < NN; ++c)
            if (c != i) off += A[i][c] * A[i][c];
        for (int o = 16; o > 0; o >>= 1) off += __shfl_xor_sync(full, off, o);
        off = __shfl_sync(full, off, 0);  // the loop condition must be warp-uniform
        any = __any_sync(full, rotated);
        ++sweep;
    }
    // ascending order, ties by index
    const double di = d[i];
    int rank = 0;
    for (int j = 0; j < NN; ++j) {
        const double dj = d[j];
        rank += (dj < di || (dj == di && j < i)) ? 1 : 0;
    }
    rk[i] = rank;
    __syncwarp();
    W[(long long)blockIdx.x * NN + rank] = di;
    for (int c = 0; c < NN; ++c) VEC[base + i * NN + rk[c]] = V[i][c];
    if (i == 0) SW[blockIdx.x] = sweep;
}
"""

KERNELS = Kernels()  # KERNELS.available / KERNELS.reason: whether compilation worked, and why not


def enabled() -> bool:
    """``GDNVIZ_CUDA_JACOBI=1`` (off by default: not yet measured), compiled, and an NVIDIA build (32-lane warps)."""
    return os.environ.get("GDNVIZ_CUDA_JACOBI", "").strip() == "1" and KERNELS.usable()


def supports(T: torch.Tensor) -> bool:
    """float64 CUDA ``[..., 32, 32]``."""
    return T.is_cuda and T.dim() >= 2 and T.shape[-1] == N and T.shape[-2] == N and T.dtype == torch.float64


def _kernel(device: torch.device):
    return KERNELS.get(device.index, device, SOURCE, "gdnviz_jacobi32")


def eigh32(T: torch.Tensor, sweeps: int | None = None, *, return_sweeps: bool = False):
    """``(eigenvalues ascending [..., 32], eigenvectors [..., 32, 32])`` of float64 CUDA ``T [..., 32, 32]`` (lower
    triangle read), plus the sweeps used per matrix (int32) with ``return_sweeps``. RuntimeError if unavailable."""
    if not supports(T):
        raise ValueError(f"eigh32 takes float64 CUDA [..., {N}, {N}]; got {T.dtype} {tuple(T.shape)} on {T.device}")
    k = _kernel(T.device)
    if k is None:
        raise RuntimeError(f"the CUDA Jacobi kernel is unavailable: {KERNELS.reason}")
    batch = T.shape[:-2]
    A = T.reshape(-1, N, N).contiguous()
    M = A.shape[0]
    W = torch.empty(M, N, dtype=torch.float64, device=T.device)
    V = torch.empty(M, N, N, dtype=torch.float64, device=T.device)
    SW = torch.empty(M, dtype=torch.int32, device=T.device)
    if M:
        with torch.cuda.device(T.device):
            k(grid=(M, 1, 1), block=(N, 1, 1),
              args=[A, W, V, SW, int(MAX_SWEEPS if sweeps is None else sweeps), float(TOL * TOL), float(SKIP)])
    W, V = W.reshape(*batch, N), V.reshape(*batch, N, N)
    return (W, V, SW.reshape(batch)) if return_sweeps else (W, V)
