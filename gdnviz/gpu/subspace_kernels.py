"""The orthonormalisations of ``gdnviz.truncate``'s subspace pass in a few Triton launches (split Cholesky-QR).

``orthonormal_iterations(Z, P, G, iters, fill)`` computes, for float64 blocks ``Z [N, R, q]`` (R ∈ {64, 128},
q = 32), filters ``P [N, R, R]`` (= G²) and Gram matrices ``G [N, R, R]``, exactly the part of
``gdnviz.truncate._subspace_pass`` between the sketch and the Rayleigh–Ritz eigensolver:

    Q ← cholqr(cholqr(Z));  iters × Q ← cholqr(P Q);  Q ← cholqr(cholqr(Q + FILL·w·fill));  T = Qᵀ G Q

and returns ``(Q [N, R, q], T [N, q, q])``; ``cholqr`` is the shifted Cholesky-QR of ``truncate._cholqr``
(``Z L⁻ᵀ`` with ``L Lᵀ = ZᵀZ + 1e-13·diag(ZᵀZ) + 1e-300·I``) and ``w = sqrt(max(1 − ‖q_j‖², 0))`` per column.
The caller finishes the pass as the torch path does (``eigh`` of T, Ritz vectors ``Q W``).

Why split: the torch path spends ~7 kernels per Cholesky-QR (≈ 9 of them per pass) and every kernel costs ~10 µs
even replayed from a CUDA graph, so a layer's truncation of 16 states is ~0.8 ms of latency for little work
(bench/RESULTS.md). The fused kernel (``gdnviz.gpu.fused_truncate``: all of it in one 8-warp program per state) is
slower still (~1 ms) because its ~500 sequential steps are each a cross-warp reduction. Here every Cholesky-QR is
cut where the work changes shape:

* a *step* kernel (one program per state, ``STEP_WARPS`` warps) applies the pending ``L⁻ᵀ`` of the last
  factorisation, the next product (nothing, ``P·``, or the refill) and forms the next shifted Gram matrix
  ``C = YᵀY`` with float64 ``tl.dot`` (tensor-core DMMA on sm_90);
* a *Cholesky* kernel (one program per state, ``CHOL_WARPS`` = 1 warp) factors the 32×32 ``C`` and forms
  ``L⁻ᵀ`` in 32 column steps whose reductions stay inside one warp (no barrier per step).

``mode="fused"`` instead factors ``C`` inside the step kernel (one launch per Cholesky-QR, cross-warp steps):
which of the two is faster is measured by ``bench/bench_truncate.py --subspace-kernels``. Launches per pass:
``2·iters + 9`` (split) or ``iters + 5`` (fused), against ~7·(iters + 4) + 4 for the torch path.

Arithmetic is the torch path's in float64, in a different summation order (``tl.dot`` tiles), so results agree to
rounding on well-conditioned blocks and within the shifted Cholesky-QR's damping on rank-deficient ones
(tests/test_subspace_kernels.py runs the kernels in the Triton interpreter against ``truncate._subspace_pass``'s
torch path and the exact float64 SVD energies). No host sync: nothing is read back, all shapes are fixed by the
host-side rank.

Status: used by ``truncate_states`` on CUDA when ``GDNVIZ_TRITON_SUBSPACE`` is ``1`` (split) or ``fused``; see
``mode()`` for the default.
"""
from __future__ import annotations

import os
from contextlib import nullcontext

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None

SHAPES_R = (64, 128)
BLOCK_Q = 32
STEP_WARPS = 8
CHOL_WARPS = 1
DEFAULT_MODE = "off"  # until measured on the GPU: "off" | "split" | "fused"

if triton is not None:

    @triton.jit
    def _chol_inv_t(C, Q: tl.constexpr):
        """``L⁻ᵀ`` for the (already shifted) symmetric positive ``C [Q, Q]`` = ``L Lᵀ`` (float64): one loop over the
        columns forms column j of L (right-looking update of the Schur complement) and row j of L⁻¹."""
        qq = tl.arange(0, Q)
        rows = qq[:, None]
        cols = qq[None, :]
        L = tl.zeros((Q, Q), tl.float64)
        Li = tl.zeros((Q, Q), tl.float64)
        for j in range(Q):
            cj = tl.sum(tl.where(cols == j, C, 0.0), axis=1)  # C[:, j] (Schur complement), by row
            ljj = tl.sqrt(tl.sum(tl.where(qq == j, cj, 0.0)))
            lj = tl.where(qq >= j, cj / ljj, 0.0)  # column j of L
            C = C - lj[:, None] * lj[None, :]
            L = tl.where(cols == j, lj[:, None], L)
            Lrow = tl.sum(tl.where(rows == j, L, 0.0), axis=0)  # L[j, :], by column
            acc = tl.sum(Lrow[:, None] * Li, axis=0)  # Σ_k L[j, k] L⁻¹[k, :] (row j of L⁻¹ is still 0)
            Li = tl.where(rows == j, ((tl.where(qq == j, 1.0, 0.0) - acc) / ljj)[None, :], Li)
        return tl.trans(Li)

    @triton.jit
    def _shifted_gram(Y, Q: tl.constexpr, SHIFT: tl.constexpr, TINY: tl.constexpr):
        qq = tl.arange(0, Q)
        C = tl.dot(tl.trans(Y), Y, input_precision="ieee")
        return tl.where(qq[:, None] == qq[None, :], C * (1.0 + SHIFT) + TINY, C)

    @triton.jit
    def _chol_kernel(M, Q: tl.constexpr):
        """In place: shifted Gram ``C`` → ``L⁻ᵀ`` for matrix ``pid`` of ``M [N, Q, Q]``."""
        pid = tl.program_id(0).to(tl.int64)
        qq = tl.arange(0, Q)
        offs = pid * Q * Q + qq[:, None] * Q + qq[None, :]
        C = tl.load(M + offs)
        tl.store(M + offs, _chol_inv_t(C, Q))

    @triton.jit
    def _step_kernel(Y, M, P, FILLD, R: tl.constexpr, Q: tl.constexpr, APPLY: tl.constexpr, MODE: tl.constexpr,
                     FUSE: tl.constexpr, SHIFT: tl.constexpr, TINY: tl.constexpr, FILL: tl.constexpr):
        """In place on block ``pid``: ``Q = Y·M`` (M = the pending L⁻ᵀ; APPLY=False: Q = Y), then
        MODE 0: ``Y ← Q``; MODE 1: ``Y ← P Q``; MODE 2: ``Y ← Q + FILL·w·fill`` (w per column: sqrt(max(1 − ‖q‖², 0))).
        Then ``M ← shifted YᵀY`` (FUSE=False) or its ``L⁻ᵀ`` (FUSE=True)."""
        pid = tl.program_id(0).to(tl.int64)
        rr = tl.arange(0, R)
        qq = tl.arange(0, Q)
        yoffs = pid * R * Q + rr[:, None] * Q + qq[None, :]
        moffs = pid * Q * Q + qq[:, None] * Q + qq[None, :]
        Yb = tl.load(Y + yoffs)
        if APPLY:
            Yb = tl.dot(Yb, tl.load(M + moffs), input_precision="ieee")
        if MODE == 1:
            Pt = tl.load(P + pid * R * R + rr[:, None] * R + rr[None, :])
            Yb = tl.dot(Pt, Yb, input_precision="ieee")
        if MODE == 2:
            w = tl.sqrt(tl.maximum(1.0 - tl.sum(Yb * Yb, axis=0), 0.0))
            Yb = Yb + (FILL * w)[None, :] * tl.load(FILLD + rr[:, None] * Q + qq[None, :])
        tl.store(Y + yoffs, Yb)
        C = _shifted_gram(Yb, Q, SHIFT, TINY)
        if FUSE:
            C = _chol_inv_t(C, Q)
        tl.store(M + moffs, C)

    @triton.jit
    def _ritz_kernel(Y, M, G, T, R: tl.constexpr, Q: tl.constexpr):
        """In place: ``Y ← Y·M`` (the orthonormal basis); ``T ← Yᵀ G Y`` (the Rayleigh quotient)."""
        pid = tl.program_id(0).to(tl.int64)
        rr = tl.arange(0, R)
        qq = tl.arange(0, Q)
        yoffs = pid * R * Q + rr[:, None] * Q + qq[None, :]
        moffs = pid * Q * Q + qq[:, None] * Q + qq[None, :]
        Qb = tl.dot(tl.load(Y + yoffs), tl.load(M + moffs), input_precision="ieee")
        tl.store(Y + yoffs, Qb)
        Gt = tl.load(G + pid * R * R + rr[:, None] * R + rr[None, :])
        GQ = tl.dot(Gt, Qb, input_precision="ieee")
        tl.store(T + moffs, tl.dot(tl.trans(Qb), GQ, input_precision="ieee"))


    @triton.jit
    def _setup_kernel(S, G, P, Y, M, OMEGA, K: tl.constexpr, V: tl.constexpr, Q: tl.constexpr, FUSE: tl.constexpr,
                      SHIFT: tl.constexpr, TINY: tl.constexpr):
        """Cold start of a pass for state ``pid`` of ``S [N, K, V]`` (any float dtype, read as float64):
        ``G = S Sᵀ/‖S‖²_F``, ``P = G²``, sketch ``Y = S Ω/‖S‖_F`` and ``M`` = its shifted Gram (FUSE: its L⁻ᵀ)."""
        pid = tl.program_id(0).to(tl.int64)
        kk = tl.arange(0, K)
        vv = tl.arange(0, V)
        qq = tl.arange(0, Q)
        X = tl.load(S + pid * K * V + kk[:, None] * V + vv[None, :]).to(tl.float64)
        tr = tl.sum(tl.sum(X * X, axis=1), axis=0)
        inv = tl.where(tr > 0, 1.0 / tl.sqrt(tl.where(tr > 0, tr, 1.0)), 0.0)  # 1/‖S‖_F, 0 for a zero state
        Z = tl.dot(X, tl.load(OMEGA + vv[:, None] * Q + qq[None, :]), input_precision="ieee") * inv
        tl.store(Y + pid * K * Q + kk[:, None] * Q + qq[None, :], Z)
        C = _shifted_gram(Z, Q, SHIFT, TINY)
        if FUSE:
            C = _chol_inv_t(C, Q)
        tl.store(M + pid * Q * Q + qq[:, None] * Q + qq[None, :], C)
        Gm = tl.dot(X, tl.trans(X), input_precision="ieee") * (inv * inv)
        goffs = pid * K * K + kk[:, None] * K + kk[None, :]
        tl.store(G + goffs, Gm)
        tl.store(P + goffs, tl.dot(Gm, Gm, input_precision="ieee"))

    @triton.jit
    def _project_kernel(Y, W, S, OUT, r, K: tl.constexpr, V: tl.constexpr, Q: tl.constexpr):
        """``OUT[pid] = U Uᵀ S[pid]`` with ``U = Y·W[:, Q−r:]`` (the Ritz vectors of the r largest Ritz values:
        ``W`` holds eigenvectors in ascending order), stored in OUT's dtype."""
        pid = tl.program_id(0).to(tl.int64)
        kk = tl.arange(0, K)
        vv = tl.arange(0, V)
        qq = tl.arange(0, Q)
        Wm = tl.load(W + pid * Q * Q + qq[:, None] * Q + qq[None, :])
        Wm = tl.where(qq[None, :] >= Q - r, Wm, 0.0)
        U = tl.dot(tl.load(Y + pid * K * Q + kk[:, None] * Q + qq[None, :]), Wm, input_precision="ieee")
        soffs = pid * K * V + kk[:, None] * V + vv[None, :]
        X = tl.load(S + soffs).to(tl.float64)
        out = tl.dot(U, tl.dot(tl.trans(U), X, input_precision="ieee"), input_precision="ieee")
        tl.store(OUT + soffs, out.to(OUT.dtype.element_ty))


def mode() -> str:
    """``"off"``, ``"split"`` or ``"fused"``: how ``truncate_states`` runs the subspace pass's orthonormalisations
    on CUDA, from ``GDNVIZ_TRITON_SUBSPACE`` (``0``/``off``, ``1``/``split``, ``fused``), else ``DEFAULT_MODE``."""
    env = os.environ.get("GDNVIZ_TRITON_SUBSPACE", "").strip().lower()
    m = {"0": "off", "off": "off", "1": "split", "split": "split", "fused": "fused"}.get(env, DEFAULT_MODE)
    return "off" if triton is None else m


def supports(Z: torch.Tensor, P: torch.Tensor) -> bool:
    """Shapes the kernels take: float64 ``Z [N, R, 32]``, ``P [N, R, R]``, R in SHAPES_R."""
    return (triton is not None and Z.dim() == 3 and Z.dtype == torch.float64 and Z.shape[1] in SHAPES_R
            and Z.shape[2] == BLOCK_Q and P.shape == (Z.shape[0], Z.shape[1], Z.shape[1]))


def orthonormal_iterations(Z: torch.Tensor, P: torch.Tensor, G: torch.Tensor, iters: int, fill: torch.Tensor,
                           *, fuse: bool = False, shift: float = 1e-13, tiny: float = 1e-300, fill_size: float = 1e-6,
                           step_warps: int | None = None, chol_warps: int | None = None):
    """``(Q [N, R, q], T [N, q, q])`` — see the module docstring. ``fill [R, q]``: the unit refill directions."""
    if not supports(Z, P):
        raise ValueError(f"orthonormal_iterations takes float64 Z [N, R, {BLOCK_Q}] with R in {SHAPES_R}; got "
                         f"{Z.dtype} {tuple(Z.shape)}")
    N, R, Q = Z.shape
    Y = Z.contiguous().clone()
    M = torch.empty(N, Q, Q, dtype=torch.float64, device=Z.device)
    if N == 0:
        return Y, torch.empty_like(M)
    pipe = _Pipeline(Y, M, P.contiguous(), G.contiguous(), fill.contiguous(), fuse, shift, tiny, fill_size,
                     step_warps, chol_warps)
    with torch.cuda.device(Z.device) if Z.is_cuda else nullcontext():
        pipe.step(False, 0)  # Cholesky-QR of the sketch: Gram of Z
        return pipe.finish(iters)


def truncate_cold(S: torch.Tensor, r: int, iters: int, omega: torch.Tensor, fill: torch.Tensor, *,
                  fuse: bool = False, shift: float = 1e-13, tiny: float = 1e-300, fill_size: float = 1e-6,
                  step_warps: int | None = None, chol_warps: int | None = None) -> torch.Tensor:
    """One whole cold-started single-pass truncation (r ≤ 16) of ``S [N, K, V]`` (K, V in SHAPES_R; any float dtype)
    to rank ``r``: ``truncate._subspace_pass`` + ``_project`` in ``iters + 8`` (fused) or ``2·iters + 12`` (split)
    launches — the setup kernel (Gram, G², sketch), the orthonormalisations, Rayleigh–Ritz (``eigh_jacobi``) and the
    projection kernel, which stores the result in ``S``'s dtype. ``omega [V, q]``: the sketch; ``fill [K, q]``."""
    from gdnviz.gpu.jacobi import eigh_jacobi

    N, K, V = S.shape
    Q = BLOCK_Q
    if K not in SHAPES_R or V not in SHAPES_R or not 1 <= r <= 16:
        raise ValueError(f"truncate_cold takes [N, K, V] with K, V in {SHAPES_R} and 1 ≤ r ≤ 16; got "
                         f"{tuple(S.shape)}, r = {r}")
    S = S.contiguous()
    out = torch.empty_like(S)
    if N == 0:
        return out
    dev = S.device
    f64 = dict(dtype=torch.float64, device=dev)
    G, P = torch.empty(N, K, K, **f64), torch.empty(N, K, K, **f64)
    Y, M = torch.empty(N, K, Q, **f64), torch.empty(N, Q, Q, **f64)
    pipe = _Pipeline(Y, M, P, G, fill.contiguous(), fuse, shift, tiny, fill_size, step_warps, chol_warps)
    with torch.cuda.device(dev) if S.is_cuda else nullcontext():
        _setup_kernel[(N,)](S, G, P, Y, M, omega.contiguous(), K=K, V=V, Q=Q, FUSE=fuse, SHIFT=shift, TINY=tiny,
                            num_warps=pipe.sw)
        if not fuse:
            _chol_kernel[(N,)](M, Q=Q, num_warps=pipe.cw)
        Y, T = pipe.finish(iters)
        _, W = eigh_jacobi(T)
        _project_kernel[(N,)](Y, W, S, out, int(r), K=K, V=V, Q=Q, num_warps=pipe.sw)
    return out


class _Pipeline:
    """The launches after the sketch's Gram matrix: Y holds the block, M the pending L⁻ᵀ (or the Gram matrix
    until the Cholesky kernel has run)."""

    def __init__(self, Y, M, P, G, fill, fuse, shift, tiny, fill_size, step_warps, chol_warps):
        self.Y, self.M, self.P, self.G, self.fill = Y, M, P, G, fill
        self.fuse = fuse
        self.sw = STEP_WARPS if step_warps is None else step_warps
        self.cw = CHOL_WARPS if chol_warps is None else chol_warps
        self.consts = dict(R=Y.shape[1], Q=Y.shape[2], FUSE=fuse, SHIFT=shift, TINY=tiny, FILL=fill_size)

    def step(self, apply: bool, mode_: int) -> None:
        N = self.Y.shape[0]
        _step_kernel[(N,)](self.Y, self.M, self.P, self.fill, APPLY=apply, MODE=mode_, num_warps=self.sw,
                           **self.consts)
        if not self.fuse:
            _chol_kernel[(N,)](self.M, Q=self.Y.shape[2], num_warps=self.cw)

    def finish(self, iters: int):
        """From a pending first Cholesky-QR of the sketch to (Q, T)."""
        self.step(True, 0)  # ... applied; second pass (CholQR²)
        for _ in range(int(iters)):
            self.step(True, 1)  # Q ← cholqr(P Q)
        self.step(True, 2)  # refill of damped columns
        self.step(True, 0)  # CholQR² of the refilled block
        N, R, Q = self.Y.shape
        T = torch.empty(N, Q, Q, dtype=torch.float64, device=self.Y.device)
        _ritz_kernel[(N,)](self.Y, self.M, self.G, T, R=R, Q=Q, num_warps=self.sw)
        return self.Y, T
