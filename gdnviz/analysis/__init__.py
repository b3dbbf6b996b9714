"""Per-head statistics of Gated DeltaNet states, decays and keys (seed 000), as pure functions over arrays.

Numpy in, numpy out (float64); torch tensors on any device are accepted and converted (the key-geometry sums
run on the tensor's device). :func:`singular_values` alone returns the type it is given.

* :mod:`.spectra` -- numerical / effective / stable rank and retained energy of singular values ``[..., n]``.
* :mod:`.horizons` -- mean decay ``ᾱ`` and decay horizon ``1/(1−ᾱ)`` tokens from log-decays ``g [T, H]``.
* :mod:`.keycone` -- mean key norm, windowed key covariance, decayed key covariance ``P`` from keys
  ``k [T, H, K]`` and ``g [T, H]``.
* :mod:`.aggregate` -- Spearman ρ, median/min/max over documents, tidy ``(layer, head)`` tables.
"""

from .aggregate import across_documents, head_frame, rankdata_average, spearman, spearman_ci
from .horizons import alpha_histogram, decay_horizon, horizon_from_alpha, mean_alpha, share_forgetting_within
from .keycone import (
    DecayedKeyCovariance,
    covariance_window,
    decayed_key_covariance,
    decayed_key_erank,
    key_covariance_erank,
    keycone_summary,
    mean_key_norm,
    window_key_covariance,
)
from .spectra import (
    RANK_TOL_FACTOR,
    effective_rank,
    effective_rank_from_eigenvalues,
    energy_curve,
    energy_top_r,
    numerical_rank,
    numerical_rank_threshold,
    rank_for_energy,
    singular_values,
    stable_rank,
)

__all__ = [
    "RANK_TOL_FACTOR",
    "numerical_rank_threshold",
    "numerical_rank",
    "rank_for_energy",
    "effective_rank",
    "stable_rank",
    "energy_top_r",
    "energy_curve",
    "effective_rank_from_eigenvalues",
    "singular_values",
    "mean_alpha",
    "horizon_from_alpha",
    "decay_horizon",
    "share_forgetting_within",
    "alpha_histogram",
    "mean_key_norm",
    "window_key_covariance",
    "covariance_window",
    "key_covariance_erank",
    "decayed_key_covariance",
    "decayed_key_erank",
    "DecayedKeyCovariance",
    "keycone_summary",
    "spearman",
    "spearman_ci",
    "rankdata_average",
    "across_documents",
    "head_frame",
]
