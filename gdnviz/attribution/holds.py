"""What one head's state holds at a boundary: how much of it comes from beyond one segment, and how fast the state
is rewritten from boundary to boundary (docs/attribution.md, "What this state holds").

With ``p = position`` and a segment length ``L``, the decomposition of ``S = S^{(p)}`` (``decompose``) splits into
the *old* part ``S_old = carried + Σ_{t < p−L} c_t`` (every token more than L tokens before ``p``; it equals
``P_{p−L} S^{(p−L)}``, the state L tokens back carried through the last L transitions) and the recent part
``S − S_old``. :func:`beyond_segment` reports ``⟨S_old, S⟩_F / ‖S‖²_F`` (old and recent shares sum to 1),
``‖S_old‖_F / ‖S‖_F`` and, per top singular direction i, ``u_iᵀ S_old w_i / σ_i``. :func:`rewrite_rates` gives
``‖S^{(b)} − S^{(b−L)}‖_F / ‖S^{(b−L)}‖_F`` at the boundaries b = 2L, 3L, … ≤ T of the untouched recurrence.
"""
from __future__ import annotations

import torch

from gdnviz.attribution.contributions import Contributions, decompose
from gdnviz.attribution.inputs import HeadInputs
from gdnviz.errors import PositionOutOfRange
from gdnviz.gdn import reference
from gdnviz.runner import check_segment_len


def beyond_segment(c: Contributions, segment_len: int, top: int) -> dict:
    """How much of ``c.state`` comes from tokens older than ``segment_len`` (module docstring).

    Returns ``energy_share`` (⟨S_old, S⟩_F / ‖S‖²_F; may leave [0, 1] when old and recent parts cancel),
    ``norm_ratio`` (‖S_old‖_F / ‖S‖_F), ``sigma_share`` (``top`` floats, u_iᵀ S_old w_i / σ_i) and ``cutoff``
    (p − L: tokens before it are old; ≤ 0 means none is and every share is 0). ``c.start`` must not exceed the
    cutoff (the carried term counts as old), else PositionOutOfRange; a zero state gives shares of 0.
    """
    L = check_segment_len(segment_len)
    cutoff = c.position - L
    if c.start > max(cutoff, 0):
        raise PositionOutOfRange(f"start {c.start} is after the segment cutoff {cutoff} (position {c.position} − "
                                 f"L {L}): the carried-in term would mix old and recent tokens")
    old = c.carried.clone()
    n_old = max(cutoff, 0) - c.start
    if n_old > 0:
        old += c.vectors[:n_old].T @ c.values[:n_old]
    S = c.state
    U, sigma, Wh = torch.linalg.svd(S, full_matrices=False)
    U, sigma, W = U[:, :top], sigma[:top], Wh[:top].T
    e = float((S * S).sum())
    along = ((U.T @ old) * W.T).sum(dim=1)
    share = torch.where(sigma > 0, along / torch.where(sigma > 0, sigma, 1.0), torch.zeros_like(sigma))
    return dict(energy_share=float((old * S).sum()) / e if e > 0 else 0.0,
                norm_ratio=float(old.norm()) / e ** 0.5 if e > 0 else 0.0,
                sigma_share=share.tolist(), cutoff=int(cutoff))


def rewrite_rates(inp: HeadInputs, segment_len: int) -> tuple[list[int], list[float]]:
    """``(boundaries, rates)``: ``‖S^{(b)} − S^{(b−L)}‖_F / ‖S^{(b−L)}‖_F`` for b = 2L, 3L, … ≤ T, by the float64
    reference recurrence from the zero state (an untouched head: ``inp.rank`` must be None, else ValueError). A
    zero ``S^{(b−L)}`` gives ``inf`` (or ``nan`` when ``S^{(b)}`` is zero too). Empty when T < 2L."""
    L = check_segment_len(segment_len)
    if inp.rank is not None:
        raise ValueError(f"rewrite rates are defined here for an untouched head; this one is cut to rank {inp.rank}")
    K, V = inp.k.shape[1], inp.v.shape[1]
    S = torch.zeros(1, K, V, dtype=torch.float64)
    prev, out_b, out_r = None, [], []
    for a in range(0, inp.T - L + 1, L):
        sl = slice(a, a + L)
        _, S = reference.recurrent(inp.q[sl, None], inp.k[sl, None], inp.v[sl, None], inp.g[sl, None],
                                   inp.beta[sl, None], initial_state=S)
        if prev is not None:
            d, n = float((S[0] - prev).norm()), float(prev.norm())
            out_b.append(a + L)
            out_r.append(d / n if n > 0 else (float("nan") if d == 0 else float("inf")))
        prev = S[0].clone()
    return out_b, out_r


def what_it_holds(inp: HeadInputs, position: int, segment_len: int, top: int = 4, device=None,
                  dtype: torch.dtype = torch.float64) -> dict:
    """The JSON-able summary the Head page draws, of the state after ``position`` tokens (``decompose`` from 0, its
    backward loop on ``device`` in ``dtype``: ``gdnviz.attribution.exact_map.fast_path`` gives the app's choice).

    Keys: ``position``, ``T``, ``segment_len``, ``top`` (capped at min(d_k, d_v)); ``state_norm`` (‖S‖_F);
    ``sigma`` and ``carried_share`` (``top`` floats, 0 here); ``norms`` (``position`` floats, ‖c_t‖_F of tokens
    0..position−1); ``shares`` (``top`` lists of ``position`` floats, ⟨c_t, u_i w_iᵀ⟩_F, summing to σ_i);
    ``beyond`` (:func:`beyond_segment`); ``rewrite`` (``boundaries``, ``rates`` of :func:`rewrite_rates` over all
    of ``inp``). Raises PositionOutOfRange, BadSegmentLength.
    """
    L = check_segment_len(segment_len)
    c = decompose(inp, position, 0, device, dtype)
    top = max(1, min(int(top), min(c.state.shape)))
    shares, carried, sigma = c.shares(top)
    bnd, rates = rewrite_rates(inp, L)
    return dict(position=int(position), T=int(inp.T), segment_len=L, top=top, state_norm=float(c.state.norm()),
                sigma=sigma.tolist(), carried_share=carried.tolist(), norms=c.norms.tolist(),
                shares=shares.T.tolist(), beyond=beyond_segment(c, L, top),
                rewrite=dict(boundaries=bnd, rates=rates))
