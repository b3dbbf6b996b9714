"""Aggregation across heads and documents: Spearman correlation, per-document spread, tidy head tables.

Numpy in, numpy out (float64); torch tensors are accepted and converted. No scipy at run time.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import numpy as np
import pandas as pd

from .spectra import _as_f64, _is_torch

__all__ = ["rankdata_average", "spearman", "spearman_ci", "across_documents", "head_frame"]

#: Bootstrap of :func:`spearman_ci`: resamples and the seed of its generator (fixed: the interval is reproducible).
BOOT_RESAMPLES = 2000
BOOT_SEED = 0


def rankdata_average(a: Any) -> np.ndarray:
    """1-based ranks of a 1-d array, ties given the average of the ranks they span (``[1, 2, 2] → [1, 2.5, 2.5]``).

    Returns float64 of the same length. NaN must be removed by the caller.
    """
    x = _as_f64(a).ravel()
    n = x.size
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    new = np.r_[True, xs[1:] != xs[:-1]] if n else np.zeros(0, bool)
    group = np.cumsum(new) - 1  # tie group of each sorted position
    starts = np.r_[np.flatnonzero(new), n]  # 0-based first position of each group, then n
    avg = (starts[:-1] + starts[1:] - 1) / 2.0 + 1.0  # mean of the 1-based positions start+1 .. end
    ranks = np.empty(n, dtype=np.float64)
    ranks[order] = avg[group]
    return ranks


def spearman(x: Any, y: Any) -> float:
    """Spearman rank correlation ρ of paired values (e.g. effective rank vs horizon over all heads).

    ``ρ`` = Pearson correlation of the average ranks (ties share the mean of their ranks) of ``x`` and ``y``.
    Both are flattened (same number of elements, e.g. ``[L, H]`` each); a pair is dropped when either value
    is non-finite (NaN or ±inf -- note an ``inf`` horizon drops that head). Matches
    ``scipy.stats.spearmanr`` on the kept pairs.

    Returns:
        float in ``[-1, 1]``; NaN with fewer than 2 kept pairs or when either side is constant.
    """
    a, b = _as_f64(x).ravel(), _as_f64(y).ravel()
    if a.size != b.size:
        raise ValueError(f"x and y must have the same number of elements; got {a.size} and {b.size}")
    keep = np.isfinite(a) & np.isfinite(b)
    a, b = a[keep], b[keep]
    if a.size < 2:
        return float("nan")
    ra, rb = rankdata_average(a), rankdata_average(b)
    ra -= ra.mean()
    rb -= rb.mean()
    den = np.sqrt(np.dot(ra, ra) * np.dot(rb, rb))
    if den == 0:
        return float("nan")
    return float(np.clip(np.dot(ra, rb) / den, -1.0, 1.0))


def _rank_rows(m: np.ndarray) -> np.ndarray:
    """:func:`rankdata_average` of every row of ``m [B, n]`` at once."""
    B, n = m.shape
    order = np.argsort(m, axis=1, kind="stable")
    srt = np.take_along_axis(m, order, axis=1)
    pos = np.broadcast_to(np.arange(n), (B, n))
    diff = srt[:, 1:] != srt[:, :-1]
    first = np.concatenate([np.ones((B, 1), bool), diff], axis=1)
    last = np.concatenate([diff, np.ones((B, 1), bool)], axis=1)
    start = np.maximum.accumulate(np.where(first, pos, 0), axis=1)
    end = np.minimum.accumulate(np.where(last, pos, n)[:, ::-1], axis=1)[:, ::-1]
    ranks = np.empty((B, n), np.float64)
    np.put_along_axis(ranks, order, (start + end) / 2.0 + 1.0, axis=1)
    return ranks


def spearman_ci(x: Any, y: Any, level: float = 0.95, n_boot: int = BOOT_RESAMPLES,
                seed: int = BOOT_SEED) -> tuple[float, float]:
    """Percentile-bootstrap confidence interval of :func:`spearman` over the pairs (heads).

    The kept pairs (both finite) are resampled with replacement ``n_boot`` times, the indices drawn as
    ``np.random.default_rng(seed).integers(0, n, size=(n_boot, n))``; ρ of each resample (ties get average
    ranks; a constant resample gives NaN and is left out) and the ``(1 − level)/2`` and ``(1 + level)/2``
    quantiles of those ρ (``np.quantile``, linear interpolation) are the interval. Returns ``(lo, hi)``; NaNs with
    fewer than 3 kept pairs. ``level`` must be in ``(0, 1)``.
    """
    if not 0.0 < float(level) < 1.0:
        raise ValueError(f"level must be in (0, 1); got {level!r}")
    a, b = _as_f64(x).ravel(), _as_f64(y).ravel()
    if a.size != b.size:
        raise ValueError(f"x and y must have the same number of elements; got {a.size} and {b.size}")
    keep = np.isfinite(a) & np.isfinite(b)
    a, b = a[keep], b[keep]
    n = a.size
    if n < 3:
        return float("nan"), float("nan")
    idx = np.random.default_rng(seed).integers(0, n, size=(int(n_boot), n))
    ra, rb = _rank_rows(a[idx]), _rank_rows(b[idx])
    ra -= ra.mean(1, keepdims=True)
    rb -= rb.mean(1, keepdims=True)
    den = np.sqrt((ra * ra).sum(1) * (rb * rb).sum(1))
    with np.errstate(invalid="ignore", divide="ignore"):
        rhos = np.clip((ra * rb).sum(1) / den, -1.0, 1.0)
    rhos = rhos[np.isfinite(rhos) & (den > 0)]
    if rhos.size == 0:
        return float("nan"), float("nan")
    lo, hi = np.quantile(rhos, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def across_documents(values: Any) -> dict[str, np.ndarray]:
    """Median, minimum and maximum over documents (axis 0), ignoring NaN.

    Args:
        values: ``[D, ...]`` one statistic per document (e.g. ``[D, L, H]`` effective ranks).
    Returns:
        ``{"median": [...], "min": [...], "max": [...]}`` float64 arrays of shape ``values.shape[1:]`` (units of
        ``values``); an entry that is NaN in every document stays NaN (no warning).
    """
    v = _as_f64(values)
    if v.ndim == 0 or v.shape[0] == 0:
        raise ValueError(f"values must be [D, ...] with D ≥ 1 documents; got shape {v.shape}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices
        return {
            "median": np.asarray(np.nanmedian(v, axis=0), dtype=np.float64),
            "min": np.asarray(np.nanmin(v, axis=0), dtype=np.float64),
            "max": np.asarray(np.nanmax(v, axis=0), dtype=np.float64),
        }


def head_frame(layers: Sequence[int], heads: int | Sequence[int], **metrics: Any) -> pd.DataFrame:
    """Tidy per-head table: one row per (layer, head), columns ``layer, head, <metric>...``.

    Args:
        layers: the model's own layer indices of the ``L`` GDN layers (e.g. ``[0, 1, 2, 4, ...]`` in a
            hybrid), in the order of the metrics' first axis.
        heads: the number of heads ``H`` (heads ``0..H-1``) or the ``H`` head indices.
        **metrics: ``name=[L, H]`` arrays (numpy or torch); exactly that shape, no broadcasting.
    Returns:
        DataFrame of ``L·H`` rows in layer-major order (row ``i·H + j`` is ``layers[i]``, ``heads[j]``);
        ``layer`` and ``head`` int64, one column per metric in the order given (dtype kept: counts stay int).
    """
    lay = np.asarray(layers, dtype=np.int64).ravel()
    hd = np.arange(int(heads), dtype=np.int64) if np.ndim(heads) == 0 else np.asarray(heads, np.int64).ravel()
    L, H = lay.size, hd.size
    cols: dict[str, np.ndarray] = {"layer": np.repeat(lay, H), "head": np.tile(hd, L)}
    for name, val in metrics.items():
        if name in ("layer", "head"):
            raise ValueError(f"metric name {name!r} clashes with the index columns")
        a = val.detach().to("cpu").numpy() if _is_torch(val) else np.asarray(val)
        if a.shape != (L, H):
            raise ValueError(f"metric {name!r} must be [L={L}, H={H}]; got shape {a.shape}")
        cols[name] = a.reshape(-1)
    return pd.DataFrame(cols)
