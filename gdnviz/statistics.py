"""A capture's statistics computed on the tensors' device: spectra of head states, eigenvalues of symmetric matrices,
the key cone's device half. Float64 torch tensors in and out; no host sync where ``gdnviz.gpu.symeig`` runs its
CUDA kernels (else its float64 ``torch.linalg.eigvalsh`` fallback). The definitions these numbers feed (effective
rank and the rest) are ``gdnviz.analysis``'s.
"""
from __future__ import annotations

from typing import Any

import torch

from gdnviz.analysis.keycone import keycone_sums
from gdnviz.gpu import symeig

__all__ = ["batched_svdvals", "symmetric_eigvals", "keycone_parts"]


def _nan_rows(lam: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    return torch.where(bad[:, None], torch.full((), float("nan"), dtype=lam.dtype, device=lam.device), lam)


def symmetric_eigvals(A: torch.Tensor) -> torch.Tensor:
    """Ascending eigenvalues ``[N, n]`` float64 of ``A [N, n, n]`` symmetrised (0.5 (A + Aᵀ)), on ``A``'s device; NaN
    rows where ``A`` has a NaN/inf entry."""
    A, bad = symeig.finite_symmetric(A.double())
    return _nan_rows(symeig.eigvalsh(A), bad)


def batched_svdvals(states: torch.Tensor, extra: torch.Tensor | None = None):
    """Singular values ``[..., n]`` float64, descending (n = min(K, V)), of states ``[..., K, V]``: the square roots of
    the eigenvalues of their float64 Gram matrices (``symeig``; error ≈ sqrt(ε_f64)·σ_max absolute, far below the
    numerical-rank threshold σ_max·128·ε_f32). The reference is float64 ``torch.linalg.svdvals``.

    A state whose Gram matrix has a NaN or inf entry (a NaN/inf state entry; for float64 states also an overflow)
    gets NaN singular values, without a host sync: ``symeig.finite_gram`` flags it and hands the solver zeros
    (LAPACK raises on NaN).

    ``extra``: float64 symmetric matrices ``[M, n, n]`` whose eigenvalues are wanted too; they join the Gram matrices
    in the same solve (one launch of each kernel). Returns ``(sv, eigvals [M, n])`` then, eigenvalues ascending with
    :func:`symmetric_eigvals`' NaN rows; else ``sv``. ValueError if ``extra`` is not ``[M, n, n]``."""
    shape = states.shape
    flat = states.reshape(-1, *shape[-2:])
    N, n = flat.shape[0], min(shape[-2:])
    if extra is not None:
        if extra.shape[-2:] != (n, n):
            raise ValueError(f"extra matrices must be [M, {n}, {n}]; got {tuple(extra.shape)}")
        A, bad = symeig.finite_symmetric(extra.to(device=flat.device, dtype=torch.float64))
    G, bad_states = symeig.finite_gram(flat)
    if extra is not None:
        G = torch.cat([G, A])
    lam = symeig.eigvalsh(G)
    sv = _nan_rows(lam[:N].clamp_min(0).sqrt().flip(-1), bad_states)
    sv = sv.reshape(*shape[:-2], sv.shape[-1])
    return sv if extra is None else (sv, _nan_rows(lam[N:], bad))


def keycone_parts(k: Any, g: Any, chunk: int | None = None) -> dict[str, torch.Tensor]:
    """The key cone on the keys' device: ``gdnviz.analysis.keycone.keycone_sums`` and the eigenvalues of its two
    matrices (:func:`symmetric_eigvals`, one solve), float64 tensors. ``keycone_finish`` turns them into
    ``keycone_summary``'s numbers.

    Returns ``{"horizon": [H], "mean_key_norm": [H], "cov_eigvals": [H, K], "P_eigvals": [H, K]}`` (eigenvalues
    ascending; NaN rows for matrices with NaN/inf)."""
    sums = keycone_sums(k, g, chunk=chunk)
    H = sums["C"].shape[0]
    lam = symmetric_eigvals(torch.cat([sums["C"], sums["P"]]))
    return {"horizon": sums["horizon"], "mean_key_norm": sums["mean_key_norm"], "cov_eigvals": lam[:H],
            "P_eigvals": lam[H:]}
