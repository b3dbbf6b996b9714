"""Contributions as a table (one row per token), the form the CLI's contributions.csv and exports use."""
from __future__ import annotations

import pandas as pd

from gdnviz.attribution.contributions import Contributions


def contributions_table(c: Contributions, token_texts: list[str], top: int = 4) -> tuple[pd.DataFrame, dict]:
    """``(table, summary)`` of a decomposition.

    table: one row per token ``start..position−1``: ``position`` (0-based token index), ``token`` (its text,
    ``token_texts[position]``), ``norm`` (‖vectors_t‖·‖values_t‖, the Frobenius norm of its outer product) and
    ``share_1..share_top`` (its share ⟨c_t, u_i w_iᵀ⟩ along the state's i-th singular direction; they sum over
    tokens, plus the carried share, to σ_i). summary: ``position``, ``start``, ``state_norm`` (Frobenius),
    ``carried_norm``, ``sigma`` and ``carried_share`` (lists of ``top`` floats). ``top`` is capped at
    min(d_k, d_v)."""
    top = min(top, min(c.state.shape))
    shares, carried, sigma = c.shares(top)
    idx = c.tokens.tolist()
    table = pd.DataFrame({"position": idx, "token": [token_texts[i] for i in idx], "norm": c.norms.numpy()})
    for i in range(top):
        table[f"share_{i + 1}"] = shares[:, i].numpy()
    summary = dict(position=c.position, start=c.start, state_norm=float(c.state.norm()),
                   carried_norm=float(c.carried.norm()), sigma=sigma.tolist(), carried_share=carried.tolist())
    return table, summary
