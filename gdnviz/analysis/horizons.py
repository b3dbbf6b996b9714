"""Decay horizons of Gated DeltaNet heads from their log-decays (seed 000 §2).

Input everywhere: ``g [T, H]``, the natural log of the per-token decay ``α_t = exp(g_t)`` of each head
(dimensionless, ``g ≤ 0`` so ``0 ≤ α ≤ 1``; this is the ``g = -exp(A_log) * softplus(a + dt_bias)`` the GDN core
receives). Any trailing shape works (``[T]``, ``[T, H]``, ``[T, L, H]``): the token axis is axis 0.
Numpy in, numpy out (float64); torch tensors on any device are accepted and converted.

Definitions:

* mean decay ``ᾱ = (1/T) Σ_t exp(g_t)`` per head -- the mean of α over tokens, not ``exp`` of the mean ``g``.
* decay horizon ``1 / (1 − ᾱ)`` tokens: a head with constant decay α forgets in about ``1/(1−α)`` tokens
  (``Σ_{a≥0} α^a``, the total weight of its memory, which is also the mean age ``Σ_{a≥1} a (1−α) α^{a−1}``
  counting the current token as age 1). ``ᾱ = 1`` → ``inf``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .spectra import _as_f64, _out

__all__ = ["mean_alpha", "horizon_from_alpha", "decay_horizon", "share_forgetting_within", "alpha_histogram"]


def _g(g: Any) -> np.ndarray:
    a = _as_f64(g)
    if a.ndim == 0 or a.shape[0] == 0:
        raise ValueError(f"g must be [T, ...] log-decays with T ≥ 1; got shape {a.shape}")
    return a


def mean_alpha(g: Any) -> np.ndarray:
    """Mean per-token decay ``ᾱ = mean_t exp(g_t)`` per head.

    Args:
        g: log-decays ``[T, H]`` (natural log of α, ≤ 0), or ``[T, ...]``.
    Returns:
        ``[H]`` (``g.shape[1:]``) float64, dimensionless, in ``[0, 1]`` for valid ``g``.
    """
    return _out(np.exp(_g(g)).mean(axis=0))


def horizon_from_alpha(alpha_bar: Any) -> np.ndarray:
    """``1 / (1 − ᾱ)`` in tokens, elementwise; ``ᾱ ≥ 1`` (no forgetting) → ``inf``. NaN stays NaN."""
    a = _as_f64(alpha_bar)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = 1.0 / (1.0 - a)
    return _out(np.where(a >= 1.0, np.inf, h))


def decay_horizon(g: Any) -> np.ndarray:
    """Decay horizon ``1 / (1 − ᾱ)`` in tokens per head, with ``ᾱ`` = :func:`mean_alpha` ``(g)``.

    Constant ``α = 0.9`` gives 10 tokens; ``α = 0`` gives 1 (only the current token); ``ᾱ = 1`` exactly gives
    ``inf``. Note that ``1/(1−0.9)`` is ``10.000000000000002`` in floating point.

    Args:
        g: log-decays ``[T, H]`` (or ``[T, ...]``).
    Returns:
        ``[H]`` float64 tokens, ``≥ 1`` for valid ``g``.
    """
    return horizon_from_alpha(mean_alpha(g))


def share_forgetting_within(horizons: Any, segment_len: float = 256) -> float:
    """Fraction of heads whose decay horizon is strictly below ``segment_len`` tokens.

    Seed 000 §2: "Sixty-one percent of heads forget within 256 tokens".

    Args:
        horizons: decay horizons in tokens, any shape (``[H]``, ``[L, H]``); NaN entries are ignored (not
            counted in numerator or denominator), ``inf`` counts as not forgetting.
        segment_len: tokens, > 0 (default 256, the truncation segment of seed 000 §3).
    Returns:
        float in ``[0, 1]``; NaN when no non-NaN horizon is given.
    """
    if not segment_len > 0:
        raise ValueError(f"segment_len must be > 0; got {segment_len!r}")
    h = _as_f64(horizons).ravel()
    h = h[~np.isnan(h)]
    if h.size == 0:
        return float("nan")
    return float(np.mean(h < segment_len))


def alpha_histogram(g: Any, bins: Any = 20, per_head: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Histogram of the per-token decays ``α = exp(g)`` over ``[0, 1]``, for plots.

    Args:
        g: log-decays ``[T, H]`` (or ``[T, ...]``).
        bins: number of equal bins on ``[0, 1]``, or an increasing array of bin edges. As in ``np.histogram``
            every bin is half-open ``[a, b)`` except the last, which includes its right edge, so ``α = 1``
            lands in the last bin. α outside the edges (``g > 0``, invalid) is not counted.
        per_head: False: one histogram over all tokens and heads; True: one per head (``g.shape[1:]``).
    Returns:
        ``(counts, edges)``: counts int64 ``[n_bins]`` (or ``[*g.shape[1:], n_bins]`` with ``per_head``),
        edges float64 ``[n_bins + 1]``.
    """
    a = np.exp(_g(g))
    if np.ndim(bins) == 0:
        nb = int(bins)
        if nb < 1 or nb != bins:
            raise ValueError(f"bins must be a positive integer or an array of edges; got {bins!r}")
        edges = np.linspace(0.0, 1.0, nb + 1)
    else:
        edges = np.asarray(bins, dtype=np.float64)
        if edges.ndim != 1 or edges.size < 2 or np.any(np.diff(edges) <= 0):
            raise ValueError("bin edges must be a 1-d increasing array with at least 2 entries")
    if not per_head:
        counts, _ = np.histogram(a.ravel(), bins=edges)
        return counts.astype(np.int64), edges
    flat = a.reshape(a.shape[0], -1)
    counts = np.stack([np.histogram(flat[:, j], bins=edges)[0] for j in range(flat.shape[1])])
    return counts.reshape(a.shape[1:] + (edges.size - 1,)).astype(np.int64), edges
