"""The one validator of truncation ranks. Every rank that reaches a truncation passes through here.

A rank is an integer ≥ 1 (a Python int, a numpy integer, a 0-d integer tensor); bools, floats (even 2.0), strings
and None are refused, never rounded. Ranks ≥ min(K, V) are valid and mean "keep the state unchanged". Every refusal
raises ``gdnviz.errors.RankOutOfRange`` naming the rank; a per-state list of the wrong length is a ``ValueError``
(a malformed call, not a bad rank).
"""
from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from gdnviz.errors import RankOutOfRange


def check_rank(value, where: str = "", upper: int | None = None) -> int:
    """``value`` as an int ≥ 1 (and ≤ ``upper`` when given), else ``RankOutOfRange``: "rank 0{where} is outside
    1..16 (min(d_k, d_v)) …", ``where`` naming the rank's owner (e.g. " for layer 0 head 3")."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and (
            value.dtype == torch.bool or value.dtype.is_floating_point or value.dtype.is_complex)):
        raise RankOutOfRange(f"The truncation rank{where} must be an integer ≥ 1; got {value!r}.")
    try:
        r = operator.index(value)
    except TypeError:
        raise RankOutOfRange(f"The truncation rank{where} must be an integer ≥ 1; got {value!r}.") from None
    if upper is not None and not 1 <= r <= upper:
        raise RankOutOfRange(f"rank {r}{where} is outside 1..{upper} (min(d_k, d_v)); r = {upper} keeps the state "
                             "untouched.")
    if r < 1:
        raise RankOutOfRange(f"rank {r}{where} is outside 1..min(d_k, d_v): ranks are integers ≥ 1, and a rank of "
                             "min(d_k, d_v) or more keeps the state unchanged.")
    return r


def state_ranks(rank, n: int) -> list[int]:
    """``rank`` (one rank, or ``n`` of them as a list / tuple / numpy array / integer tensor) as ``n`` validated
    ints. A CUDA rank tensor costs one device→host copy. Raises ``RankOutOfRange`` (a bad rank; a per-state one names
    its state) or ``ValueError`` (a list of the wrong length)."""
    if isinstance(rank, torch.Tensor):
        if rank.dtype == torch.bool or rank.dtype.is_floating_point or rank.dtype.is_complex:
            raise RankOutOfRange(f"Truncation ranks must be integers; got a {rank.dtype} tensor.")
        values = [int(rank)] * n if rank.dim() == 0 else rank.reshape(-1).tolist()
        per_state = rank.dim() > 0
    elif (isinstance(rank, Sequence) and not isinstance(rank, (str, bytes))) or getattr(rank, "ndim", 0) > 0:
        values = rank.tolist() if hasattr(rank, "tolist") else list(rank)  # numpy arrays: Python scalars
        per_state = True
    else:
        return [check_rank(rank)] * n
    if per_state and len(values) != n:
        raise ValueError(f"Per-state ranks must have one entry per state: got {len(values)} for {n} states.")
    return [check_rank(v, f" of state {i}") for i, v in enumerate(values)]
