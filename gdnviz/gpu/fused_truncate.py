"""Fused top-r truncation of many GDN head states: one Triton launch, one program per state, no host sync.

``truncate_fused(states, ranks)`` replaces every state ``S [K, V]`` (key × value; K, V ∈ {64, 128}, 128 × 128 in
Qwen3.5) by its projection onto its top-``r`` *left* singular directions, ``S_r = U_r U_rᵀ S`` — what
``gdnviz.truncate.truncate_states`` computes — for ranks 1 … 32 (ranks ≥ min(K, V) copy the state). Shapes:
states ``[N, K, V]`` (or ``[..., K, V]``) float32 / bfloat16 / float16 / float64, output the same shape, dtype and
device; ranks an int, N host integers, or an int32/int64 CUDA tensor ``[N]`` the kernel reads per program.

Why fused: the probe truncates at every segment boundary inside a per-layer loop (16 heads per call, 64 calls per
layer, 18 layers) replayed from a CUDA graph, so the latency of one call matters, not its throughput.
``truncate_states`` launches ~40 small batched kernels per call (GEMMs, Cholesky, triangular solves, the Jacobi
kernel), latency-bound at 16 states. Here one program holds everything of one state — ``S`` is read from global
memory (three times: for ``G``, for each pass's sketch, and for the final projection, all from cache) and the
result stored once; nothing else goes to global memory.

Algorithm (per program, all float64; the same method, start matrices and iteration counts as ``truncate_states``):

1. ``G = S Sᵀ / ‖S‖²_F`` ``[K, K]`` (trace 1; 0 for a zero state), kept in registers.
2. Pass p (one pass for r ≤ 16, two for 16 < r ≤ 32): sketch ``Z = S_p Ω_p / ‖S_p‖_F`` with the fixed Gaussian
   ``Ω_p [V, 32]`` of ``gdnviz.truncate`` (seed 12345 + p), one shifted Cholesky-QR, then ``iterations_for(r, p)``
   steps ``Q ← cholqr(G (G Q))`` (block q = 32: oversampling ≥ 16), a refill of damped columns by fixed unit
   directions (seed 0x5EED + p) and Cholesky-QR² (each of the two checked: ``checked_cholqr`` leaves a block that is
   orthonormal to ``ORTH_TOL`` as it is), and Rayleigh–Ritz: the eigenpairs of ``T = Qᵀ G Q`` (32 × 32)
   by the cyclic parallel Jacobi of ``gdnviz.gpu.jacobi`` (``jacobi_sweeps``, inlined into this program). The top
   ``min(r − 16p, 16)`` Ritz vectors (descending, ties by index) become columns ``16p …`` of ``U`` through a 0/1
   selection matrix (a ``tl.dot``, no sort, no gather).
3. Before pass 1, ``G ← (I − UUᵀ) G (I − UUᵀ)`` renormalised to trace 1 (the Gram matrix of the deflated state
   ``S − UUᵀS``), and the sketch is deflated the same way; after it, Cholesky-QR² of ``U`` (the second pass's
   refilled columns need not be ⊥ the first pass's), as ``truncate_states`` does, both checked over the first r
   columns (``truncate_states`` always runs both).
4. ``S_r = U (Uᵀ S)`` from the input state; unused columns of ``U`` are zero.

Shifted Cholesky-QR (``_cholqr``): ``Z L⁻ᵀ`` with ``L Lᵀ = ZᵀZ + 1e-13·diag(ZᵀZ) + 1e-300·I`` — the relative shift of
``gdnviz.truncate._cholqr``: every pivot is positive for any finite block, so rank-deficient and zero states never
fail and need no branch (zero in → zero out). One 32-step loop forms column j of ``L`` and row j of ``L⁻¹``.
Iteration counts per state and pass come from a cached table of ``gdnviz.truncate.iterations_for`` (``iters``
overrides them); the loops are ``while`` loops with per-program trip counts, so heads with different ranks share the
launch.

Precision: float64 throughout. Triton 3.6 accepts float64 ``tl.dot`` operands (``language/semantic.py``) and, for
sm_90, lowers them to float64 tensor-core MMA (``mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64``, checked on
the PTX of this kernel compiled offline with the installed Triton; the interpreter computes them with NumPy in
float64). ``input_precision="ieee"`` is passed everywhere; nothing is
TF32. float32 ``ieee`` products would run on the same 67 TFLOP/s of the H200's plain FMA units as float64 MMA, so
float32 would buy no speed and cost the margin at condition numbers to 1e16.

Accuracy (retained energy ``‖S_r‖²_F`` vs the exact float64-SVD one, relative to ``‖S‖²_F``; criterion 1e-5):
``reference_fused`` — this algorithm in batched float64 torch — on every state of tests/test_truncate.py's
batteries (clustered and repeated singular values at the cut, rank-deficient and zero states, condition numbers to
1e16, GDN-like spectra, toy gated-delta-rule states of effective rank up to ~95, states scaled by 1e±30) for
r ∈ {1, 2, 4, 8, 12, 16, 17, 20, 24, 32}: worst 1.4e-7 (toy GDN states at r = 16–24), typically 1e-13 – 5e-8, the
same as ``truncate_states`` (within 1e-7 state by state). The interpreted kernel equals ``reference_fused`` to 1e-12
in energy on the states it runs.

Verified where (tests/test_fused_truncate.py):

* CPU, Triton interpreter (``TRITON_INTERPRET=1``): the kernel on two states per rank r ∈ {1, 4, 12, 32} covering the
  batteries (energy ≤ 1e-5, equal to ``reference_fused``, ``S_r = P S`` for an orthogonal projector ``P`` of rank ≤ r
  to 1e-10), and one launch of float32 states with mixed per-state ranks, a zero state and a kept state.
* CPU, offline compile for sm_90a (Triton needs no GPU to compile): the kernel lowers to a cubin with 8 warps and
  128 KiB of shared memory (limit 227 KiB); float64 MMA, IEEE ``div.rn.f64`` / ``sqrt.rn.f64``, no TF32.
  ``ptxas -v`` reports 255 registers and ~5 KB of spill stores per thread (``G`` alone is 64 doubles per thread).
* Not verified here (no GPU on the development machine; ``@pytest.mark.gpu`` tests and ``bench/bench_truncate.py``
  cover them on an H200): results on CUDA, the absence of host syncs, CUDA-graph capture, and the speed. The target
  (~50–100 µs for 16 states) is an estimate: per state ~7.5 M float64 multiply-adds (r ≤ 16; ~2× for r > 16) on one
  SM's share of the float64 tensor cores, plus ~10 sequential 32-step Cholesky loops and 3–8 Jacobi sweeps of 31
  rounds; ``_NUM_WARPS`` has not been tuned.

On CUDA with ``gdnviz.gpu.cuda_truncate`` on (``GDNVIZ_CUDA_TRUNCATE``), ``truncate_fused`` runs that module's CUDA
kernel instead of the Triton one: the same algorithm and constants, one thread block of 256 threads per state with
``G`` in shared memory (bfloat16 / float16 states go through float32 there).

Host side: no ``.item()``, no data-dependent Python branch. Host-side ranks are validated (ValueError outside 1..32
unless ≥ min(K, V)); an int rank is a kernel argument; a rank list becomes one host→device copy. A CUDA rank tensor
is read only by the kernel, so a rank there outside 1..32 and below min(K, V) gives a NaN state (a loud answer
instead of a host check). The constant buffers (Ω, refill directions, iteration table) are created once per (K, V,
device) and cached: make the first call outside a graph capture. On CPU without the interpreter, or without Triton,
``truncate_fused`` runs ``reference_fused``.
"""
from __future__ import annotations

import operator
import os
from collections.abc import Sequence
from contextlib import nullcontext as _nullcontext

import torch

from gdnviz import truncate as _tr

try:
    import triton
    import triton.language as tl

    from gdnviz.gpu.jacobi import jacobi_sweeps
except Exception:  # pragma: no cover
    triton = None

__all__ = ["truncate_fused", "reference_fused", "uses_kernel", "MAX_RANK", "DIMS"]

MAX_RANK = 32  # largest rank the fused path truncates (ranks ≥ min(K, V) are copied)
DIMS = (64, 128)  # supported K and V
_HALF = 16  # directions kept per pass (ranks > 16: a second pass on the deflated state)
_BLOCK = 32  # block width q of each pass (oversampling ≥ 16)
_NUM_WARPS = 8
_SHIFT = _tr._CHOL_SHIFT  # relative diagonal shift of Cholesky-QR (1e-13)
_TINY = _tr._TINY  # absolute diagonal floor (1e-300): zero blocks stay finite
_FILL = _tr._FILL  # size of the refill of damped basis columns (1e-6)
# The pairs' checked Cholesky-QR (``checked_cholqr``; the refill's pair and the final U's pair, nineteenth session):
# a block whose shifted Gram matrix is within ORTH_TOL of the identity in every entry is left as it is — the
# factorisation would move it by ~ORTH_TOL / 2. The output of one Cholesky-QR of a well-conditioned block is within
# ~1e-13 (the shift); after the refill 48% (pass 1) and 87% (pass 2) of GDN-like states' blocks already are, after
# the pair's first call 60% / 90%, and the final U of a two-pass rank before its second call 100%
# (bench/RESULTS.md, nineteenth session). Orthonormal to 32·ORTH_TOL in norm: its effect on a retained energy is
# below 1e-10, against the criterion's 1e-5
ORTH_TOL = 1e-12
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

# Read once at import, like Triton itself (see gdnviz.gpu.jacobi).
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


if triton is not None:

    @triton.jit
    def _shifted_gram(Z, Q: tl.constexpr, SHIFT: tl.constexpr, TINY: tl.constexpr):
        """``ZᵀZ + SHIFT·diag(ZᵀZ) + TINY·I`` for ``Z [R, Q]`` float64 (the Cholesky-QR's Gram matrix)."""
        qq = tl.arange(0, Q)
        C = tl.dot(tl.trans(Z), Z, input_precision="ieee")
        return tl.where(qq[:, None] == qq[None, :], C * (1.0 + SHIFT) + TINY, C)

    @triton.jit
    def _cholqr(Z, Q: tl.constexpr, SHIFT: tl.constexpr, TINY: tl.constexpr):
        """Shifted Cholesky-QR of ``Z [R, Q]`` float64: ``Z L⁻ᵀ`` with ``L Lᵀ = ZᵀZ + SHIFT·diag(ZᵀZ) + TINY·I``."""
        return _cholqr_gram(Z, _shifted_gram(Z, Q, SHIFT, TINY), Q)

    @triton.jit
    def _cholqr_gram(Z, C, Q: tl.constexpr):
        """``Z L⁻ᵀ`` with ``L Lᵀ = C`` (``_shifted_gram(Z)``).

        One loop over the Q columns computes column j of ``L`` (right-looking update of the Gram matrix) and row j
        of ``L⁻¹`` (forward substitution: row j of ``L`` is complete once column j is), so the factor is never
        inverted separately. The shift makes every pivot positive for any finite ``Z`` (as in
        ``gdnviz.truncate._cholqr``); zero columns stay zero."""
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
        return tl.dot(Z, tl.trans(Li), input_precision="ieee")

    @triton.jit
    def _checked_cholqr(Z, check, Q: tl.constexpr, SHIFT: tl.constexpr, TINY: tl.constexpr, ORTH: tl.constexpr):
        """``_cholqr(Z)``, or ``Z`` itself where ``ZᵀZ + SHIFT·diag + TINY·I`` is within ``ORTH`` of the identity in
        every entry of its leading ``check × check`` block (``reference_fused``'s ``checked_cholqr``)."""
        qq = tl.arange(0, Q)
        rows = qq[:, None]
        cols = qq[None, :]
        C = _shifted_gram(Z, Q, SHIFT, TINY)
        dev = tl.abs(C - tl.where(rows == cols, 1.0, 0.0))
        lead = (rows < check) & (cols < check)
        bad = tl.sum(tl.where(lead & ~(dev <= ORTH), 1, 0))  # a NaN entry counts as bad
        return tl.where((bad == 0) & (check > 0), Z, _cholqr_gram(Z, C, Q))

    @triton.jit
    def _top_ritz(T, r_take, col0, Q: tl.constexpr, MAX_SWEEPS: tl.constexpr, TOL2: tl.constexpr,
                  SKIP: tl.constexpr):
        """Rayleigh–Ritz selection on the symmetric ``T [Q, Q]`` (lower triangle read): ``W Pm [Q, Q]`` whose
        columns ``col0 … col0 + r_take − 1`` are the eigenvectors of the ``r_take`` largest eigenvalues (descending,
        ties by index), the other columns zero."""
        qq = tl.arange(0, Q)
        rows = qq[:, None]
        cols = qq[None, :]
        T = tl.where(rows >= cols, T, tl.trans(T))
        d, W, _sweeps = jacobi_sweeps(T, MAX_SWEEPS, Q, TOL2, SKIP)
        # descending rank of eigenvalue i: #{j : d_j > d_i or (d_j = d_i and j < i)}
        before = (d[:, None] > d[None, :]) | ((d[:, None] == d[None, :]) & (rows < cols))
        rk = tl.sum(before.to(tl.int32), axis=0)  # by column i
        Pm = ((cols == col0 + rk[:, None]) & (rk[:, None] < r_take)).to(tl.float64)  # Pm[i, col0 + rank(i)] = 1
        return tl.dot(W, Pm, input_precision="ieee")

    @triton.jit(do_not_specialize=["rank", "rank_stride", "iters"])
    def _fused_kernel(S, OUT, RANKS, rank, rank_stride, OMEGA, FILLDIR, ITER_TAB, iters,
                      K: tl.constexpr, V: tl.constexpr, Q: tl.constexpr, HALF: tl.constexpr,
                      RANK_PTR: tl.constexpr, SHIFT: tl.constexpr, TINY: tl.constexpr, FILL: tl.constexpr,
                      MAX_SWEEPS: tl.constexpr, TOL2: tl.constexpr, SKIP: tl.constexpr, ORTH: tl.constexpr):
        """Truncate state ``pid`` of ``S [N, K, V]`` to its rank (see the module docstring)."""
        M: tl.constexpr = K if K < V else V
        pid = tl.program_id(0).to(tl.int64)
        kk = tl.arange(0, K)
        vv = tl.arange(0, V)
        qq = tl.arange(0, Q)
        offs = pid * K * V + kk[:, None] * V + vv[None, :]
        if RANK_PTR:
            r = tl.load(RANKS + pid * rank_stride).to(tl.int32)
        else:
            r = rank
        raw = tl.load(S + offs)
        if r >= M:
            tl.store(OUT + offs, raw)  # unchanged, bit for bit
        else:
            X = raw.to(tl.float64)
            G = tl.dot(X, tl.trans(X), input_precision="ieee")  # S Sᵀ [K, K]
            tr = tl.sum(X * X)
            inv = tl.where(tr > 0, 1.0 / tl.sqrt(tl.where(tr > 0, tr, 1.0)), 0.0)  # 1/‖S‖_F, 0 for a zero state
            G = G * (inv * inv)  # trace 1
            rc = tl.minimum(tl.maximum(r, 0), 2 * HALF)
            npass = 1 + (r > HALF).to(tl.int32)
            U = tl.zeros((K, Q), tl.float64)  # kept directions: pass p fills columns HALF·p …
            zscale = inv  # 1/‖S_p‖_F of the (deflated) state of pass p
            p = 0
            while p < npass:  # a while loop: runtime trip counts work the same compiled and interpreted
                om = tl.load(OMEGA + p * V * Q + vv[:, None] * Q + qq[None, :])
                Z = tl.dot(tl.load(S + offs).to(tl.float64), om, input_precision="ieee")  # S Ω_p [K, Q]
                Z = (Z - tl.dot(U, tl.dot(tl.trans(U), Z, input_precision="ieee"), input_precision="ieee")) * zscale
                Qb = _cholqr(Z, Q, SHIFT, TINY)
                n_it = tl.where(iters >= 0, iters, tl.load(ITER_TAB + p * (2 * HALF + 1) + rc))  # pass p's steps
                i = 0
                while i < n_it:  # two powers of G per orthonormalisation
                    GQ = tl.dot(G, Qb, input_precision="ieee")
                    Qb = _cholqr(tl.dot(G, GQ, input_precision="ieee"), Q, SHIFT, TINY)
                    i += 1
                # refill damped columns with fixed random directions, then Cholesky-QR²: orthonormal for every state
                w = tl.sqrt(tl.maximum(1.0 - tl.sum(Qb * Qb, axis=0), 0.0))
                fd = tl.load(FILLDIR + p * K * Q + kk[:, None] * Q + qq[None, :])
                Qb = _checked_cholqr(_checked_cholqr(Qb + (FILL * w)[None, :] * fd, Q, Q, SHIFT, TINY, ORTH), Q, Q,
                                     SHIFT, TINY, ORTH)
                T = tl.dot(tl.trans(Qb), tl.dot(G, Qb, input_precision="ieee"), input_precision="ieee")
                take = tl.minimum(r - HALF * p, HALF)
                U += tl.dot(Qb, _top_ritz(T, take, HALF * p, Q, MAX_SWEEPS, TOL2, SKIP), input_precision="ieee")
                if p + 1 < npass:
                    # deflate: G ← (I − UUᵀ) G (I − UUᵀ) = G − U Yᵀ − Y Uᵀ with Y = GU − ½ U (UᵀGU); trace 1 again
                    GU = tl.dot(G, U, input_precision="ieee")
                    Y = GU - 0.5 * tl.dot(U, tl.dot(tl.trans(U), GU, input_precision="ieee"), input_precision="ieee")
                    G = G - tl.dot(U, tl.trans(Y), input_precision="ieee") - tl.dot(Y, tl.trans(U),
                                                                                     input_precision="ieee")
                    t2 = tl.sum(tl.where(kk[:, None] == kk[None, :], G, 0.0))
                    ok = t2 > 0
                    t2 = tl.where(ok, t2, 1.0)
                    G = G * tl.where(ok, 1.0 / t2, 0.0)
                    zscale = zscale * tl.where(ok, 1.0 / tl.sqrt(t2), 0.0)
                p += 1
            if npass > 1:  # the second pass's refilled columns need not be ⊥ the first pass's
                kept = tl.minimum(tl.maximum(r, 0), Q)
                U = _checked_cholqr(_checked_cholqr(U, kept, Q, SHIFT, TINY, ORTH), kept, Q, SHIFT, TINY, ORTH)
            X = tl.load(S + offs).to(tl.float64)
            out = tl.dot(U, tl.dot(tl.trans(U), X, input_precision="ieee"), input_precision="ieee")
            bad = (r < 1) | (r > 2 * HALF)
            out = tl.where(bad, float("nan"), out)  # an invalid device-side rank: NaN, not a silent answer
            tl.store(OUT + offs, out.to(OUT.dtype.element_ty))


# --------------------------------------------------------------------------------------------- constants
_CONST: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _constants(K: int, V: int, device: torch.device):
    """(Ω [2, V, q], refill directions [2, K, q] (unit columns), iteration table int32 [2 × 33]: pass p's steps for
    rank r at 33 p + r) on ``device``: the matrices of ``gdnviz.truncate``'s two passes (same seeds), created once per
    (K, V, device) and cached, so a call inside a CUDA-graph capture allocates nothing and copies nothing."""
    key = (K, V, str(device))
    c = _CONST.get(key)
    if c is None:
        cpu = torch.device("cpu")
        omega = torch.stack([_tr._gaussian(V, _BLOCK, cpu, seed=12345 + p) for p in range(2)])
        fill = torch.stack([_tr._gaussian(K, _BLOCK, cpu, seed=0x5EED + p, unit_columns=True) for p in range(2)])
        table = torch.tensor([_tr.iterations_for(max(r, 1), p) for p in range(2) for r in range(MAX_RANK + 1)],
                             dtype=torch.int32)
        c = _CONST[key] = tuple(t.contiguous().to(device) for t in (omega, fill, table))
    return c


def uses_kernel(states: torch.Tensor) -> bool:
    """Whether ``truncate_fused`` runs the Triton kernel (CUDA, or CPU under ``TRITON_INTERPRET=1``) for ``states``;
    otherwise it runs ``reference_fused`` (float64 torch, the same algorithm)."""
    return triton is not None and (states.is_cuda or (_INTERPRET and states.device.type == "cpu"))


# -------------------------------------------------------------------------------------------- validation
def _check_states(states) -> torch.Tensor:
    """``states`` as ``[N, K, V]`` (leading dims flattened); ValueError/TypeError for what the kernel cannot take."""
    if not isinstance(states, torch.Tensor):
        raise TypeError(f"states must be a torch.Tensor [N, K, V]; got {type(states).__name__}.")
    if states.dim() < 3:
        raise ValueError(f"states must have shape [N, K, V]; got {tuple(states.shape)}.")
    K, V = states.shape[-2:]
    if K not in DIMS or V not in DIMS:
        raise ValueError(f"truncate_fused supports K, V in {DIMS}; got K={K}, V={V}. Use gdnviz.truncate.")
    if states.dtype not in _DTYPES:
        raise ValueError(f"truncate_fused takes float32, bfloat16, float16 or float64 states; got {states.dtype}.")
    return states.reshape(-1, K, V)


def _one_rank(v, what: str, m: int) -> int:
    if isinstance(v, bool):
        raise ValueError(f"{what} must be an integer; got {v!r}.")
    try:
        r = operator.index(v)
    except TypeError:
        raise ValueError(f"{what} must be an integer; got {v!r}.") from None
    if not (1 <= r <= MAX_RANK or r >= m):
        raise ValueError(f"{what} must be in 1..{MAX_RANK} (or ≥ min(K, V) = {m} to keep the state); got {r}.")
    return r


def _host_ranks(ranks, n: int, m: int) -> int | list[int]:
    """Validated host-side ranks: one int, or n ints."""
    if isinstance(ranks, torch.Tensor):
        if ranks.dtype.is_floating_point or ranks.dtype.is_complex or ranks.dtype == torch.bool:
            raise ValueError(f"ranks must be integers; got a {ranks.dtype} tensor.")
        if ranks.dim() == 0:
            return _one_rank(int(ranks), "rank", m)
        values = ranks.reshape(-1).tolist()
    elif isinstance(ranks, Sequence) and not isinstance(ranks, (str, bytes)):
        values = list(ranks)
    elif hasattr(ranks, "tolist") and getattr(ranks, "ndim", 0) > 0:  # numpy arrays
        values = ranks.tolist()
    else:
        return _one_rank(ranks, "rank", m)
    if len(values) != n:
        raise ValueError(f"ranks must have one entry per state: got {len(values)} for {n} states.")
    return [_one_rank(v, f"rank of state {i}", m) for i, v in enumerate(values)]


# --------------------------------------------------------------------------------------------------- API
@torch.no_grad()
def truncate_fused(states: torch.Tensor, ranks, *, iters: int | None = None) -> torch.Tensor:
    """Project each state onto its top-``r`` left singular directions, ``U_r U_rᵀ S``, in one kernel launch.

    Args:
        states: ``[N, K, V]`` (or ``[..., K, V]``) head states, K and V in {64, 128}; float32, bfloat16, float16 or
            float64. Computed in float64.
        ranks: an ``int``; or N integers as a list / tuple / numpy array / CPU tensor (validated on the host); or an
            integer CUDA tensor ``[N]`` (or 0-d, one rank for all) read by the kernel — never on the host, so not
            validated there: a device-side rank outside 1..32 that is below min(K, V) gives a NaN state. Ranks
            1..32 truncate; ranks ≥ min(K, V) return the state unchanged (bit-identical).
        iters: filter steps of every pass for every state (default: ``gdnviz.truncate.iterations_for(r, p)`` per
            state and pass p).

    Returns:
        The truncated states: same shape, dtype and device as ``states``.

    Raises:
        ValueError: unsupported shape or dtype, a host-side rank outside 1..32 and below min(K, V), a rank list of
        the wrong length, or a negative ``iters``. TypeError: ``states`` is not a tensor.

    Host synchronisation: none on CUDA — no ``.item()``, no data-dependent Python branch; the constant matrices are
    cached per device on the first call (make it outside a CUDA-graph capture). A rank list or CPU rank tensor is
    copied host→device (pass a CUDA rank tensor inside a captured graph).
    """
    if iters is not None and (isinstance(iters, bool) or operator.index(iters) < 0):
        raise ValueError(f"iters must be a non-negative integer; got {iters!r}.")
    X = _check_states(states)
    N, K, V = X.shape
    m = min(K, V)
    dev = X.device
    if isinstance(ranks, torch.Tensor) and ranks.is_cuda:
        if ranks.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"a CUDA rank tensor must be int32 or int64; got {ranks.dtype}.")
        if ranks.dim() > 1 or (ranks.dim() == 1 and ranks.numel() != N):
            raise ValueError(f"ranks must have one entry per state: got shape {tuple(ranks.shape)} for {N} states.")
        rank_t, rank_int, stride = ranks.to(dev), 0, (ranks.stride(0) if ranks.dim() == 1 else 0)
    else:
        host = _host_ranks(ranks, N, m)
        if isinstance(host, list) and host and all(r == host[0] for r in host):
            host = host[0]
        if isinstance(host, int) or not host:
            if not host or host >= m or N == 0:
                return states.clone()
            rank_t, rank_int, stride = None, host, 0
        else:
            if all(r >= m for r in host):
                return states.clone()
            rank_t = torch.tensor(host, dtype=torch.int32).to(dev, non_blocking=True)
            rank_int, stride = 0, 1
    if N == 0:
        return states.clone()
    X = X.contiguous()
    if not uses_kernel(X):
        r = rank_t if rank_t is not None else torch.full((N,), rank_int, dtype=torch.int32, device=dev)
        return reference_fused(X, r.expand(N), iters=iters).to(states.dtype).reshape(states.shape)
    if X.is_cuda:
        from gdnviz.gpu import cuda_truncate as _ct

        # the same algorithm as one CUDA kernel, one thread block per state (NVRTC; GDNVIZ_CUDA_TRUNCATE)
        if _ct.enabled():
            Xc = X if X.dtype in (torch.float32, torch.float64) else X.float()
            if _ct._kernel(K, V, Xc.dtype, dev) is not None:
                y = _ct.truncate_cuda(Xc, rank_t if rank_t is not None else rank_int, iters)
                return y.to(states.dtype).reshape(states.shape)
    omega, fill, table = _constants(K, V, dev)
    out = torch.empty_like(X)
    with torch.cuda.device(dev) if X.is_cuda else _nullcontext():  # Triton launches on the current device
        _fused_kernel[(N,)](
            X, out, rank_t if rank_t is not None else table, rank_int, stride, omega, fill, table,
            -1 if iters is None else int(iters), num_warps=_NUM_WARPS, **_launch_constexprs(K, V, rank_t is not None),
        )
    return out.reshape(states.shape)


def _launch_constexprs(K: int, V: int, rank_ptr: bool) -> dict:
    """The compile-time parameters of ``_fused_kernel`` for a launch (also used by the offline compile test)."""
    from gdnviz.gpu import jacobi

    return dict(K=K, V=V, Q=_BLOCK, HALF=_HALF, RANK_PTR=bool(rank_ptr), SHIFT=_SHIFT, TINY=_TINY, FILL=_FILL,
                MAX_SWEEPS=jacobi.MAX_SWEEPS, TOL2=jacobi.TOL * jacobi.TOL, SKIP=jacobi._SKIP, ORTH=ORTH_TOL)


# ------------------------------------------------------------------------------------ float64 reference
@torch.no_grad()
def checked_cholqr(Z: torch.Tensor, check) -> torch.Tensor:
    """The pairs' Cholesky-QR (after the refill, and of the final ``U``): ``Z`` as it is where its shifted Gram
    matrix ``C = ZᵀZ + SHIFT·diag(ZᵀZ) + TINY·I`` is within ``ORTH_TOL`` of the identity in every entry of its
    leading ``check × check`` block (``check`` an int or a per-state tensor ``[N]``), ``gdnviz.truncate._cholqr(Z)``
    elsewhere (a NaN never passes). ``Z [N, K, q]`` float64."""
    q = Z.shape[-1]
    C = Z.mT @ Z
    C = C + torch.diag_embed(C.diagonal(dim1=-2, dim2=-1) * _SHIFT + _TINY)
    dev = (C - torch.eye(q, dtype=C.dtype, device=C.device)).abs()
    idx = torch.arange(q, device=Z.device)
    chk = torch.as_tensor(check, device=Z.device).reshape(-1, 1, 1)
    lead = (idx[None, :, None] < chk) & (idx[None, None, :] < chk)
    dev = torch.where(lead, dev, torch.zeros_like(dev))
    ok = (dev <= ORTH_TOL).all(-1).all(-1) & (chk.reshape(-1) > 0)
    return torch.where(ok[:, None, None], Z, _tr._cholqr(Z))


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


def reference_fused(states: torch.Tensor, ranks: torch.Tensor, *, iters: int | None = None) -> torch.Tensor:
    """The kernel's algorithm in batched float64 torch (CPU fallback, and what the tests pin the kernel to).

    ``states [N, K, V]`` any float dtype, ``ranks`` int tensor ``[N]`` on the same device; returns float64
    ``[N, K, V]``. Same constants and steps as ``_fused_kernel``; the Cholesky factors come from
    ``torch.linalg.cholesky_ex`` / ``solve_triangular`` and the Ritz pairs from ``torch.linalg.eigh``, so the two
    agree to rounding, not bit for bit. Invalid ranks (< 1, or 33 … min(K, V) − 1) give NaN states, as in the
    kernel; ranks ≥ min(K, V) give the state unchanged.
    """
    S = states.to(torch.float64)
    N, K, V = S.shape
    m, q, h = min(K, V), _BLOCK, _HALF
    r = ranks.to(device=S.device, dtype=torch.long).reshape(N)
    omega, fill, table = _constants(K, V, S.device)
    G = S @ S.mT
    tr = G.diagonal(dim1=-2, dim2=-1).sum(-1)[:, None, None]
    inv = torch.where(tr > 0, tr.clamp_min(1e-300).rsqrt(), torch.zeros_like(tr))
    G = G * (inv * inv)
    npass = 1 + (r > h).long()
    U = torch.zeros(N, K, q, dtype=torch.float64, device=S.device)
    zscale = inv
    cols = torch.arange(q, device=S.device)
    for p in range(2):
        act = (npass > p)[:, None, None]
        Z = S @ omega[p]
        Z = (Z - U @ (U.mT @ Z)) * zscale
        Qb = _tr._cholqr(Z)
        n_it = (table.to(torch.long)[(MAX_RANK + 1) * p + r.clamp(0, MAX_RANK)] if iters is None
                else torch.full_like(r, int(iters)))
        for i in range(int(n_it.max())):
            Qb = torch.where((n_it > i)[:, None, None], _tr._cholqr(G @ (G @ Qb)), Qb)
        w = (1.0 - Qb.square().sum(-2, keepdim=True)).clamp_min(0.0).sqrt()
        Qb = checked_cholqr(checked_cholqr(Qb + (_FILL * w) * fill[p], q), q)
        T = Qb.mT @ (G @ Qb)
        d, W = torch.linalg.eigh(T)
        before = (d[:, :, None] > d[:, None, :]) | ((d[:, :, None] == d[:, None, :])
                                                     & (cols[:, None] < cols[None, :]))
        rk = before.sum(1)  # [N, q]: descending rank of eigenvalue i
        take = torch.minimum(r - h * p, torch.full_like(r, h))
        Pm = ((cols[None, None, :] == h * p + rk[:, :, None]) & (rk[:, :, None] < take[:, None, None])).double()
        U = torch.where(act, U + Qb @ (W @ Pm), U)
        if p == 0:
            G, zscale = deflate(G, U, zscale)
    kept = r.clamp(0, q)
    U = torch.where((npass > 1)[:, None, None], checked_cholqr(checked_cholqr(U, kept), kept), U)
    out = U @ (U.mT @ S)
    bad = ((r < 1) | (r > 2 * h)) & (r < m)
    out = torch.where(bad[:, None, None], torch.full_like(out, float("nan")), out)
    return torch.where((r >= m)[:, None, None], S, out)
