"""Float64 references of truncation: the exact answer, its energies, the energy-error bound, and the CUDA kernel's
algorithm in batched torch (``subspace_truncate``: also the CPU path and the fallback on CUDA).

Truncating a head state ``S [K, V]`` (key × value) to rank ``r`` replaces it by its projection onto its top-``r`` left
singular directions, ``S_r = U_r U_rᵀ S`` (Eckart–Young: the best rank-``r`` approximation). Energies are relative to
the state's own ``‖S‖²_F``; a zero state counts as fully kept.

The subspace algorithm (per state, float64; ranks 1 … 32, K ≥ 32):

1. ``G = S Sᵀ / ‖S‖²_F`` (trace 1; 0 for a zero state).
2. Pass p (one pass for r ≤ 16, two for 16 < r ≤ 32): sketch ``Z = S_p Ω_p / ‖S_p‖_F`` with the fixed Gaussian Ω_p
   (``constants.start_matrices``), one shifted Cholesky-QR, ``iterations_for(r, p)`` filter steps
   ``Q ← cholqr(G (G Q))`` (a 32-column block: oversampling ≥ 16), a refill of damped columns by fixed unit directions
   and a checked Cholesky-QR², then Rayleigh–Ritz (eigenpairs of the 32×32 ``QᵀGQ``); the top ``min(r − 16p, 16)``
   Ritz vectors (descending, ties by index) become columns 16p … of ``U``.
3. Between the passes ``G ← (I − UUᵀ) G (I − UUᵀ)`` renormalised (``deflate``), the sketch deflated the same way;
   after two passes a checked Cholesky-QR² of ``U`` (the second pass's refilled columns need not be ⊥ the first's).
4. ``S_r = U (Uᵀ S)`` from the input state.

Shifted Cholesky-QR: ``Z R⁻¹`` with ``RᵀR = ZᵀZ + 1e-13·diag(ZᵀZ) + 1e-300·I``: every pivot positive for any finite
block, so rank-deficient and zero states need no branch. The kernel computes the same steps with its own Jacobi
eigensolver and summation orders: the two agree to rounding, not bit for bit.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from gdnviz.truncation import constants as C
from gdnviz.truncation.ranks import state_ranks

F64 = torch.float64


def as_batch(states) -> torch.Tensor:
    """``states [..., K, V]`` (floating point) as ``[N, K, V]``; TypeError / ValueError otherwise."""
    if not isinstance(states, torch.Tensor):
        raise TypeError(f"states must be a torch.Tensor [N, K, V]; got {type(states).__name__}.")
    if states.dim() < 3:
        raise ValueError(f"states must have shape [N, K, V] (or [..., K, V]); got {tuple(states.shape)}.")
    if not states.dtype.is_floating_point:
        raise TypeError(f"states must be a floating-point tensor; got {states.dtype}.")
    return states.reshape(-1, *states.shape[-2:])


def normalised_gram(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``G = X Xᵀ / ‖X‖²_F`` (``[N, K, K]``, trace 1, or 0 for a zero state) and ``1/‖X‖_F`` (``[N, 1, 1]``, 0 if
    zero). float64 entries beyond ~1e±150 would over/underflow ``X Xᵀ``; float32 / bfloat16 states cannot."""
    G = X @ X.mT
    tr = G.diagonal(dim1=-2, dim2=-1).sum(-1)[:, None, None]
    inv = torch.where(tr > 0, tr.clamp_min(C.TINY).rsqrt(), torch.zeros_like(tr))
    G.mul_(inv * inv)
    return G, inv


# ------------------------------------------------------------------------------------------------ exact
def _ranks_tensor(rank, N: int, device) -> torch.Tensor:
    return torch.tensor(state_ranks(rank, N), dtype=torch.long).to(device)


def _project(X: torch.Tensor, U: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """``U_r U_rᵀ X`` with each state's leading ``ranks[i]`` columns of ``U``."""
    keep = torch.arange(U.shape[-1], device=U.device)[None, :] < ranks[:, None]
    Ur = U * keep[:, None, :].to(U.dtype)
    return Ur @ (Ur.mT @ X)


@torch.no_grad()
def exact_truncate(states: torch.Tensor, rank) -> torch.Tensor:
    """Reference truncation by a float64 ``torch.linalg.svd``: ``U_r U_rᵀ S`` per state.

    ``states [N, K, V]`` (or ``[..., K, V]``), ``rank`` an int or N integers (``ranks.state_ranks``); returns the input
    dtype and device. Ranks ≥ min(K, V) return the state unchanged. Raises RankOutOfRange for a bad rank."""
    S = as_batch(states)
    N, K, V = S.shape
    m = min(K, V)
    ranks = _ranks_tensor(rank, N, S.device)
    if N == 0 or m == 0:
        return states.clone()
    X = S.to(F64)
    U = torch.linalg.svd(X, full_matrices=False)[0]
    y = _project(X, U, ranks.clamp_max(m)).to(S.dtype)
    return torch.where((ranks >= m)[:, None, None], S, y).reshape(states.shape)


def eigh_truncate(X: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """``U_r U_rᵀ X`` from the float64 ``eigh`` of ``G`` (exact; ranks > 32, small K, uncertified states).
    ``X [N, K, V]`` float64, ``ranks`` long ``[N]`` on X's device, each < min(K, V)."""
    G, _ = normalised_gram(X)
    W = torch.linalg.eigh(G)[1].flip(-1)
    return _project(X, W[..., : max(int(ranks.max()), 1)] if ranks.numel() else W, ranks)


def retained_energy(original: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Fraction of the energy kept per state, ``‖truncated‖²_F / ‖original‖²_F``, float64 ``[N]`` (1 for a zero
    original). States ``[N, K, V]`` or ``[..., K, V]`` (flattened)."""
    o = as_batch(original).to(F64).square().sum((-1, -2))
    t = as_batch(truncated).to(F64).square().sum((-1, -2))
    return torch.where(o > 0, t / torch.where(o > 0, o, torch.ones_like(o)), torch.ones_like(o))


def energy_error(original: torch.Tensor, truncated: torch.Tensor, rank) -> torch.Tensor:
    """``|‖S_r‖² − ‖S_r^exact‖²| / ‖S‖²`` per state (float64 ``[N]``), the exact energy from float64 singular
    values; ``rank`` an int or N integers."""
    S = as_batch(original).to(F64)
    ranks = _ranks_tensor(rank, S.shape[0], S.device)
    s2 = torch.linalg.svdvals(S).square()
    keep = torch.arange(s2.shape[-1], device=S.device)[None, :] < ranks[:, None]
    exact = (s2 * keep).sum(-1)
    total = s2.sum(-1)
    got = as_batch(truncated).to(F64).square().sum((-1, -2))
    return torch.where(total > 0, (got - exact).abs() / torch.where(total > 0, total, torch.ones_like(total)), got)


# ------------------------------------------------------------------------------------------ error bound
D2_SLACK = 1e-12  # allowance for the rounding of ‖G‖² − ‖T‖² − 2‖R‖² (the CUDA kernel's)
DTR_SLACK = 1e-12  # ... and of tr(D) = 1 − tr(T)


def bound_terms(G: torch.Tensor, Q: torch.Tensor, r: int, g2: torch.Tensor | None = None):
    """(energy-error bound, energy kept by ``Q[..., :r]``), float64 ``[N]`` each, for the trace-1 Gram matrices
    ``G [N, K, K]`` and an orthonormal basis ``Q [N, K, w]`` (r ≤ w); ``g2``: ‖G‖_F² if known. See
    ``energy_error_bound``."""
    GQ = G @ Q
    T = Q.mT @ GQ
    T = 0.5 * (T + T.mT)
    R = GQ - Q @ T
    # λ_max(D) for D = (I − QQᵀ) G (I − QQᵀ) (PSD): at most ‖D‖_F, with ‖D‖_F² = ‖G‖² − ‖T‖² − 2‖R‖² (which cancels:
    # hence the slack), and at most tr(D) = 1 − tr(T) (which does not)
    g2 = G.square().sum((-1, -2)) if g2 is None else g2
    d2 = g2 - T.square().sum((-1, -2)) - 2.0 * R.square().sum((-1, -2))
    trT = T.diagonal(dim1=-2, dim2=-1).sum(-1)
    dmax = torch.minimum((d2.clamp_min(0.0) + D2_SLACK).sqrt(), (1.0 - trT).clamp_min(0.0) + DTR_SLACK)
    lam_c = torch.linalg.eigvalsh(T[:, r:, r:])[:, -1] if r < Q.shape[2] else torch.zeros_like(d2)
    c = torch.maximum(lam_c, dmax) + R[:, :, r:].square().sum((-1, -2)).sqrt()
    Trr = T[:, :r, :r]
    gap = torch.linalg.eigvalsh(Trr)[:, 0] - c
    off = T[:, r:, :r].square().sum((-1, -2)) + R[:, :, :r].square().sum((-1, -2))
    bound = torch.where(gap > 0, off / gap.clamp_min(C.TINY), torch.full_like(gap, float("inf")))
    zero = G.diagonal(dim1=-2, dim2=-1).sum(-1) == 0
    return torch.where(zero, torch.zeros_like(bound), bound), Trr.diagonal(dim1=-2, dim2=-1).sum(-1)


def energy_error_bound(states: torch.Tensor, basis: torch.Tensor, rank: int) -> torch.Tensor:
    """A rigorous upper bound on the energy error of keeping ``basis[..., :rank]``, computed without an SVD.

    ``states [N, K, V]``; ``basis [N, K, w]`` orthonormal (w ≤ K), its first ``rank`` columns the kept directions.
    With the trace-1 Gram matrix ``G``, ``T = QᵀGQ``, ``R = (I − QQᵀ) G Q`` and ``D = (I − QQᵀ) G (I − QQᵀ)``, split at
    ``rank`` (r: kept, c: the rest of the basis):

        error ≤ (‖T_rc‖_F² + ‖R_r‖_F²) / (λ_min(T_rr) − c),   c = max(λ_max(T_cc), d) + ‖R_c‖_F,

    with d = min(sqrt(‖G‖_F² − ‖T‖_F² − 2‖R‖_F² + 1e-12), 1 − tr(T) + 1e-12) ≥ λ_max(D) (the first form cancels, hence
    its slack; the trace does not; the CUDA kernel's certificate takes the same d), when the denominator is positive,
    else ``inf``. Why: G ≼ diag(A + BᵀB/ε, C + εI) for any split
    G = [[A, Bᵀ], [B, C]] and ε > 0, so by Ky Fan the top-``rank`` energy is at most tr(A) + ‖B‖_F²/ε once
    λ_min(A) ≥ λ_max(C) + ε; here A = T_rr, B = [T_rc; R_r], λ_max(C) ≤ c (Weyl, λ_max(D) ≤ d). Float64 ``[N]``,
    relative to ‖S‖²_F like ``energy_error``; 0 for a zero state. A cut inside a cluster of singular values (no gap)
    is never certified. "Orthonormal" to rounding: a shifted Cholesky-QR's columns have norm² ≈ 1 − 1e-13, which
    costs the projection up to ~2e-13 of the energy that this bound does not include.
    Raises ValueError for a basis of the wrong shape or a rank outside 1..w.
    """
    X = as_batch(states).to(F64)
    Q = basis.to(device=X.device, dtype=F64)
    r = int(rank)
    if Q.dim() != 3 or Q.shape[0] != X.shape[0] or Q.shape[1] != X.shape[1] or not 1 <= r <= Q.shape[2]:
        raise ValueError(f"basis must be [N, K, w] = [{X.shape[0]}, {X.shape[1]}, w ≥ rank]; got "
                         f"{tuple(Q.shape)} for rank {rank}.")
    G, _ = normalised_gram(X)
    return bound_terms(G, Q, r)[0]


# ------------------------------------------------------------------------------ the subspace algorithm
def cholqr(Z: torch.Tensor) -> torch.Tensor:
    """One shifted Cholesky-QR: ``Z R⁻¹`` with ``RᵀR = ZᵀZ + CHOL_SHIFT·diag(ZᵀZ) + TINY·I`` (``Z [N, R, q]``
    float64). ``cholesky_ex`` succeeds for every finite block, so its ``info`` is never read; directions of ``Z``
    below ~sqrt(shift) of their column are damped rather than orthonormalised (the refill repairs them)."""
    Cm = Z.mT @ Z
    Cm.diagonal(dim1=-2, dim2=-1).mul_(1.0 + C.CHOL_SHIFT).add_(C.TINY)
    L, _ = torch.linalg.cholesky_ex(Cm)
    eye = torch.eye(Cm.shape[-1], dtype=Cm.dtype, device=Cm.device).expand_as(Cm)
    return Z @ torch.linalg.solve_triangular(L.mT, eye, upper=True)


def checked_cholqr(Z: torch.Tensor, check) -> torch.Tensor:
    """``Z`` as it is where its shifted Gram matrix is within ``ORTH_TOL`` of the identity in every entry of its
    leading ``check × check`` block (``check`` an int or a per-state tensor ``[N]``), ``cholqr(Z)`` elsewhere (a NaN
    never passes; ``check = 0`` always factorises). ``Z [N, K, q]`` float64."""
    q = Z.shape[-1]
    Cm = Z.mT @ Z
    Cm = Cm + torch.diag_embed(Cm.diagonal(dim1=-2, dim2=-1) * C.CHOL_SHIFT + C.TINY)
    dev = (Cm - torch.eye(q, dtype=Cm.dtype, device=Cm.device)).abs()
    idx = torch.arange(q, device=Z.device)
    chk = torch.as_tensor(check, device=Z.device).reshape(-1, 1, 1)
    lead = (idx[None, :, None] < chk) & (idx[None, None, :] < chk)
    dev = torch.where(lead, dev, torch.zeros_like(dev))
    ok = (dev <= C.ORTH_TOL).all(-1).all(-1) & (chk.reshape(-1) > 0)
    redo = torch.nonzero(~ok).flatten()  # factorise only the blocks that need it (a host sync)
    if redo.numel() == 0:
        return Z
    if redo.numel() == Z.shape[0]:
        return cholqr(Z)
    return Z.index_copy(0, redo, cholqr(Z.index_select(0, redo)))


def deflate(G: torch.Tensor, U: torch.Tensor, zscale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Between the passes: ``G ← (I − UUᵀ) G (I − UUᵀ) = G − UYᵀ − YUᵀ``, ``Y = GU − ½ U (UᵀGU)``, renormalised to
    trace 1 (0 where nothing is left), and the sketch scale ``zscale`` (``[N, 1, 1]``, 1/‖S_p‖_F) with it.
    ``G [N, K, K]``, ``U [N, K, q]`` float64 (unused columns zero)."""
    GU = G @ U
    Y = GU - 0.5 * U @ (U.mT @ GU)
    G2 = G - U @ Y.mT - Y @ U.mT
    t2 = G2.diagonal(dim1=-2, dim2=-1).sum(-1)[:, None, None]
    ok = t2 > 0
    t2 = torch.where(ok, t2, torch.ones_like(t2))
    return (G2 * torch.where(ok, 1.0 / t2, torch.zeros_like(t2)),
            zscale * torch.where(ok, t2.rsqrt(), torch.zeros_like(t2)))


class Subspace(NamedTuple):
    """What ``subspace_truncate`` computed: ``out`` (float64 ``[N, K, V]``), ``U`` (float64 ``[N, K, 32]``, the kept
    directions, unused columns zero) and ``ritz`` (float64 ``[N, K, 32]``: the last pass's Ritz vectors, descending,
    the kept ones first); ``gram`` the trace-1 Gram matrices ``[N, K, K]``."""
    out: torch.Tensor
    U: torch.Tensor
    ritz: torch.Tensor
    gram: torch.Tensor


def subspace_pass(S: torch.Tensor, r: int, iters: int) -> torch.Tensor:
    """One pass from the start on ``S [N, K, V]`` (float64) with ``iters`` filter steps: its 32 Ritz vectors
    ``[N, K, 32]``, descending (the bound's tests take it as a basis)."""
    return subspace_truncate(S, torch.full((S.shape[0],), min(int(r), C.HALF)), iters=iters).ritz


@torch.no_grad()
def subspace_truncate(states: torch.Tensor, ranks: torch.Tensor, *, iters: int | None = None) -> Subspace:
    """The CUDA kernel's algorithm (module docstring) in batched float64 torch.

    ``states [N, K, V]`` any float dtype (K ≥ 32); ``ranks`` integer tensor ``[N]`` on the same device, each in
    1 … 32 or ≥ min(K, V) (validated by the caller; others give NaN states, as in the kernel); ``iters``: filter steps
    of every pass (default ``iterations_for(r, p)`` per state and pass). States with ranks ≥ min(K, V) come back
    unchanged. Reads the per-state step counts on the host (one sync on CUDA)."""
    S = states.to(F64)
    N, K, V = S.shape
    m, q, h = min(K, V), C.BLOCK, C.HALF
    r = ranks.to(device=S.device, dtype=torch.long).reshape(N)
    omega, fill, table = C.start_matrices(K, V, S.device)
    G0, inv = normalised_gram(S)
    G = G0
    npass = 1 + (r > h).long()
    passes = 2 if bool((npass > 1).any()) else 1
    U = torch.zeros(N, K, q, dtype=F64, device=S.device)
    zscale = inv
    cols = torch.arange(q, device=S.device)
    ritz = U
    for p in range(passes):
        act = None if p == 0 or bool((npass > p).all()) else (npass > p)[:, None, None]
        Z = S @ omega[p]
        Z = (Z - U @ (U.mT @ Z)) * zscale if p else Z * zscale
        Qb = cholqr(Z)
        n_it = (table.to(torch.long)[(C.MAX_RANK + 1) * p + r.clamp(0, C.MAX_RANK)] if iters is None
                else torch.full_like(r, int(iters)))
        for i in range(int(n_it.max()) if N else 0):
            step = cholqr(G @ (G @ Qb))
            Qb = step if bool((n_it > i).all()) else torch.where((n_it > i)[:, None, None], step, Qb)
        w = (1.0 - Qb.square().sum(-2, keepdim=True)).clamp_min(0.0).sqrt()
        Qb = checked_cholqr(checked_cholqr(Qb + (C.FILL * w) * fill[p], q), q)
        d, W = torch.linalg.eigh(Qb.mT @ (G @ Qb))
        before = (d[:, :, None] > d[:, None, :]) | ((d[:, :, None] == d[:, None, :])
                                                     & (cols[:, None] < cols[None, :]))
        rk = before.sum(1)  # [N, q]: descending rank of eigenvalue i (a permutation)
        Y = Qb @ W.gather(2, torch.argsort(rk, dim=1)[:, None, :].expand(N, q, q))  # Ritz vectors, descending
        take = torch.minimum(r - h * p, torch.full_like(r, h))
        new = (Y * (cols[None, :] < take[:, None])[:, None, :].to(F64)).roll(h * p, dims=-1)
        if act is None:
            ritz, U = Y, U + new
        else:
            ritz, U = torch.where(act, Y, ritz), torch.where(act, U + new, U)
        if p + 1 < passes:
            G, zscale = deflate(G, U, zscale)
    kept = r.clamp(0, q)
    if passes > 1:
        two = torch.nonzero(npass > 1).flatten()
        U = U.index_copy(0, two, checked_cholqr(checked_cholqr(U.index_select(0, two), kept.index_select(0, two)),
                                                 kept.index_select(0, two)))
    w = max(int(kept.max()), 1) if N else 1
    out = U[..., :w] @ (U[..., :w].mT @ S)
    bad = ((r < 1) | (r > 2 * h)) & (r < m)
    out = torch.where(bad[:, None, None], torch.full_like(out, float("nan")), out)
    return Subspace(torch.where((r >= m)[:, None, None], S, out), U, ritz, G0)


def certificate(X: torch.Tensor, res: Subspace, ranks: list[int]) -> torch.Tensor:
    """An upper bound on each state's energy error in ``res`` (float64 ``[N]``): ``bound_terms`` on the basis [kept
    directions | the last pass's other Ritz vectors] (one pass: the Ritz vectors themselves; two: orthonormalised),
    plus the energy that basis keeps beyond the answer's; or the energy the answer misses, where smaller. ``X [N, K, V]`` float64; ``ranks`` the N host ranks
    (each < min(K, V), ≤ 32). Groups by rank on the host."""
    N = X.shape[0]
    G = res.gram
    g2 = G.square().sum((-1, -2))
    got = retained_energy(X, res.out)
    out = torch.empty(N, dtype=F64, device=X.device)
    for r in sorted(set(ranks)):
        idx = torch.tensor([i for i, x in enumerate(ranks) if x == r], device=X.device)
        if r <= C.HALF:
            Q = res.ritz.index_select(0, idx)
        else:
            rest = res.ritz.index_select(0, idx)[..., r - C.HALF:]
            Q = torch.cat([res.U.index_select(0, idx)[..., :r], rest], dim=-1)
            Q = checked_cholqr(checked_cholqr(Q, Q.shape[-1]), Q.shape[-1])
        bound, kept = bound_terms(G.index_select(0, idx), Q, r, g2.index_select(0, idx))
        g = got.index_select(0, idx)
        out.index_copy_(0, idx, bound + (kept - g).clamp_min(0.0))
    # the energy the answer misses bounds its error too (E_opt ≤ 1): it certifies states whose tail is tiny
    return torch.minimum(out, (1.0 - got).clamp_min(0.0) + DTR_SLACK)
