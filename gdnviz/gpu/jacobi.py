"""Batched symmetric eigendecomposition of many small matrices without a host sync: one Triton program per matrix.

``eigh_jacobi(T)`` for symmetric float64 ``T [..., n, n]`` (n ≤ 64) returns ``(eigenvalues [..., n] ascending,
eigenvectors [..., n, n] as columns)`` like ``torch.linalg.eigh(T)`` (lower triangle read, ``UPLO="L"``), so it is
a drop-in. Why: ``torch.linalg.eigh`` on CUDA checks its ``info`` on the host (``infos.any().item()``), one host
sync per call, which also makes CUDA-graph capture of anything that calls it impossible. This kernel reads nothing
back: no ``.item()``, no data-dependent Python branch, fixed output shapes.

Algorithm (``_jacobi_kernel``): two-sided cyclic Jacobi in the parallel round-robin (tournament) ordering, the whole
matrix ``A`` and the accumulated rotations ``V`` held in registers of one program.

* The matrix is zero-padded to ``P`` = the next power of two ≥ max(n, 2). The padded rows and columns are exactly
  zero, so no rotation ever involves them (their ``a_pq`` is exactly 0): they stay decoupled, the padded diagonal
  stays 0 and ``V`` stays the identity there. The eigenpairs of the original matrix are therefore exactly the
  leading ``n`` diagonal entries and the leading ``n×n`` block of ``V``; only those are sorted and stored, so the
  padding's eigenvalue-0 pairs are never returned.
* A sweep has ``m = P − 1`` rounds. In round ``k`` index ``i < m`` is paired with ``(2k − i) mod m``; the index
  paired with itself (``i = k``) is paired with ``m`` instead. Every pair of indices meets exactly once a sweep, and
  the ``P/2`` pairs of a round are disjoint, so their rotations commute and are applied at once:
  ``A ← Jᵀ A J`` (columns, then rows) and ``V ← V J``, each as ``x_j ← c_j x_j + σ_j x_{partner(j)}`` with the
  partner row / column fetched by ``tl.gather`` — O(P²) elementwise work per round, no ``tl.dot``.
* Rotation of a pair p < q: the symmetric Schur rotation (Golub & Van Loan, Alg. 8.4.1)
  ``τ = (a_qq − a_pp) / (2 a_pq)``, ``t = sign(τ) / (|τ| + sqrt(1 + τ²))`` (sign(0) = +1), ``c = 1/sqrt(1 + t²)``,
  ``s = t c``; then ``a_pq = a_qp = 0`` and ``a_pp −= t a_pq``, ``a_qq += t a_pq`` are set exactly (Rutishauser).
  ``a_pq`` is taken as ``(A[p, q] + A[q, p]) / 2``: both members of the pair compute bitwise the same (c, s), so
  ``J`` is one orthogonal matrix even when rounding made ``A`` slightly asymmetric. A pair is skipped (c = 1, s = 0)
  when ``|a_pq| ≤ ε·sqrt(|a_pp|)·sqrt(|a_qq|)`` (ε = 2⁻⁵³; the Demmel–Veselić threshold: the rotation would change
  the 2×2 block below its rounding; ``a_pq = 0`` included). For ``|τ| > ~1e154``, ``τ²`` overflows to inf and
  ``t = 0`` (the true ``t < 1e-154``; ``a_pq`` is still set to 0, an absolute change below 1e-154·|a_qq − a_pp|).
* Stopping, tested once per sweep inside the kernel (a ``while`` loop, no host sync): ``off(A) ≤ TOL·‖A‖_F`` with
  ``off(A)`` the Frobenius norm of the off-diagonal part, or a sweep without any rotation, or ``sweeps`` sweeps
  (default ``MAX_SWEEPS`` = 24). ``TOL = 1e-15`` (≈ 4.5 ε_f64): the eigenvalue error left by stopping is at most
  off(A) ≤ 1e-15·‖A‖_F (Weyl), the residual ``‖AV − VΛ‖`` is off(A) plus rounding, both below the rounding the
  rotations themselves leave (a few ε·‖A‖), and in the quadratic regime a tighter tolerance costs at most one more
  sweep. Looser tolerances barely save sweeps (1e-13 saves ~0.1 sweep on average on the truncation's Rayleigh
  quotients) and would leave errors near the tests' bounds.
  Sweeps used (``bench/jacobi_replica.py``: a NumPy replica of the kernel, equal to the interpreted kernel bit for
  bit): 0 for diagonal or zero input; 0–8 (mostly 3–6) for the 32×32 Rayleigh quotients ``QᵀGQ`` of
  ``truncate_states`` on its hard test batteries (nearly diagonal already); 7–8 for random symmetric 32×32 and
  64×64; 10–16 (32×32) and 14–20 (64×64) for PSD matrices with a random eigenbasis and eigenvalues spread over
  1e0…1e-16: there the many tiny, absolutely close eigenvalues make the convergence linear until off(A) nears
  ε·‖A‖ (sequential cyclic Jacobi behaves the same). ``MAX_SWEEPS`` = 24 covers those; a matrix that hits the cap
  still gets its eigenvalues to within ~off(A). On a GPU one slow matrix does not slow the others' programs, but
  the call lasts as long as its slowest program.
* Sorting: ascending eigenvalues, ties by index (a stable rank computed in the kernel by an O(P²) comparison); each
  eigenvalue and its column are stored at their rank, so no ``torch.sort`` / ``gather`` follows the kernel.

Accuracy against float64 ``torch.linalg.eigh`` (the replica on a few hundred matrices; the interpreted kernel in
``tests/test_jacobi.py``): eigenvalues within ~2e-15·‖A‖_F, ``‖VᵀV − I‖_F`` ≲ 5e-14 (n = 32) and ≲ 1.5e-13
(n = 64), ``‖AV − VΛ‖_F`` ≲ 3e-15·‖A‖_F, on random, PSD graded (condition numbers to 1e16), clustered, repeated,
zero and diagonal inputs, n = 1 … 64. Non-finite input gives unspecified output (``torch.linalg.eigh`` raises).

Where it runs: CUDA tensors run the kernel. CPU tensors use ``torch.linalg.eigh`` unless this module was imported
with ``TRITON_INTERPRET=1`` in the environment (tests only: the Triton interpreter then runs the same kernel on
CPU). Matrices larger than 64×64, or a missing Triton, also fall back to ``torch.linalg.eigh``.
"""
from __future__ import annotations

import os
from contextlib import nullcontext as _nullcontext

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None

__all__ = ["eigh_jacobi", "uses_kernel", "MAX_N", "MAX_SWEEPS", "TOL"]  # and, with Triton, jacobi_sweeps

MAX_N = 64  # largest matrix the kernel takes (A and V of 64×64 float64 in one program's registers)
MAX_SWEEPS = 24  # default cap on sweeps (typical: 3–8; graded random-basis PSD 64×64: up to 20)
TOL = 1e-15  # stop when off(A) ≤ TOL·‖A‖_F
_SKIP = 2.0**-53  # skip a rotation when |a_pq| ≤ _SKIP·sqrt(|a_pp a_qq|)

# Read once at import, like Triton itself: the interpreter is either on for the whole process or off.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# num_warps by padded size: 4 for 16×16 and 32×32 tiles, 8 for 64×64, fewer for tiny ones (not tuned). Triton
# lays a [P, P] gather out with the gather axis inside one warp and the warps on the other axis; more warps than
# that axis can hold trip an assertion in its OptimizeThreadLocality pass in some releases (triton-lang/triton#11600,
# 3.8). With Triton 3.6 every P compiles for sm_90a with these counts (tests/test_jacobi.py compiles them offline).
_WARPS = {2: 1, 4: 1, 8: 2, 16: 4, 32: 4, 64: 8}


if triton is not None:

    @triton.jit
    def jacobi_sweeps(A, max_sweeps, P: tl.constexpr, TOL2: tl.constexpr, SKIP: tl.constexpr):
        """Cyclic parallel Jacobi on a symmetric ``[P, P]`` float64 block ``A`` (zero-padded rows and columns stay decoupled), in
        the calling program's registers (see the module docstring). Returns ``(d [P], V [P, P], sweeps)``: the
        eigenvalues in index order (unsorted), the eigenvectors as columns, and the sweeps used (int32 scalar).

        Shared by ``_jacobi_kernel`` and the fused truncation kernel (``gdnviz.gpu.fused_truncate``)."""
        idx = tl.arange(0, P)
        rows = idx[:, None]
        cols = idx[None, :]
        diag = rows == cols
        Vm = tl.where(diag, 1.0, 0.0).to(tl.float64)
        fro2 = tl.sum(A * A)
        thresh = TOL2 * fro2
        off2 = tl.sum(tl.where(diag, 0.0, A * A))
        d = tl.sum(tl.where(diag, A, 0.0), axis=1)  # diag(A), kept in step with A below
        sweep = tl.full((), 0, tl.int32)
        nrot = tl.full((), 1, tl.int32)
        while (sweep < max_sweeps) & (off2 > thresh) & (nrot > 0):
            rotated = idx < 0  # all False: did index i rotate in this sweep?
            for k in range(0, P - 1):
                # Round-robin partner of every index (2k − i + m ≥ 0, so % is the true modulo).
                j = (2 * k - idx + (P - 1)) % (P - 1)
                pr = tl.where(idx == P - 1, k, tl.where(j == idx, P - 1, j))
                sel = cols == pr[:, None]  # row i selects column partner(i)
                a_ip = tl.sum(tl.where(sel, A, 0.0), axis=1)  # A[i, partner(i)]
                a_pi = tl.gather(a_ip, pr, 0)  # A[partner(i), i]
                d_pr = tl.gather(d, pr, 0)  # A[partner(i), partner(i)]
                is_p = idx < pr  # i is the smaller index p of its pair
                app = tl.where(is_p, d, d_pr)
                aqq = tl.where(is_p, d_pr, d)
                apq = 0.5 * (a_ip + a_pi)  # the same bits for both members of a pair
                # Skip (t = 0) when |a_pq| ≤ ε·sqrt(|a_pp a_qq|), a_pq = 0 included; NaN compares False.
                rot = tl.abs(apq) > SKIP * (tl.sqrt(tl.abs(app)) * tl.sqrt(tl.abs(aqq)))
                tau = (aqq - app) / (2.0 * tl.where(rot, apq, 1.0))
                at = tl.abs(tau)
                t = 1.0 / (at + tl.sqrt(1.0 + tau * tau))  # |τ| > 1e154: τ² = inf, t = 0 (true t < 1e-154)
                t = tl.where(rot, tl.where(tau < 0.0, -t, t), 0.0)
                c = 1.0 / tl.sqrt(1.0 + t * t)
                s = t * c
                sig = tl.where(is_p, -s, s)
                d = tl.where(is_p, app - t * apq, aqq + t * apq)
                # A ← A J (columns), A ← Jᵀ A (rows), V ← V J; x_j ← c_j x_j + σ_j x_partner(j).
                pc = tl.broadcast_to(pr[None, :], (P, P))
                A = c[None, :] * A + sig[None, :] * tl.gather(A, pc, 1)
                A = c[:, None] * A + sig[:, None] * tl.gather(A, tl.broadcast_to(pr[:, None], (P, P)), 0)
                Vm = c[None, :] * Vm + sig[None, :] * tl.gather(Vm, pc, 1)
                # The rotated 2×2 blocks are diagonal now: set them exactly.
                A = tl.where(diag, d[:, None], tl.where(sel & rot[:, None], 0.0, A))
                rotated = rotated | rot
            off2 = tl.sum(tl.where(diag, 0.0, A * A))
            nrot = tl.sum(rotated.to(tl.int32))
            sweep += 1
        return d, Vm, sweep

    @triton.jit
    def _jacobi_kernel(T, W, V, SW, n, max_sweeps, P: tl.constexpr, TOL2: tl.constexpr, SKIP: tl.constexpr):
        """Cyclic parallel Jacobi on one zero-padded P×P symmetric matrix (see the module docstring)."""
        pid = tl.program_id(0).to(tl.int64)
        idx = tl.arange(0, P)
        rows = idx[:, None]
        cols = idx[None, :]
        inside = (rows < n) & (cols < n)
        # Lower triangle, mirrored (torch.linalg.eigh's UPLO="L"); zero outside n×n.
        offs = tl.where(rows >= cols, rows * n + cols, cols * n + rows)
        A = tl.load(T + pid * n * n + offs, mask=inside, other=0.0)
        d, Vm, sweep = jacobi_sweeps(A, max_sweeps, P, TOL2, SKIP)
        tl.store(SW + pid, sweep)
        # Ascending order, ties by index: rank[i] = #{j < n : d_j < d_i or (d_j = d_i and j < i)}.
        d_r = d[:, None]  # d_j, by row j
        d_c = d[None, :]  # d_i, by column i
        before = (rows < n) & ((d_r < d_c) | ((d_r == d_c) & (rows < cols)))
        rank = tl.sum(before.to(tl.int32), axis=0)  # by column i
        tl.store(W + pid * n + rank, d, mask=idx < n)
        tl.store(V + pid * n * n + rows * n + rank[None, :], Vm, mask=inside)


def _next_pow2(n: int) -> int:
    return 1 << (max(int(n), 2) - 1).bit_length()


def uses_kernel(T: torch.Tensor) -> bool:
    """Whether ``eigh_jacobi(T)`` runs the Triton kernel (True) or falls back to ``torch.linalg.eigh`` (False)."""
    if triton is None or T.dim() < 2 or T.shape[-1] > MAX_N:
        return False
    return T.is_cuda or (_INTERPRET and T.device.type == "cpu")


def eigh_jacobi(T: torch.Tensor, sweeps: int | None = None, *, return_sweeps: bool = False):
    """Eigenvalues (ascending) and eigenvectors (columns) of symmetric matrices ``T [..., n, n]``, like
    ``torch.linalg.eigh(T)`` (lower triangle read), without a host sync on CUDA.

    Args:
        T: ``[..., n, n]`` symmetric matrices, n ≤ 64 for the kernel (larger ones use ``torch.linalg.eigh``).
            Computed in float64; the results have ``T``'s dtype.
        sweeps: maximum number of Jacobi sweeps (default ``MAX_SWEEPS``); the kernel stops earlier once converged.
        return_sweeps: also return the sweeps each matrix used, int32 ``[...]`` on ``T``'s device (−1 where
            ``torch.linalg.eigh`` ran instead of the kernel).

    Returns:
        ``(eigenvalues [..., n], eigenvectors [..., n, n])``, plus the sweep counts with ``return_sweeps=True``.
        No autograd through the kernel (the truncation runs under ``torch.no_grad``); eigenvector signs, like
        LAPACK's, are arbitrary.
    """
    if T.dim() < 2 or T.shape[-1] != T.shape[-2]:
        raise ValueError(f"eigh_jacobi needs square matrices [..., n, n]; got {tuple(T.shape)}.")
    max_sweeps = MAX_SWEEPS if sweeps is None else int(sweeps)
    if max_sweeps < 0:
        raise ValueError(f"sweeps must be ≥ 0; got {sweeps!r}.")
    batch, n = T.shape[:-2], T.shape[-1]
    if not uses_kernel(T):
        w, v = torch.linalg.eigh(T)
        if return_sweeps:
            return w, v, torch.full(batch, -1, dtype=torch.int32, device=T.device)
        return w, v
    A = T.reshape(-1, n, n).to(torch.float64).contiguous()
    N = A.shape[0]
    W = torch.empty(N, n, dtype=torch.float64, device=T.device)
    Vec = torch.empty(N, n, n, dtype=torch.float64, device=T.device)
    SW = torch.empty(N, dtype=torch.int32, device=T.device)
    if N and n:
        P = _next_pow2(n)
        with torch.cuda.device(A.device) if A.is_cuda else _nullcontext():  # Triton launches on the current device
            _jacobi_kernel[(N,)](A, W, Vec, SW, n, max_sweeps, P=P, TOL2=TOL * TOL, SKIP=_SKIP, num_warps=_WARPS[P])
    elif N:
        SW.zero_()
    W = W.reshape(*batch, n).to(T.dtype)
    Vec = Vec.reshape(*batch, n, n).to(T.dtype)
    if return_sweeps:
        return W, Vec, SW.reshape(batch)
    return W, Vec
