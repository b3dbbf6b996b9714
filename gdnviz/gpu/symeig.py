"""Batched singular values of many small head states on the GPU: one program (thread block) per state.

``svdvals(states)`` for ``states [N, K, V]`` returns the singular values ``[N, min(K, V)]`` (float64, descending)
computed as the square roots of the eigenvalues of the float64 Gram matrix G = S Sᵀ (or SᵀS, the smaller side):

1. G is formed in float64 (products of float32 entries are exact in float64);
2. a first kernel reduces each G to tridiagonal form with Householder reflections: for n ∈ {64, 128} on NVIDIA
   builds the NVRTC-compiled CUDA kernel ``gdnviz.gpu.cuda_tridiag`` (one thread block per matrix, the matrix in
   its threads' registers in 32-row × 64-column warp tiles; 6.7× faster than the Triton kernel on an H200, the same
   reflections; ``GDNVIZ_CUDA_TRIDIAG=0`` turns it off), otherwise — or if its compilation fails — a Triton kernel,
   one program per matrix with the whole n×n tile in registers (n ≤ 128);
3. a second kernel finds all eigenvalues of many tridiagonals at once by bisection on Sturm counts, one lane
   per (matrix, eigenvalue index), 64 halvings of the Gershgorin interval (absolute accuracy ≈ ε_f64·‖G‖): the
   CUDA kernel ``gdnviz.gpu.cuda_bisect`` (the tridiagonal in shared memory, Sturm counts from the signs of the
   leading minors, no division; ``GDNVIZ_CUDA_BISECT=0`` turns it off) for n ∈ {64, 128} on NVIDIA builds, otherwise a
   Triton kernel (Sturm counts from the LDLᵀ pivots).

Why: ``torch.linalg.svdvals`` / ``eigvalsh`` on CUDA loop over the batch for n > 32 (about 1–5 ms per 128×128
matrix), which is the whole budget of a capture. The reference is ``torch.linalg.svdvals`` in float64; the
accuracy on σ is ≈ sqrt(ε_f64)·σ_max ≈ 1.5e-8·σ_max absolute for the smallest values — far below the numerical
rank threshold σ_max·128·ε_f32 ≈ 1.5e-5·σ_max — and ≈ 1e-15 relative for the large ones.

CPU tensors run the Triton kernels under ``TRITON_INTERPRET=1`` only in tests; the library's CPU path is
``torch.linalg.svdvals``.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None

BISECT_STEPS = 64

if triton is not None:

    @triton.jit
    def _tridiag_kernel(G, D, E, N: tl.constexpr):
        """Householder reduction of one symmetric n×n matrix (held in registers) to tridiagonal (D, E)."""
        pid = tl.program_id(0).to(tl.int64)
        rows = tl.arange(0, N)
        cols = tl.arange(0, N)
        A = tl.load(G + pid * N * N + rows[:, None] * N + cols[None, :])
        for k in range(0, N - 2):
            col = tl.sum(tl.where(cols[None, :] == k, A, 0.0), axis=1)  # column k (A is symmetric)
            x = tl.where(rows > k, col, 0.0)
            xk1 = tl.sum(tl.where(rows == k + 1, x, 0.0), axis=0)
            nrm = tl.sqrt(tl.sum(x * x, axis=0))
            alpha = tl.where(xk1 >= 0, -nrm, nrm)
            v = x - tl.where(rows == k + 1, alpha, 0.0)
            vn2 = tl.sum(v * v, axis=0)
            u = tl.where(vn2 > 0, v / tl.sqrt(tl.where(vn2 > 0, vn2, 1.0)), 0.0)
            p = tl.sum(A * u[None, :], axis=1)
            kk = tl.sum(u * p, axis=0)
            q = p - kk * u
            A = A - 2.0 * (u[:, None] * q[None, :] + q[:, None] * u[None, :])
        d = tl.sum(tl.where(rows[:, None] == cols[None, :], A, 0.0), axis=1)
        e = tl.sum(tl.where(rows[:, None] == cols[None, :] + 1, A, 0.0), axis=0)  # e[i] = A[i+1, i]
        e = tl.where(cols < N - 1, e, 0.0)
        tl.store(D + pid * N + rows, d)
        tl.store(E + pid * N + cols, e)

    @triton.jit
    def _bisect_kernel(D, E, W, M, N: tl.constexpr, BM: tl.constexpr, STEPS: tl.constexpr):
        """All eigenvalues of BM tridiagonal matrices at once: lanes (matrix, index j) bisect for the j-th
        smallest eigenvalue with Sturm counts (LDLᵀ pivots of T − x·I)."""
        pid = tl.program_id(0).to(tl.int64)
        mats = pid * BM + tl.arange(0, BM)
        ok = mats < M
        j = tl.arange(0, N)
        base = mats * N
        lo = tl.zeros([BM], dtype=tl.float64) + 1e300
        hi = tl.zeros([BM], dtype=tl.float64) - 1e300
        scale = tl.zeros([BM], dtype=tl.float64)
        e_prev = tl.zeros([BM], dtype=tl.float64)
        for i in range(0, N):
            di = tl.load(D + base + i, mask=ok, other=0.0)
            ei = tl.load(E + base + i, mask=ok, other=0.0)
            rad = tl.abs(ei) + tl.abs(e_prev)
            lo = tl.minimum(lo, di - rad)
            hi = tl.maximum(hi, di + rad)
            scale = tl.maximum(scale, tl.abs(di) + tl.abs(ei))
            e_prev = ei
        span = tl.maximum(hi - lo, 1e-300)
        lo = lo - 1e-12 * span
        hi = hi + 1e-12 * span
        pivmin = 1e-300 + 4.9e-32 * scale
        a = tl.zeros([BM, N], dtype=tl.float64) + lo[:, None]
        b = tl.zeros([BM, N], dtype=tl.float64) + hi[:, None]
        target = (tl.zeros([BM, N], dtype=tl.float64) + j[None, :].to(tl.float64))
        for _ in range(STEPS):
            mid = 0.5 * (a + b)
            cnt = tl.zeros([BM, N], dtype=tl.float64)
            qv = tl.zeros([BM, N], dtype=tl.float64) + 1.0
            e2 = tl.zeros([BM], dtype=tl.float64)
            for i in range(0, N):
                di = tl.load(D + base + i, mask=ok, other=0.0)
                qv = di[:, None] - mid - e2[:, None] / qv
                qv = tl.where(tl.abs(qv) < pivmin[:, None], -pivmin[:, None], qv)
                cnt += tl.where(qv < 0, 1.0, 0.0)
                ei = tl.load(E + base + i, mask=ok, other=0.0)
                e2 = ei * ei
            go_left = cnt > target  # more than j eigenvalues below mid: the j-th is left of mid
            b = tl.where(go_left, mid, b)
            a = tl.where(go_left, a, mid)
        tl.store(W + base[:, None] + j[None, :], 0.5 * (a + b), mask=ok[:, None])


def _next_pow2(n: int) -> int:
    return 1 << (int(n) - 1).bit_length()


def gram(states: torch.Tensor) -> torch.Tensor:
    """[N, n, n] float64 Gram matrix on the smaller side of each state (n = min(K, V))."""
    s = states.double()
    K, V = s.shape[-2:]
    return s @ s.transpose(-1, -2) if K <= V else s.transpose(-1, -2) @ s


def eigvalsh_tridiag(G: torch.Tensor) -> torch.Tensor:
    """Ascending eigenvalues [N, n] of symmetric float64 matrices [N, n, n] (Triton, one program each)."""
    if triton is None:  # pragma: no cover
        raise RuntimeError("triton is not available")
    N, n, _ = G.shape
    P = _next_pow2(max(n, 2))
    if P != n:  # pad with an identity block far below the spectrum, then drop those eigenvalues
        big = G.abs().amax(dim=(-1, -2), keepdim=True) * 4 + 1
        Gp = torch.zeros(N, P, P, dtype=torch.float64, device=G.device)
        Gp[:, :n, :n] = G
        idx = torch.arange(n, P, device=G.device)
        Gp[:, idx, idx] = -big[:, 0]
        w = eigvalsh_tridiag(Gp)
        return w[:, P - n:]
    G = G.contiguous()
    D = torch.empty(N, n, dtype=torch.float64, device=G.device)
    E = torch.empty_like(D)
    W = torch.empty_like(D)
    from gdnviz.gpu import cuda_tridiag  # default on NVIDIA builds (GDNVIZ_CUDA_TRIDIAG=0: off): the same reflections

    cuda_ok = N and cuda_tridiag.enabled() and cuda_tridiag.supports(G) and cuda_tridiag._kernel(n, G.device)
    if cuda_ok:
        D, E = cuda_tridiag.tridiag(G)
    elif N:
        _tridiag_kernel[(N,)](G, D, E, N=n, num_warps=16 if n >= 128 else 4)
    from gdnviz.gpu import cuda_bisect  # default on NVIDIA builds (GDNVIZ_CUDA_BISECT=0: off): the same bisection

    if N and cuda_bisect.enabled() and cuda_bisect.supports(D) and cuda_bisect._kernel(n, D.device):
        W = cuda_bisect.bisect(D, E, BISECT_STEPS)
    elif N:
        bm = max(1, 512 // n)
        _bisect_kernel[(triton.cdiv(N, bm),)](D, E, W, N, N=n, BM=bm, STEPS=BISECT_STEPS, num_warps=4)
    return W


def eigvalsh(G: torch.Tensor) -> torch.Tensor:
    """Ascending eigenvalues ``[N, n]`` of symmetric float64 ``G [N, n, n]`` on its device without a host sync: the
    batched kernels of :func:`eigvalsh_tridiag` on CUDA (``torch.linalg.eigvalsh`` loops over the batch there),
    LAPACK through ``torch.linalg.eigvalsh`` elsewhere (which raises on NaN/inf: see :func:`finite_symmetric`)."""
    return eigvalsh_tridiag(G) if G.is_cuda else torch.linalg.eigvalsh(G)


def finite_symmetric(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(0.5 (A + Aᵀ), bad)`` for ``A [N, n, n]``, the matrices with a NaN/inf entry (``bad [N]``, bool) replaced by
    zeros, so that :func:`eigvalsh` can take them; their eigenvalues are then replaced by NaN. No host sync."""
    A = 0.5 * (A + A.transpose(-1, -2))
    bad = ~torch.isfinite(A).all(dim=-1).all(dim=-1)
    return torch.where(bad[:, None, None], torch.zeros((), dtype=A.dtype, device=A.device), A), bad


def svdvals(states: torch.Tensor) -> torch.Tensor:
    """Singular values [N, min(K, V)] float64, descending, of states [N, K, V] (see module docstring)."""
    lam = eigvalsh_tridiag(gram(states))
    return lam.clamp_min(0).sqrt().flip(-1)
