"""A head's float64 recurrence with its boundary cuts: states and the cut projections the decomposition inserts.

An untouched head (``HeadInputs.rank`` None) is ``gdnviz.gdn.reference.recurrent`` from the zero state. A head
truncated to rank r at every boundary (positions L, 2L, …, ``HeadInputs.segment_len`` = L) has, at each boundary
b, the state after b tokens replaced by ``Π_b S^{(b)}`` with ``Π_b = U_r U_rᵀ`` (U_r: the top-r left singular
vectors of that float64 pre-cut state, gdnviz.truncation's definition), before token b reads it.
Convention: ``S^{(p)}`` is the state after p tokens *before* a cut at p (what a boundary callback sees).
"""
from __future__ import annotations

import torch

from gdnviz.gdn import reference


def cut_positions(inp, lo: int, hi: int) -> list[int]:
    """The boundaries b with ``lo ≤ b < hi`` and b > 0 where ``inp``'s head is cut (empty when untouched)."""
    if inp.rank is None:
        return []
    L = inp.segment_len
    return list(range(max(L, -(-lo // L) * L), hi, L))


def run(inp, p: int) -> tuple[torch.Tensor, dict]:
    """``(S^{(p)} [K, V], {b: Π_b [K, K]})`` for the cuts b < p, by the recurrence from the zero state."""
    K, V = inp.k.shape[1], inp.v.shape[1]
    S = torch.zeros(1, K, V, dtype=torch.float64)
    proj, a = {}, 0
    for b in cut_positions(inp, 1, p) + [p]:
        if b > a:
            sl = slice(a, b)
            _, S = reference.recurrent(inp.q[sl, None], inp.k[sl, None], inp.v[sl, None], inp.g[sl, None],
                                       inp.beta[sl, None], initial_state=S)
        if b < p:
            U = torch.linalg.svd(S[0], full_matrices=False)[0][:, :inp.rank]
            proj[b] = U @ U.T
            S = (proj[b] @ S[0])[None]
        a = b
    return S[0], proj


def outputs(inp, p: int) -> torch.Tensor:
    """``[p, V]`` the core's outputs ``o_t = S^{(t+1)ᵀ} q_t`` of tokens 0..p−1 (a cut at t + 1 comes after o_t)."""
    K, V = inp.k.shape[1], inp.v.shape[1]
    S = torch.zeros(1, K, V, dtype=torch.float64)
    outs, a = [], 0
    for b in cut_positions(inp, 1, p) + [p]:
        if b > a:
            sl = slice(a, b)
            o, S = reference.recurrent(inp.q[sl, None], inp.k[sl, None], inp.v[sl, None], inp.g[sl, None],
                                       inp.beta[sl, None], initial_state=S)
            outs.append(o[:, 0])
        if b < p:
            U = torch.linalg.svd(S[0], full_matrices=False)[0][:, :inp.rank]
            S = ((U @ U.T) @ S[0])[None]
        a = b
    return torch.cat(outs)
