"""Aggregation across heads and documents: Spearman correlation, per-document spread, tidy head tables.

Numpy in, numpy out (float64); torch tensors are accepted and converted. No scipy at run time.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import numpy as np
import pandas as pd

from .spectra import _as_f64, _is_torch

__all__ = ["rankdata_average", "spearman", "across_documents", "head_frame"]


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
