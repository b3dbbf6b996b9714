"""Per-head tables from captures: every statistic of seed 000 for each (layer, head), and over a document set
the median with the min–max spread per head.

``head_table(capture)`` → one row per (layer, head) of one document, measured on the state at the document end:

- ``erank``            effective rank exp(−Σ p log p), p = σ/Σσ
- ``numerical_rank``   count of σ > σ_max·128·ε_f32
- ``stable_rank``      Σσ²/σ_max²
- ``energy_top{r}``    Σ_{i≤r} σ_i² / Σ σ_i² for r in ENERGY_RANKS
- ``energy_rank99``    the smallest r with Σ_{i≤r} σ_i² ≥ 0.99 Σ σ_i² (directions keeping 99% of the energy)
- ``horizon``          1/(1−ᾱ) tokens, ᾱ the mean of α = exp(g) over the document
- ``forgets_within_segment``  horizon < segment length
- ``mean_key_norm``, ``key_cov_erank``, ``decayed_P_erank`` (√-eigenvalue scale), ``decayed_P_erank_eig``
- ``state_norm``       Frobenius norm of the final state

``document_set_table(captures)`` → the same metrics as ``<metric>`` (median over documents), ``<metric>_min``,
``<metric>_max``, plus ``n_docs``.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from gdnviz.analysis import spearman, spearman_ci, spectra

ENERGY_RANKS = (1, 4, 12, 32)
METRICS = {
    "erank": "effective rank",
    "numerical_rank": "numerical rank",
    "stable_rank": "stable rank",
    "energy_rank99": "smallest r keeping 99% of the energy",
    "horizon": "decay horizon (tokens)",
    "mean_key_norm": "key cone: mean unit-key norm",
    "key_cov_erank": "key covariance erank (inside horizon)",
    "decayed_P_erank": "decayed key covariance P erank (√eig scale)",
}


def head_table(capture, only: tuple[int, int] | None = None) -> pd.DataFrame:
    """One row per GDN head of one document (statistics of the state at the document end); ``only`` = (GDN layer
    position, head): that head's row alone, computed for it only."""
    pick = np.s_[:, :] if only is None else np.s_[only[0]:only[0] + 1, only[1]:only[1] + 1]
    sv = capture.sv[-1][pick].astype(np.float64)  # [NL, H, n]
    NL, H, _ = sv.shape
    layers = np.repeat(np.asarray(capture.gdn_layers)[pick[0]], H)
    heads = np.tile(np.arange(capture.sv.shape[2])[pick[1]], NL)
    kc = {k: np.asarray(capture.keycone[k])[pick] for k in ("horizon", "mean_key_norm", "key_cov_erank",
                                                            "decayed_P_erank_sqrt", "decayed_P_erank_eig")}
    df = pd.DataFrame({
        "layer": layers, "head": heads,
        "erank": spectra.effective_rank(sv).ravel(),
        "numerical_rank": spectra.numerical_rank(sv).ravel(),
        "stable_rank": spectra.stable_rank(sv).ravel(),
        "energy_rank99": spectra.rank_for_energy(sv, 0.99).ravel(),
        "horizon": kc["horizon"].ravel(),
        "mean_key_norm": kc["mean_key_norm"].ravel(),
        "key_cov_erank": kc["key_cov_erank"].ravel(),
        "decayed_P_erank": kc["decayed_P_erank_sqrt"].ravel(),
        "decayed_P_erank_eig": kc["decayed_P_erank_eig"].ravel(),
        "state_norm": np.sqrt((sv ** 2).sum(-1)).ravel(),
    })
    for r in ENERGY_RANKS:
        df[f"energy_top{r}"] = spectra.energy_top_r(sv, r).ravel()
    df["forgets_within_segment"] = df["horizon"] < capture.meta["segment_len"]
    return df


def document_set_table(captures) -> pd.DataFrame:
    """Median over documents per head, with ``_min`` / ``_max`` columns (NaN-aware)."""
    if not captures:
        raise ValueError("no captures")
    tables = [head_table(c) for c in captures]
    keys = ["layer", "head"]
    cols = [c for c in tables[0].columns if c not in keys and c != "forgets_within_segment"]
    stack = np.stack([t[cols].to_numpy(dtype=np.float64) for t in tables])  # [D, N, M]
    out = tables[0][keys].copy()
    med, lo, hi = np.nanmedian(stack, 0), np.nanmin(stack, 0), np.nanmax(stack, 0)
    for j, c in enumerate(cols):
        out[c], out[f"{c}_min"], out[f"{c}_max"] = med[:, j], lo[:, j], hi[:, j]
    out["forgets_within_segment"] = out["horizon"] < captures[0].meta["segment_len"]
    out["n_docs"] = len(captures)
    return out


def overview(table: pd.DataFrame, segment_len: int) -> dict:
    """Seed 000 §2 headline numbers from a head table: Spearman ρ(erank, horizon), share forgetting within a
    segment, and erank quantiles. ``spearman_ci95`` is ρ's 95% percentile-bootstrap interval over heads
    (``analysis.spearman_ci``, 2000 resamples, seed 0)."""
    er = table["erank"].to_numpy(float)
    hz = table["horizon"].to_numpy(float)
    # A head with alpha == 1 exactly has an infinite horizon: it ranks above every finite one (rank-preserving cap).
    hz_rank = np.where(np.isposinf(hz), np.finfo(np.float64).max, hz)
    return dict(
        spearman_erank_horizon=spearman(er, hz_rank),
        spearman_ci95=list(spearman_ci(er, hz_rank)),
        share_forgetting_within_segment=float(np.mean(hz < segment_len)),
        erank_median=float(np.median(er)), erank_max=float(np.max(er)),
        erank_q25=float(np.quantile(er, 0.25)),
        numerical_rank_median=float(np.median(table["numerical_rank"])),
        n_heads=int(len(table)), segment_len=int(segment_len),
    )
