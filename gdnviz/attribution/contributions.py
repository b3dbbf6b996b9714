"""Exact per-token decomposition of one GDN head's state (issue 31; docs/attribution.md).

Canonical layout ``S [d_k, d_v]``, ``A_t = α_t (I − β_t k_t k_tᵀ)``, ``S^{(t+1)} = A_t S^{(t)} + β_t k_t v_tᵀ``
(``S^{(p)}`` is the state after ``p`` tokens; tokens are 0-based). Unrolled from ``start`` to ``position``::

    S^{(position)} = P_{start} S^{(start)} + Σ_{start ≤ t < position} (P_{t+1} k_t)(β_t v_t)ᵀ,
    P_{t} = A_{position−1} ⋯ A_{t}   (P_{position} = I)

computed backward in O(n·d_k²) (each ``A_t`` is a scaled identity minus rank 1; P is carried as a matrix).
A truncated head (``gdnviz.attribution.recurrence``) has its cut projections ``Π_b`` inserted: ``P_t`` includes
``Π_b`` for every boundary ``t ≤ b < position`` (a cut at ``start`` acts on the carried-in state; one at
``position`` itself is not applied: ``S^{(position)}`` is the pre-cut state), O(d_k³) per boundary.
The backward loop runs on any device and dtype (``device=``, ``dtype=``; float64 on the CPU is the reference).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gdnviz.attribution import recurrence
from gdnviz.attribution.inputs import HeadInputs, as_ids, check_head, check_position, head_inputs
from gdnviz.errors import PositionOutOfRange
from gdnviz.runner import DEFAULT_SEGMENT_LEN


@dataclass(frozen=True)
class Contributions:
    """What the state after ``position`` tokens holds, token by token (all float64, CPU).

    tokens ``[n]`` long: the 0-based token indices ``start..position−1``; vectors ``[n, d_k]``: transported keys
    ``P_{t+1} k_t``; values ``[n, d_v]``: ``β_t v_t``; carried ``[d_k, d_v]``: ``P_{start} S^{(start)}`` (zero when
    ``start`` is 0: the run starts from the zero state); state ``[d_k, d_v]``: ``S^{(position)}`` by the reference
    recurrence (with the head's cuts, pre-cut at ``position``). Invariant: ``vectorsᵀ values + carried == state``
    to float64 rounding.
    """

    tokens: torch.Tensor
    vectors: torch.Tensor
    values: torch.Tensor
    carried: torch.Tensor
    state: torch.Tensor
    position: int
    start: int

    @property
    def norms(self) -> torch.Tensor:
        """``[n]`` Frobenius norm of each token's outer product, ``‖vectors_t‖ · ‖values_t‖``."""
        return self.vectors.norm(dim=1) * self.values.norm(dim=1)

    def total(self) -> torch.Tensor:
        """``[d_k, d_v]`` the sum of the outer products plus ``carried`` (equals ``state``)."""
        return self.vectors.T @ self.values + self.carried

    def shares(self, top: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each token's share along the state's top singular directions.

        With ``state = Σ_i σ_i u_i w_iᵀ`` (descending σ), token t's share along direction i is
        ``⟨c_t, u_i w_iᵀ⟩_F = (u_iᵀ vectors_t)(values_t · w_i)``; the carried term's is ``u_iᵀ carried w_i``;
        over tokens plus carried they sum to ``σ_i`` (shares may be negative). The sign of an SVD pair cancels.
        Returns ``(shares [n, top], carried [top], sigma [top])``; ``top`` None means all min(d_k, d_v).
        """
        U, sigma, Wh = torch.linalg.svd(self.state, full_matrices=False)
        m = sigma.shape[0] if top is None else top
        if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= sigma.shape[0]:
            raise ValueError(f"top must be in 1..{sigma.shape[0]}; got {top!r}")
        U, sigma, W = U[:, :m], sigma[:m], Wh[:m].T
        shares = (self.vectors @ U) * (self.values @ W)
        carried = ((U.T @ self.carried) * W.T).sum(dim=1)
        return shares, carried, sigma


def decompose(inp: HeadInputs, position: int, start: int = 0, device=None,
              dtype: torch.dtype = torch.float64) -> Contributions:
    """The decomposition of ``S^{(position)}`` from ``start`` (module docstring), from a head's float64 inputs.

    ``position`` in 1..T; ``start`` in 0..position−1. ``S^{(start)}``, ``state`` and the cuts come from
    ``gdnviz.attribution.recurrence.run`` (the float64 reference recurrence from the zero state, on the CPU).
    ``device`` (None: the CPU) / ``dtype``: where the backward loop runs; ``vectors``, ``values`` and ``carried``
    are computed there, the returned tensors are all on the CPU in float64. Raises PositionOutOfRange.
    """
    check_position(position, inp.T)
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < position:
        raise PositionOutOfRange(f"start {start!r} must be in 0..{position - 1} (before position {position})")
    on = dict(device=torch.device("cpu") if device is None else torch.device(device), dtype=dtype)
    k, v, alpha, beta = (x.to(**on) for x in (inp.k, inp.v, inp.g.exp(), inp.beta))
    K = k.shape[1]
    n = position - start
    state, proj = recurrence.run(inp, position)
    proj = {b: p.to(**on) for b, p in proj.items()}
    vectors = torch.empty(n, K, **on)
    P = torch.eye(K, **on)                         # P_{t+1} at the top of the loop
    for i in range(n - 1, -1, -1):
        t = start + i
        if t + 1 in proj:                          # the cut at boundary t + 1 acts on token t's write
            P = P @ proj[t + 1]
        kt = k[t]
        vectors[i] = P @ kt
        P = alpha[t] * (P - beta[t] * torch.outer(vectors[i], kt))   # P_t = P_{t+1} A_t
    if start in proj:
        P = P @ proj[start]
    values = beta[start:position, None] * v[start:position]
    carried = P @ recurrence.run(inp, start)[0].to(**on) if start else torch.zeros(K, v.shape[1], **on)
    back = dict(device="cpu", dtype=torch.float64)
    return Contributions(tokens=torch.arange(start, position), vectors=vectors.to(**back), values=values.to(**back),
                         carried=carried.to(**back), state=state, position=position, start=start)


def state_contributions(lm, input_ids, layer: int, head: int, position: int, start: int = 0, spec=None,
                        segment_len: int = DEFAULT_SEGMENT_LEN) -> Contributions:
    """Per-token contributions to ``(layer, head)``'s state after ``position`` tokens of ``input_ids``.

    The head's q, k, v, g, β come from the model's own run (:func:`gdnviz.attribution.inputs.head_inputs`), the
    decomposition is float64 on the CPU (:func:`decompose`). ``start`` > 0 folds tokens before it into ``carried``.
    ``spec`` (a ``TruncationSpec``): the run truncates at every ``segment_len`` tokens and this head's cuts are in
    the decomposition. Raises LayerNotGDN, HeadOutOfRange, PositionOutOfRange, and the spec's errors.
    """
    ids = as_ids(input_ids)
    check_head(lm.info, layer, head)
    check_position(position, ids.shape[1])
    return decompose(head_inputs(lm, ids, layer, head, position, spec, segment_len), position, start)
