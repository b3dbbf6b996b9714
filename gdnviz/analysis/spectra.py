"""Rank statistics of a spectrum: numerical, effective and stable rank, retained energy (seed 000 §1).

Every function takes singular values ``sv: [..., n]`` (one spectrum per leading index: a head, a layer × head
grid, a document × layer × head cube), works in float64 over the last axis, and returns one number per spectrum
(shape ``sv.shape[:-1]``) as a float64 numpy array (a numpy scalar for a single spectrum). Torch tensors on any
device are accepted and converted; the exception is :func:`singular_values`, which returns the type it was given.

Singular values are dimensionless here in the sense that every statistic is invariant to a common scale of
``sv`` (multiplying the state by ``c > 0`` changes nothing). The order of ``sv`` does not matter for any
function (they use max, sum and sort), although :func:`singular_values` returns them descending.

Definitions (seed 000, to the letter):

* numerical rank: ``#{i : σ_i > σ_max · 128 · ε_f32}`` with ``ε_f32 = np.finfo(np.float32).eps = 2**-23``, so
  the threshold is ``σ_max · 2**-16 ≈ 1.53e-5 · σ_max``. 128 is the seed's fixed constant, not ``n``.
* effective rank: ``exp(-Σ_i p_i log p_i)`` with ``p_i = σ_i / Σ_j σ_j`` (natural log, ``0 log 0 = 0``).
* stable rank: ``Σ σ_i² / σ_max² = ‖S‖_F² / ‖S‖_2²``.
* energy in the top ``r``: ``Σ_{i≤r} σ_i² / Σ_i σ_i²`` over the ``r`` largest ``σ``.
* rank for an energy share ``q`` (e.g. 0.99): the smallest ``r ≥ 1`` with ``Σ_{i≤r} σ_i² ≥ q · Σ_i σ_i²``.

Zero spectra (``σ = 0``, the all-zero state) get: numerical rank 0, effective rank 0, stable rank 0, energy 1,
rank for any energy share 0.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import numpy as np

__all__ = [
    "RANK_TOL_FACTOR",
    "numerical_rank_threshold",
    "numerical_rank",
    "effective_rank",
    "stable_rank",
    "energy_top_r",
    "energy_curve",
    "rank_for_energy",
    "effective_rank_from_eigenvalues",
    "singular_values",
]

#: Seed 000: "singular values above σ_max · 128 · ε" with ε the float32 machine epsilon (fixed, not n).
RANK_TOL_FACTOR: float = 128.0 * float(np.finfo(np.float32).eps)


# --- conversion helpers (shared by the other analysis modules) ------------------------------------------------
def _is_torch(x: Any) -> bool:
    """True when ``x`` is a torch tensor (without importing torch when the caller never did)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _as_f64(x: Any) -> np.ndarray:
    """``x`` (numpy array, torch tensor on any device, list, scalar) as a float64 numpy array."""
    if _is_torch(x):
        return x.detach().to("cpu").to(dtype=sys.modules["torch"].float64).numpy()
    return np.asarray(x, dtype=np.float64)


def _out(x: np.ndarray):
    """Return 0-d arrays as numpy scalars, everything else unchanged."""
    return x[()] if isinstance(x, np.ndarray) and x.ndim == 0 else x


def _spectrum(sv: Any) -> np.ndarray:
    s = _as_f64(sv)
    if s.ndim == 0:
        raise ValueError("singular values must have at least one axis: [..., n]")
    return s


# --- statistics --------------------------------------------------------------------------------------------
def numerical_rank_threshold(sv: Any) -> np.ndarray:
    """The numerical-rank cut-off ``σ_max · 128 · ε_f32`` per spectrum (same units as ``sv``).

    Args: ``sv [..., n]``. Returns ``[...]`` float64.
    """
    s = _spectrum(sv)
    return _out(s.max(axis=-1) * RANK_TOL_FACTOR)


def numerical_rank(sv: Any) -> np.ndarray:
    """Numerical rank: the number of singular values strictly above ``σ_max · 128 · ε_f32``.

    ``ε_f32 = np.finfo(np.float32).eps = 2**-23``; the constant 128 is fixed by seed 000 (it is not ``n``), so
    the cut-off is ``σ_max · 2**-16 ≈ 1.526e-5 · σ_max``. A value exactly at the cut-off does not count.
    In a decaying recurrence this counts decayed residue: a direction written thousands of tokens ago is tiny
    but still above the float32 floor.

    Args:
        sv: singular values ``[..., n]`` (any order, ≥ 0).
    Returns:
        ``[...]`` int64 counts in ``0..n``. The zero matrix has numerical rank 0.
    """
    s = _spectrum(sv)
    thr = s.max(axis=-1, keepdims=True) * RANK_TOL_FACTOR
    return _out(np.sum(s > thr, axis=-1).astype(np.int64))


def effective_rank(sv: Any) -> np.ndarray:
    """Effective rank ``exp(-Σ_i p_i log p_i)`` with ``p_i = σ_i / Σ_j σ_j`` (natural log, ``0 log 0 = 0``).

    The exponential of the Shannon entropy of the normalised singular values: ``n`` for a flat spectrum of
    ``n`` equal values, 1 for a single nonzero value (one outer product), 2 for two equal ones. It asks how
    many directions carry the norm (seed 000 §1); it lies in ``[1, n]`` for a nonzero spectrum.

    Args:
        sv: singular values ``[..., n]`` (any order, ≥ 0). For a covariance's eigenvalues use
            :func:`effective_rank_from_eigenvalues`.
    Returns:
        ``[...]`` float64 (directions, not necessarily an integer). The zero matrix (``Σσ = 0``) is defined
        as effective rank 0 (the entropy is undefined there; 0 keeps "no directions in use" distinguishable
        from the minimum 1 of any nonzero state).
    """
    s = _spectrum(sv)
    total = s.sum(axis=-1, keepdims=True)
    zero = total == 0
    with np.errstate(invalid="ignore", divide="ignore"):
        p = s / np.where(zero, 1.0, total)
        plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
        plogp = np.where(np.isnan(p), np.nan, plogp)
    er = np.exp(-plogp.sum(axis=-1))
    return _out(np.where(zero[..., 0], 0.0, er))


def stable_rank(sv: Any) -> np.ndarray:
    """Stable rank ``Σ_i σ_i² / σ_max² = ‖S‖_F² / ‖S‖_2²``.

    Args:
        sv: singular values ``[..., n]`` (any order, ≥ 0).
    Returns:
        ``[...]`` float64 in ``[1, n]`` for a nonzero spectrum; 0 for the zero matrix (defined). Computed as
        ``Σ (σ_i / σ_max)²`` so large values do not overflow when squared.
    """
    s = _spectrum(sv)
    smax = s.max(axis=-1, keepdims=True)
    zero = smax == 0
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.sum((s / np.where(zero, 1.0, smax)) ** 2, axis=-1)
    return _out(np.where(zero[..., 0], 0.0, r))


def energy_curve(sv: Any) -> np.ndarray:
    """Cumulative retained energy: entry ``r-1`` is :func:`energy_top_r` ``(sv, r)`` for ``r = 1..n``.

    Args: ``sv [..., n]`` (any order). Returns ``[..., n]`` float64, non-decreasing, last entry 1. A zero
    spectrum gives all ones (nothing is lost by any truncation).
    """
    s = -np.sort(-_spectrum(sv), axis=-1)  # descending
    e = s * s
    cum = np.cumsum(e, axis=-1)
    total = cum[..., -1:]
    zero = total == 0
    with np.errstate(invalid="ignore", divide="ignore"):
        c = cum / np.where(zero, 1.0, total)
    return np.where(zero, 1.0, c)


def energy_top_r(sv: Any, r: Any) -> np.ndarray:
    """Share of the squared norm kept by the ``r`` largest singular values: ``Σ_{i≤r} σ_i² / Σ_i σ_i²``.

    This is the retained energy ``‖P_r S‖_F² / ‖S‖_F²`` of the rank-``r`` truncation of seed 000 §3.

    Args:
        sv: singular values ``[..., n]`` (any order: they are sorted descending here).
        r: non-negative integer, or an integer array broadcast (numpy rules) against ``sv.shape[:-1]``; e.g.
            ``r = np.arange(1, 129)[:, None, None]`` with ``sv [L, H, 128]`` gives ``[128, L, H]``. ``r = 0``
            gives 0, ``r ≥ n`` gives 1.
    Returns:
        float64 array of shape ``broadcast(r.shape, sv.shape[:-1])`` in ``[0, 1]``. A zero spectrum gives 1
        for every ``r`` (defined: truncating the zero state loses nothing).
    """
    s = _spectrum(sv)
    n = s.shape[-1]
    ra = np.asarray(_as_f64(r) if _is_torch(r) else r)
    if ra.dtype.kind == "f":
        if not np.all(np.isfinite(ra)) or not np.all(ra == np.round(ra)):
            raise ValueError(f"r must be integer-valued; got {r!r}")
    elif ra.dtype.kind not in "iub":
        raise ValueError(f"r must be an integer or an integer array; got {r!r}")
    ri = ra.astype(np.int64)
    if np.any(ri < 0):
        raise ValueError(f"r must be non-negative; got {r!r}")
    cum = energy_curve(s)
    zero = np.sum(s * s, axis=-1, keepdims=True) == 0
    cum0 = np.concatenate([np.where(zero, 1.0, 0.0), cum], axis=-1)  # [..., n+1]: entry r is the energy of top r
    shape = np.broadcast_shapes(ri.shape, s.shape[:-1])
    cum_b = np.broadcast_to(cum0, shape + (n + 1,))
    idx = np.broadcast_to(np.minimum(ri, n), shape)[..., None]
    return _out(np.take_along_axis(cum_b, idx, axis=-1)[..., 0])


def rank_for_energy(sv: Any, share: float = 0.99) -> np.ndarray:
    """Smallest ``r`` whose top-``r`` truncation keeps ``share`` of the energy: ``min{r : Σ_{i≤r} σ_i² ≥
    share · Σ_i σ_i²}`` over the ``σ`` sorted descending.

    Args: ``sv [..., n]``; ``share`` in ``(0, 1]``. Returns ``[...]`` float64 integers in ``1..n`` (0 for a zero
    spectrum). Raises ``ValueError`` for a share outside ``(0, 1]``. The comparison carries a relative slack of
    ``1e-12`` so that ``share = 1`` gives the count of non-zero σ despite rounding in the cumulative sum.
    """
    q = float(share)
    if not 0.0 < q <= 1.0:
        raise ValueError(f"share must be in (0, 1]; got {share!r}")
    s = -np.sort(-_spectrum(sv), axis=-1)
    e = s * s
    cum = np.cumsum(e, axis=-1)
    total = cum[..., -1:]
    r = 1 + np.sum(cum < q * total * (1.0 - 1e-12), axis=-1)
    return _out(np.where(total[..., 0] == 0, 0, r).astype(np.float64))


def effective_rank_from_eigenvalues(lam: Any, scale: str = "sqrt") -> np.ndarray:
    """Effective rank of a covariance-like PSD matrix from its eigenvalues ``λ [..., n]``.

    Eigenvalues of a covariance (or of ``S Sᵀ``) are squared amplitudes; singular values of a state are not
    (seed 000 §2 footnote). Two scales:

    * ``scale="sqrt"``: ``p_i = √λ_i / Σ_j √λ_j`` -- comparable with a state's singular values: for
      ``P = Mᵀ M`` this equals :func:`effective_rank` of the singular values of ``M``.
    * ``scale="eig"``: ``p_i = λ_i / Σ_j λ_j`` -- the plain eigenvalue entropy (smaller than the √ scale for
      any non-flat spectrum).

    Then ``exp(-Σ p log p)`` as in :func:`effective_rank`. Negative eigenvalues (round-off of a PSD matrix) are
    clipped to 0 first; no other floor is applied. All zero → 0.

    Args:
        lam: eigenvalues ``[..., n]`` (any order). scale: ``"sqrt"`` or ``"eig"``.
    Returns:
        ``[...]`` float64.
    """
    lam_ = np.clip(_spectrum(lam), 0.0, None)  # NaN stays NaN
    if scale == "sqrt":
        return effective_rank(np.sqrt(lam_))
    if scale == "eig":
        return effective_rank(lam_)
    raise ValueError(f'scale must be "sqrt" or "eig"; got {scale!r}')


def singular_values(states: Any):
    """Float64 singular values of states ``[..., K, V]``, descending: ``[..., min(K, V)]``.

    Computed with ``torch.linalg.svdvals`` in float64 on the device of the input. A torch tensor in gives a
    float64 torch tensor on the same device (on the CPU for MPS, which has no float64); anything else (numpy,
    lists) gives a float64 numpy array.
    Units: those of the state entries.
    """
    import torch

    if _is_torch(states):
        x = states.detach()
        if x.device.type == "mps":  # MPS has no float64: the result stays on the CPU
            return torch.linalg.svdvals(x.to("cpu", torch.float64))
        return torch.linalg.svdvals(x.to(torch.float64))
    a = np.asarray(states, dtype=np.float64)
    if a.ndim < 2:
        raise ValueError(f"states must be [..., K, V]; got shape {a.shape}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # non-writable arrays: we never write
        t = torch.from_numpy(np.ascontiguousarray(a))
    return torch.linalg.svdvals(t).numpy()
