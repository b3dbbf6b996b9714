"""Top-r truncation of many Gated DeltaNet head states at once.

A GDN head carries a state ``S`` of shape ``[K, V]`` (key space × value space; ``K = V = 128`` in Qwen3.5).
Truncating it to rank ``r`` replaces ``S`` by its projection onto its top-``r`` *left* singular directions,

    S_r = U_r U_rᵀ S,

which is also the best rank-``r`` approximation of ``S`` (Eckart–Young). The probe applies it at every segment
boundary to every head of the model (18 layers × 16 heads = 288 states for Qwen3.5-0.8B), so it has to be batched
and cheap: an exact batched SVD of 288 states of 128×128 costs about 1.3 s on an H200.

Method (``truncate_states``, ``method="auto"``, rank ≤ 32, K ≥ 64)
--------------------------------------------------------------------
Block subspace iteration in float64 on the Gram matrix ``G = S Sᵀ / ‖S‖²_F`` (``[N, K, K]``, trace 1):

1. start block ``Z₀ = S Ω`` with a fixed, seeded Gaussian ``Ω`` (``[V, q]``, q = 32) — a randomised range finder,
   deterministic, no random generator inside the call — orthonormalised by Cholesky-QR twice;
2. ``iters`` steps ``Q ← cholqr(P Q)`` with ``P = G²`` formed once (one step = two powers of ``G`` for one
   orthonormalisation; degree 2 keeps the dynamic range of ``P`` at (λ₁/λⱼ)², which only loses directions below
   ~1e-8 of the top energy — harmless for the energy criterion). Optionally (``_FILTER = "chebyshev"``) ``P`` is the
   degree-2 Chebyshev filter ``(G − b/2)² − b²/8`` on ``[0, b]``, b from a first Rayleigh–Ritz step: ~1 step
   fewer and faster on flat spectra, for one more ``eigh`` per pass;
3. a final Cholesky-QR², with the columns the shifted Cholesky damped (rank-deficient and zero states) refilled by
   fixed random directions, so the basis is orthonormal for every state; then one Rayleigh–Ritz step (``eigh`` of
   the 32×32 ``QᵀGQ``) picks the top-``r`` Ritz vectors ``U_r``, and the answer is ``U_r (U_rᵀ S)`` from the
   original float64 state.

One pass finds at most 16 directions with its 32-column block: oversampling ≥ 16 is what makes the *energy*
converge fast without a gap at r, and a 32×32 Rayleigh quotient is cheap for the batched eigensolver (the Triton
Jacobi kernel on CUDA, see below; ``torch.linalg.eigh`` batches on CUDA only up to 32×32). For 16 < r ≤ 32 a
second pass runs on the deflated state ``S − U₁₆U₁₆ᵀS`` and the two bases are joined. Ranks > 32 (or K < 64) use
the exact float64 ``eigh`` of ``S Sᵀ``.

Accuracy: the retained energy ``‖S_r‖²_F`` is within 1e-5 of the exact one, relative to ``‖S‖²_F``, for every state
of the test batteries — clustered and repeated singular values (σ_r = σ_{r+1}: the truncation is not unique, its
energy is), rank-deficient and zero states, condition numbers to 1e16, GDN-like decaying spectra (effective rank
3–40) and states of a toy gated delta rule (effective rank up to ~95). ``_ITERS`` was calibrated on those to reach
≤ 1e-6 (≥ 10× margin; typically 1e-8). Nearly flat spectra (effective rank ≳ 100, e.g. i.i.d. Gaussian matrices,
flatter than any measured GDN head) converge more slowly: up to ~1e-5 at the default counts.

Cholesky-QR uses ``torch.linalg.cholesky_ex`` with a relative diagonal shift (``C + s·diag(C)``, s = 1e-13), so the
factorisation succeeds for every finite block — rank-deficient ones included — without reading ``info`` on the host.

Host synchronisation and CUDA graphs
------------------------------------
No ``.item()``, no data-dependent Python branch, no data-dependent shape: iteration counts and block sizes depend
only on the host-side rank, and the start matrices are cached per device (the first call on a device copies them
host→device, so call once before capturing a graph). The Rayleigh–Ritz ``eigh`` of the 32×32 ``QᵀGQ`` runs, on
CUDA, in a Triton kernel (``gdnviz.gpu.jacobi.eigh_jacobi``: cyclic parallel Jacobi, one program per matrix, the
convergence test inside the kernel) instead of ``torch.linalg.eigh``, whose ``info`` check
(``infos.any().item()``, ``at::_linalg_check_errors``) syncs the host once per call and so made CUDA-graph capture
of the subspace path impossible. The Cholesky factorisations call ``cholesky_ex`` without its error check and
``solve_triangular`` has none, so neither reads anything back. On an H200 (``bench/bench_truncate.py``,
bench/RESULTS.md) ``torch.cuda.set_sync_debug_mode`` finds no host sync in the subspace path, and the whole call is
captured in a CUDA graph and replayed (1.2–1.4 ms per 288 states for r ≤ 12 with torch's Cholesky-QR kernels;
1.05–1.19 ms with the CUDA Cholesky-QR kernel, the default, in the sixth session). ``tests/test_jacobi.py`` has CUDA
tests for both. The exact paths (``"eigh"``, ``"svd"``, ranks > 32, K < 64) still call ``torch.linalg.eigh`` / ``svd`` on
large matrices and sync. On CPU the Rayleigh–Ritz step keeps ``torch.linalg.eigh``. ``bench/bench_truncate.py``
reports where the first sync happens and whether capture works.

Per-head ranks must be known on the host (validation, grouping): pass a list or a CPU tensor (a CUDA rank tensor
costs one device→host copy). States are grouped by path (unchanged / subspace / exact); inside a group the basis is
computed for the group's largest rank and each state keeps its own leading ``r_i`` Ritz vectors (a mask).
"""

from __future__ import annotations

import operator
import os
from collections.abc import Sequence

import torch

from gdnviz.errors import RankOutOfRange

__all__ = [
    "truncate_states",
    "exact_truncate",
    "retained_energy",
    "energy_error",
    "energy_error_bound",
    "iterations_for",
    "pass_iterations",
    "SUBSPACE_MAX_RANK",
]

SUBSPACE_MAX_RANK = 32  # above this, "auto" uses an exact decomposition
_STAGE_RANK = 16  # directions found per subspace pass (block of _BLOCK columns)
_BLOCK = 32  # block width q: the size of the Rayleigh–Ritz eigh (the Jacobi kernel takes ≤ 64)
_MIN_K_SUBSPACE = 2 * _BLOCK  # below this the exact eigh of the K×K Gram is as cheap
_CHOL_SHIFT = 1e-13  # relative diagonal shift of Cholesky-QR
_FILL = 1e-6  # size of the refill of damped basis columns (relative to a unit column)
_TINY = 1e-300  # absolute floor: zero columns / zero states stay finite
# Tests only: "cholqr" makes _cholqr run the Triton kernel (gdnviz.gpu.cholqr) in the interpreter on CPU.
_TRITON_INTERPRET = os.environ.get("GDNVIZ_TEST_TRITON_CHOLQR", "") if os.environ.get("TRITON_INTERPRET") == "1" else ""
_FILTER = "power"  # "power": P = G² (one eigh per pass); "chebyshev": degree-2 Chebyshev (two eigh per pass)

# Filter steps (each = 2 powers of G) per pass, by the largest rank of the pass (ranks > 16: two passes, the first
# with the count of r = 16). Calibrated so the worst energy error on the hard batteries and toy-GDN states is ≤ 1e-6.
_ITERS = {
    "power": ((2, 3), (8, 4), (12, 5), (16, 6)),
    "chebyshev": ((2, 3), (8, 4), (16, 5)),
}
# Filter steps of the second pass (ranks 17 … 32), calibrated the same way (bench/study_pass2_warm.py, seventeenth
# session: with 6 then 4 steps the batteries' worst error is 7.6e-7 at r = 32 and ≤ 2.2e-7 at r = 17, 20, 24, 28;
# with 6 then 3 it is 1.0e-5 at r = 32). The second pass's cut is the state's r-th direction, but everything above
# the first 16 is gone from its Gram matrix, so its block of 32 spans directions 17 … 48 and needs fewer steps.
_PASS2_ITERS = 4


def iterations_for(rank: int, pass_index: int = 0) -> int:
    """Filter steps that ``truncate_states`` runs in pass ``pass_index`` (0 or 1) for a largest rank ``rank`` ≤ 32.

    Ranks above 16 take two passes (16 directions, then ``rank − 16`` of the deflated state): the first with the
    count of a 16-direction pass, the second with ``_PASS2_ITERS`` (at most the first's).
    """
    r = min(int(rank), _STAGE_RANK)
    table = _ITERS[_FILTER]
    k = next((k for upper, k in table if r <= upper), table[-1][1])
    return min(k, _PASS2_ITERS) if pass_index else k


def pass_iterations(rank: int) -> tuple[int, int]:
    """``(pass 1, pass 2)`` filter steps for a largest rank ``rank`` ≤ 32 (the second unused for ranks ≤ 16)."""
    return iterations_for(rank, 0), iterations_for(rank, 1)


# --------------------------------------------------------------------------------------------- helpers
_GAUSS_CACHE: dict[tuple, torch.Tensor] = {}


def _gaussian(rows: int, cols: int, device: torch.device, seed: int, unit_columns: bool = False) -> torch.Tensor:
    """A fixed float64 Gaussian matrix, cached per device (created once, outside any CUDA-graph capture)."""
    key = (rows, cols, str(device), seed, unit_columns)
    t = _GAUSS_CACHE.get(key)
    if t is None:
        g = torch.Generator().manual_seed(seed)
        t = torch.randn(rows, cols, generator=g, dtype=torch.float64)
        if unit_columns:
            t = t / t.norm(dim=0, keepdim=True)
        t = t.to(device)
        _GAUSS_CACHE[key] = t
    return t


def _eye(n: int, device: torch.device) -> torch.Tensor:
    """Cached float64 identity (no fill kernel per call)."""
    key = ("eye", n, str(device))
    t = _GAUSS_CACHE.get(key)
    if t is None:
        t = _GAUSS_CACHE[key] = torch.eye(n, dtype=torch.float64, device=device)
    return t


def _normalised_gram(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``G = X Xᵀ / ‖X‖²_F`` ([N, K, K], trace 1, or 0 for a zero state) and ``1/‖X‖_F`` ([N, 1, 1], 0 if zero).

    Normalising the small Gram matrix in place instead of ``X`` saves two passes over ``[N, K, V]`` (CPU-bound
    there). float64 inputs with entries beyond ~1e±150 would over/underflow ``X Xᵀ``; float32/bf16 states cannot.
    """
    G = X @ X.mT
    tr = G.diagonal(dim1=-2, dim2=-1).sum(-1)[:, None, None]
    # torch.where instead of a Python branch on zero states: no host sync.
    inv = torch.where(tr > 0, tr.rsqrt(), torch.zeros_like(tr))
    G.mul_(inv * inv)
    return G, inv


def _cholqr(Z: torch.Tensor) -> torch.Tensor:
    """One shifted Cholesky-QR pass: ``Z R⁻¹`` with ``RᵀR = ZᵀZ + s·diag(ZᵀZ) + tiny·I``.

    The relative shift equals the usual shifted CholQR of the column-normalised block (Cholesky is invariant under
    diagonal scaling), so graded columns are fine. It makes ``cholesky_ex`` succeed for every finite block, so its
    ``info`` is never read (reading it would sync the host). Directions of ``Z`` below ~sqrt(s) of their column are
    damped rather than orthonormalised; ``_refill`` repairs them where orthonormality matters.

    On CUDA a float64 ``[N, 64|128, 32]`` block goes through one NVRTC-compiled kernel with the same definition
    (``gdnviz.gpu.cuda_cholqr``, its register/shuffle form by default; ``GDNVIZ_CUDA_CHOLQR=smem`` picks its
    shared-memory form, ``=0`` keeps the torch kernels below).
    """
    if Z.is_cuda:
        from gdnviz.gpu import cuda_cholqr as _cc

        # one CUDA launch instead of ~7 kernels (compiled on first use; None if NVRTC is unavailable)
        if _cc.enabled() and _cc.supports(Z) and _cc._kernel(Z.shape[1], Z.device) is not None:
            return _cc.cholqr(Z, _CHOL_SHIFT, _TINY)
    if Z.is_cuda or _TRITON_INTERPRET:
        from gdnviz.gpu import cholqr as _tc  # lazy: imports triton

        if (_tc.enabled() or _TRITON_INTERPRET == "cholqr") and _tc.supports(Z):
            return _tc.cholqr(Z, _CHOL_SHIFT, _TINY)
    C = Z.mT @ Z
    d = C.diagonal(dim1=-2, dim2=-1)
    d.mul_(1.0 + _CHOL_SHIFT).add_(_TINY)
    L, _info = torch.linalg.cholesky_ex(C)  # no check_errors: stays on the device
    # R⁻¹ on the small q×q factor, then one batched GEMM (cheaper than a right-sided trsm on [N, K, q]).
    Rinv = torch.linalg.solve_triangular(L.mT, _eye(C.shape[-1], C.device).expand_as(C), upper=True)
    return Z @ Rinv


def _refill(Q: torch.Tensor, seed: int) -> torch.Tensor:
    """Orthonormal basis from a nearly orthonormal one whose damped columns are refilled with fixed random directions.

    A column of norm < 1 after shifted Cholesky-QR is (partly) a direction the block did not contain (rank-deficient
    or zero state). Adding ``FILL·sqrt(1 − ‖q‖²)·ω`` touches good columns by ~1e-14 and gives damped ones a random
    direction, then Cholesky-QR² makes the block orthonormal to rounding. Without it the final basis would not be
    orthonormal for rank-deficient states and ``U Uᵀ`` would not be a projector.
    """
    N, K, q = Q.shape
    w = (1.0 - Q.square().sum(-2, keepdim=True)).clamp_min(0.0).sqrt()
    Q = Q + (_FILL * w) * _gaussian(K, q, Q.device, seed=seed, unit_columns=True)
    return _cholqr(_cholqr(Q))


def _eigh_small(T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``eigh`` of the batched q×q Rayleigh quotients (q ≤ 32): ascending values, vectors as columns.

    CUDA: the sync-free Triton Jacobi kernel (``gdnviz.gpu.jacobi``; ``torch.linalg.eigh`` would read its ``info``
    on the host). (A one-warp-per-matrix CUDA version of the same Jacobi was measured slower on an H200 in the sixth
    session — bench/RESULTS.md — and removed.) CPU: ``torch.linalg.eigh`` (LAPACK), without importing Triton —
    except under ``TRITON_INTERPRET=1``, where ``eigh_jacobi`` runs the kernel in the interpreter (tests)."""
    if T.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return torch.linalg.eigh(T)
    from gdnviz.gpu.jacobi import eigh_jacobi  # lazy: imports triton

    return eigh_jacobi(T)


def _ritz(Q: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rayleigh–Ritz on span(Q): (Ritz values, descending; Ritz vectors, same order). ``q ≤ 32``."""
    T = Q.mT @ (G @ Q)
    theta, W = _eigh_small(T)
    return theta.flip(-1), Q @ W.flip(-1)


def _subspace_pass(X: torch.Tensor, r: int, iters: int, warm: torch.Tensor | None, seed: int = 0) -> torch.Tensor:
    """One subspace pass: orthonormal ``[N, K, 32]`` basis of Ritz vectors sorted by Ritz value (top-r first).

    ``seed`` picks the fixed random sketch and refill matrices; the two passes of a rank > 16 use different ones (the
    same refill in both would put the second pass's refilled columns inside the first pass's span for zero states).
    """
    N, K, V = X.shape
    q = _BLOCK
    G, inv = _normalised_gram(X)
    omega = _gaussian(V, q, X.device, seed=12345 + seed)
    if warm is None:
        Z = (X @ omega) * inv
    else:
        # Warm start: one power step on the previous retained directions, and a fresh sketch for the rest of the
        # block, so a stale warm basis (a head that forgot everything) costs nothing but the saved iterations.
        c = min(warm.shape[-1], r)
        Z = torch.cat([G @ warm[..., :c], (X @ omega[:, : q - c]) * inv], dim=-1)
    Q = _cholqr(_cholqr(Z))
    if _FILTER == "chebyshev":
        theta, Q = _ritz(Q, G)
        # Filter interval [0, b]: b ≤ θ_q ≤ λ_q ≤ λ_r (Ritz values interlace); trace(G) − Σθ ≥ Σ_{i>q} λ_i ≥ λ_{q+1}.
        tail = (G.diagonal(dim1=-2, dim2=-1).sum(-1) - theta.sum(-1)).clamp_min(0.0)
        b = torch.minimum(theta[..., -1], tail).clamp_min(0.0)
        # P = (G − b/2)² − b²/8 = (b²/8)·T₂(2G/b − 1): shift the diagonal of G in place (the Ritz vectors of G − cI
        # are those of G, so G is not needed unshifted afterwards) and square it.
        G.diagonal(dim1=-2, dim2=-1).sub_(0.5 * b[:, None])
        P = G @ G
        P.diagonal(dim1=-2, dim2=-1).sub_((0.125 * b * b)[:, None])
    else:
        P = G @ G
    for _ in range(iters):  # fixed count: no convergence test, no host sync
        Q = _cholqr(P @ Q)
    Q = _refill(Q, seed=0x5EED + seed)
    _, Q = _ritz(Q, G)
    return Q


def _subspace_basis(X: torch.Tensor, r_max: int, iters: tuple[int, int], warm: torch.Tensor | None) -> torch.Tensor:
    """Orthonormal basis whose leading columns are the top Ritz vectors (descending), ``[N, K, 32 or 48]``;
    ``iters``: the filter steps of the two passes."""
    r1 = min(r_max, _STAGE_RANK)
    w1 = None if warm is None else warm[..., :r1]
    Q1 = _subspace_pass(X, r1, iters[0], w1)
    if r_max <= _STAGE_RANK:
        return Q1
    # Second pass on the deflated state: its top directions are the 17th.. of the original.
    U1 = Q1[..., :_STAGE_RANK]
    X2 = X - U1 @ (U1.mT @ X)
    r2 = r_max - _STAGE_RANK
    w2 = None if warm is None or warm.shape[-1] <= _STAGE_RANK else warm[..., _STAGE_RANK:r_max]
    Q2 = _subspace_pass(X2, r2, iters[1], w2, seed=1)
    # Ritz vectors of the deflated problem with non-zero Ritz value are ⊥ U1 already; refilled ones may not be.
    # Cholesky-QR² of the concatenation keeps U1 and orthogonalises the rest against it (well conditioned: the
    # refill directions are random, far from span(U1)).
    return _cholqr(_cholqr(torch.cat([U1, Q2], dim=-1)))


def _exact_basis(X: torch.Tensor, width: int) -> torch.Tensor:
    """Top-``width`` eigenvectors of ``G`` (float64 ``eigh``), descending. Exact path for r > 32 or small K."""
    G, _ = _normalised_gram(X)
    _, W = torch.linalg.eigh(G)
    return W.flip(-1)[..., :width]


def _project(X: torch.Tensor, U: torch.Tensor, r_max: int, ranks: torch.Tensor | None) -> torch.Tensor:
    """``U_r U_rᵀ X`` with the leading ``r`` columns (per-state ``ranks`` masks the columns of ``U[..., :r_max]``)."""
    Ur = U[..., :r_max]
    if ranks is not None:
        mask = torch.arange(r_max, device=U.device)[None, :] < ranks[:, None]
        Ur = Ur * mask[:, None, :].to(Ur.dtype)
    return Ur @ (Ur.mT @ X)


# ----------------------------------------------------------------------------------------- validation
def _rank_list(rank, n: int, m: int) -> tuple[int | None, list[int] | None]:
    """Validate ``rank``: (int, None) for one rank, (None, list) for per-state ranks. Raises RankOutOfRange."""
    if isinstance(rank, torch.Tensor):
        if rank.dtype.is_floating_point or rank.dtype.is_complex or rank.dtype == torch.bool:
            raise RankOutOfRange(f"Truncation ranks must be integers; got a {rank.dtype} tensor.")
        if rank.dim() == 0:
            return _rank_list(int(rank), n, m)
        if rank.numel() != n:
            raise ValueError(f"Per-state ranks must have one entry per state: got {rank.numel()} for {n} states.")
        values = rank.reshape(-1).tolist()  # one device→host copy if `rank` lives on a GPU
    elif (isinstance(rank, Sequence) and not isinstance(rank, (str, bytes))) or getattr(rank, "ndim", 0) > 0:
        values = rank.tolist() if hasattr(rank, "tolist") else list(rank)  # numpy arrays: Python scalars
        if len(values) != n:
            raise ValueError(f"Per-state ranks must have one entry per state: got {len(values)} for {n} states.")
    else:
        values = None
    if values is None:
        return _one_rank(rank, "Truncation rank", f"use a rank of {m} or more to keep states unchanged"), None
    return None, [_one_rank(v, f"Truncation rank of state {i}", f"use {m} or more to keep it unchanged")
                  for i, v in enumerate(values)]


def _one_rank(value, what: str, keep_hint: str) -> int:
    """``value`` as an int ≥ 1, or RankOutOfRange naming ``what`` (bools and non-integers are refused)."""
    if isinstance(value, bool):
        raise RankOutOfRange(f"{what} must be an integer ≥ 1; got {value!r}.")
    try:
        r = operator.index(value)
    except TypeError:
        raise RankOutOfRange(f"{what} must be an integer ≥ 1; got {value!r}.") from None
    if r < 1:
        raise RankOutOfRange(f"{what} must be at least 1 (got {r}); {keep_hint}.")
    return r


def _as_batch(states: torch.Tensor) -> torch.Tensor:
    if not isinstance(states, torch.Tensor):
        raise TypeError(f"states must be a torch.Tensor [N, K, V]; got {type(states).__name__}.")
    if states.dim() < 3:
        raise ValueError(f"states must have shape [N, K, V] (or [..., K, V]); got {tuple(states.shape)}.")
    if not states.dtype.is_floating_point:
        raise TypeError(f"states must be a floating-point tensor; got {states.dtype}.")
    return states.reshape(-1, *states.shape[-2:])


# ----------------------------------------------------------------------------------------------- API
@torch.no_grad()
def truncate_states(
    states: torch.Tensor,
    rank,
    *,
    method: str = "auto",
    warm_start: torch.Tensor | None = None,
    return_basis: bool = False,
    iters: int | None = None,
):
    """Project each state onto its top-``rank`` left singular directions.

    Args:
        states: ``[N, K, V]`` head states (key dim × value dim), any floating dtype, any device. Leading dims
            ``[..., K, V]`` are flattened to ``N`` and restored on output.
        rank: an ``int`` (same rank for every state) or ``N`` integers (list, tuple or integer tensor; pass a CPU
            tensor or a list to avoid a device→host copy). A rank ≥ ``min(K, V)`` returns that state unchanged
            (bit-identical). Ranks < 1 or non-integers raise ``RankOutOfRange``.
        method: ``"auto"`` (subspace iteration for r ≤ 32 and K ≥ 64, exact float64 ``eigh`` of ``S Sᵀ`` otherwise),
            ``"subspace"`` (force it; r ≤ 32), ``"eigh"`` (exact, eigh of ``S Sᵀ``), ``"svd"`` (exact, same as
            ``exact_truncate``).
        warm_start: optional float64 basis ``[N, K, c]`` returned by the previous call (``return_basis=True``) for
            the same heads; its leading columns seed the iteration. It does not change the iteration count unless
            ``iters`` is given (measured savings are small, see ``bench/bench_truncate.py``).
        return_basis: also return the orthonormal float64 basis ``[N, K, w]`` whose leading columns are the retained
            directions in decreasing energy (w = 32 or 48 on the subspace path; states returned unchanged get the
            first unit vectors as a placeholder).
        iters: override the number of filter steps of every pass (expert/benchmark use; default
            ``pass_iterations(r)``).

    Returns:
        The truncated states, same shape, dtype and device as ``states`` (computed in float64), or
        ``(truncated, basis)`` with ``return_basis=True``.

    Raises:
        RankOutOfRange: a rank < 1 or not an integer. ValueError / TypeError: malformed ``states``, ``warm_start``,
        ``method``, ``iters``, or a per-state rank list of the wrong length.
    """
    if method not in ("auto", "subspace", "eigh", "svd"):
        raise ValueError(f"method must be 'auto', 'subspace', 'eigh' or 'svd'; got {method!r}.")
    if iters is not None and (isinstance(iters, bool) or operator.index(iters) < 0):
        raise ValueError(f"iters must be a non-negative integer; got {iters!r}.")
    shape = states.shape
    S = _as_batch(states)
    N, K, V = S.shape
    m = min(K, V)
    r_int, r_list = _rank_list(rank, N, m)
    if warm_start is not None:
        if warm_start.dim() != 3 or warm_start.shape[0] != N or warm_start.shape[1] != K:
            raise ValueError(f"warm_start must be [N, K, c] = [{N}, {K}, c]; got {tuple(warm_start.shape)}.")
        warm_start = warm_start.to(device=S.device, dtype=torch.float64)

    if N == 0 or m == 0:
        out = states.clone()
        return (out, torch.zeros(N, K, 0, dtype=torch.float64, device=S.device)) if return_basis else out

    full_all = r_int >= m if r_int is not None else all(r >= m for r in r_list)
    if full_all:
        out = states.clone()
        if return_basis:
            return out, _placeholder_basis(N, K, min(_BLOCK, K), S.device)
        return out

    X = S.to(torch.float64)
    if r_int is not None:
        basis, out64 = _truncate_group(X, r_int, None, _path_of(method, r_int, m, K), warm_start, iters)
        out = out64.to(S.dtype)
    else:
        out, basis = _truncate_per_state(S, X, r_list, m, method, warm_start, iters)
    out = out.reshape(shape)
    return (out, basis) if return_basis else out


def _placeholder_basis(n: int, k: int, w: int, device) -> torch.Tensor:
    return torch.eye(k, w, dtype=torch.float64, device=device).expand(n, k, w).clone()


def _path_of(method: str, r: int, m: int, K: int) -> str:
    """'keep' (r ≥ min(K, V)), 'subspace', 'eigh' or 'svd' for one rank; depends on host values only."""
    if r >= m:
        return "keep"
    if method == "subspace":
        if r > SUBSPACE_MAX_RANK:
            raise ValueError(f"method='subspace' supports ranks ≤ {SUBSPACE_MAX_RANK}; got {r}. Use 'auto'.")
        if K <= _BLOCK:
            raise ValueError(f"method='subspace' needs K > {_BLOCK}; got K={K}. Use 'auto'.")
        return "subspace"
    if method == "auto":
        return "subspace" if (r <= SUBSPACE_MAX_RANK and K >= _MIN_K_SUBSPACE) else "eigh"
    return method


def _truncate_group(X, r_max, ranks_dev, path, warm_start, iters):
    """Truncate a float64 batch on one path (every rank < min(K, V)). Returns (basis, truncated float64)."""
    N, K, V = X.shape
    if path == "svd":
        U = torch.linalg.svd(X, full_matrices=False)[0]
    elif path == "eigh":
        U = _exact_basis(X, max(r_max, min(_BLOCK, K)))
    else:
        k = pass_iterations(r_max) if iters is None else (int(iters), int(iters))
        U = _subspace_basis(X, r_max, k, warm_start)
    return U, _project(X, U, r_max, ranks_dev)


def _truncate_per_state(S, X, r_list, m, method, warm_start, iters):
    """Per-state ranks: group the states by path (unchanged / subspace / exact) on the host; inside a group the basis
    is computed for the group's largest rank and each state keeps its own leading ``r_i`` columns (mask)."""
    N, K, V = S.shape
    dev = S.device
    paths = [_path_of(method, r, m, K) for r in r_list]
    groups = {}
    for i, p in enumerate(paths):
        if p != "keep":
            groups.setdefault(p, []).append(i)
    # Unchanged states are copied, never recomputed: bit-identical.
    out = S.clone() if len(groups) != 1 or len(next(iter(groups.values()))) != N else None
    parts, width = [], 0
    for p, g in groups.items():
        ranks = torch.tensor([r_list[i] for i in g], dtype=torch.long).to(dev, non_blocking=True)
        r_max = max(r_list[i] for i in g)
        if out is None:  # one group holds every state: no gather/scatter
            U, y = _truncate_group(X, r_max, ranks, p, warm_start, iters)
            return y.to(S.dtype), U
        idx = torch.tensor(g, dtype=torch.long).to(dev, non_blocking=True)
        ws = None if warm_start is None else warm_start.index_select(0, idx)
        U, y = _truncate_group(X.index_select(0, idx), r_max, ranks, p, ws, iters)
        out.index_copy_(0, idx, y.to(S.dtype))
        parts.append((idx, U))
        width = max(width, U.shape[-1])
    basis = _placeholder_basis(N, K, max(width, min(_BLOCK, K)), dev)
    for idx, U in parts:
        basis[..., : U.shape[-1]].index_copy_(0, idx, U)  # narrower bases keep placeholder columns after theirs
    return out, basis


@torch.no_grad()
def exact_truncate(states: torch.Tensor, rank) -> torch.Tensor:
    """Reference truncation with a float64 ``torch.linalg.svd``: ``U_r U_rᵀ S`` per state.

    ``states`` ``[N, K, V]`` (or ``[..., K, V]``), ``rank`` an int or N integers; returns the input dtype/device.
    Ranks ≥ min(K, V) return the state unchanged, like ``truncate_states``.
    """
    shape = states.shape
    S = _as_batch(states)
    N, K, V = S.shape
    m = min(K, V)
    r_int, r_list = _rank_list(rank, N, m)
    if N == 0 or m == 0:
        return states.clone()
    ranks = torch.tensor([r_int] * N if r_int is not None else r_list, dtype=torch.long)
    full = (ranks >= m).to(S.device)
    ranks = ranks.clamp_max(m).to(S.device)
    X = S.to(torch.float64)
    U = torch.linalg.svd(X, full_matrices=False)[0]
    y = _project(X, U, m, ranks).to(S.dtype)
    return torch.where(full[:, None, None], S, y).reshape(shape)


def retained_energy(original: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Fraction of the energy kept per state: ``‖truncated‖²_F / ‖original‖²_F`` as float64 ``[N]``.

    States are ``[N, K, V]`` (or ``[..., K, V]``, flattened). A zero original state counts as fully kept (1.0).
    """
    o = _as_batch(original).to(torch.float64).square().sum((-1, -2))
    t = _as_batch(truncated).to(torch.float64).square().sum((-1, -2))
    return torch.where(o > 0, t / torch.where(o > 0, o, torch.ones_like(o)), torch.ones_like(o))


def energy_error(original: torch.Tensor, truncated: torch.Tensor, rank) -> torch.Tensor:
    """``|‖S_r‖² − ‖S_r^exact‖²| / ‖S‖²`` per state (float64 ``[N]``), the exact energy from float64 singular values."""
    S = _as_batch(original).to(torch.float64)
    N, K, V = S.shape
    m = min(K, V)
    r_int, r_list = _rank_list(rank, N, m)
    ranks = torch.tensor([r_int] * N if r_int is not None else r_list, dtype=torch.long, device=S.device)
    s2 = torch.linalg.svdvals(S).square()
    keep = torch.arange(s2.shape[-1], device=S.device)[None, :] < ranks[:, None]
    exact = (s2 * keep).sum(-1)
    total = s2.sum(-1)
    got = _as_batch(truncated).to(torch.float64).square().sum((-1, -2))
    return torch.where(total > 0, (got - exact).abs() / torch.where(total > 0, total, torch.ones_like(total)), got)


def energy_error_bound(states: torch.Tensor, basis: torch.Tensor, rank: int) -> torch.Tensor:
    """A rigorous upper bound on the energy error of keeping ``basis[..., :rank]``, computed without an SVD.

    ``states [N, K, V]``; ``basis [N, K, w]`` orthonormal (w ≤ K; e.g. ``truncate_states(..., return_basis=True)``'s),
    its first ``rank`` columns the kept directions. With the trace-1 Gram matrix ``G`` of each state, ``T = QᵀGQ``,
    ``R = (I − QQᵀ) G Q`` and ``D = (I − QQᵀ) G (I − QQᵀ)`` (G's part outside span Q; formed explicitly: the identity
    ``‖D‖_F² = ‖G‖_F² − ‖T‖_F² − 2‖R‖_F²`` cancels to a noise floor of ~1e-7 in ‖D‖_F, which can over- or
    under-state a small ‖D‖_F — sixteenth session, ``bench/study_two_pass_certificate.py``), split the blocks at
    ``rank`` (r: kept, c: the rest of the basis):

        error ≤ (‖T_rc‖_F² + ‖R_r‖_F²) / (λ_min(T_rr) − c),   c = max(λ_max(T_cc), ‖D‖_F) + ‖R_c‖_F,

    when the denominator is positive, else ``inf``. Why: G ≼ diag(A + BᵀB/ε, C + εI) for any split
    G = [[A, Bᵀ], [B, C]] and ε > 0 (the difference is a square), so by Ky Fan the top-``rank`` energy is at most
    tr(A) + ‖B‖_F²/ε once λ_min(A) ≥ λ_max(C) + ε; here A = T_rr (the energy kept), B = [T_rc; R_r] and λ_max(C) ≤ c
    (Weyl, and λ_max(D) ≤ ‖D‖_F). Units: relative to ‖S‖²_F, like ``energy_error``; float64 ``[N]``; 0 for a zero
    state. It cannot certify a cut inside a cluster of singular values (no gap): such states need more iterations or
    an exact method (bench/study_stopping_bound.py, bench/RESULTS.md). "Orthonormal" to rounding: the bases of
    ``truncate_states`` come from a shifted Cholesky-QR whose columns have norm² ≈ 1 − 1e-13, which costs the
    projection up to ~2e-13 of the energy that this bound does not include (the CUDA kernel's certificate adds it:
    ``SCALE_SLACK``, seventeenth session).
    """
    X = _as_batch(states).to(torch.float64)
    Q = basis.to(device=X.device, dtype=torch.float64)
    r = int(rank)
    if Q.dim() != 3 or Q.shape[0] != X.shape[0] or Q.shape[1] != X.shape[1] or not 1 <= r <= Q.shape[2]:
        raise ValueError(f"basis must be [N, K, w] = [{X.shape[0]}, {X.shape[1]}, w ≥ rank]; got "
                         f"{tuple(Q.shape)} for rank {rank}.")
    G, _ = _normalised_gram(X)
    GQ = G @ Q
    T = Q.mT @ GQ
    T = 0.5 * (T + T.mT)
    R = GQ - Q @ T
    P = torch.eye(X.shape[1], dtype=X.dtype, device=X.device) - Q @ Q.mT
    d2 = (P @ G @ P).square().sum((-1, -2))
    lam_c = torch.linalg.eigvalsh(T[:, r:, r:])[:, -1] if r < Q.shape[2] else torch.zeros_like(d2)
    c = torch.maximum(lam_c, d2.sqrt()) + R[:, :, r:].square().sum((-1, -2)).sqrt()
    gap = torch.linalg.eigvalsh(T[:, :r, :r])[:, 0] - c
    off = T[:, r:, :r].square().sum((-1, -2)) + R[:, :, :r].square().sum((-1, -2))
    bound = torch.where(gap > 0, off / gap.clamp_min(1e-300), torch.full_like(gap, float("inf")))
    zero = G.diagonal(dim1=-2, dim2=-1).sum(-1) == 0
    return torch.where(zero, torch.zeros_like(bound), bound)
