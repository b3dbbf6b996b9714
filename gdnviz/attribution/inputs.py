"""One GDN head's recurrence inputs from the model's own run, in float64, checked against the model's shape.

:func:`head_inputs` runs ``lm`` over a prefix of the document with a read-only callback
(``BoundaryCallback.on_core_input``) and keeps what the core of one (layer, head) reads, so the decomposition
works on exactly the numbers the model's core consumed (projections, short convolution, gates, L2 normalisation
all the model's own). :func:`check_head` validates a request before anything runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gdnviz import runner
from gdnviz.errors import HeadOutOfRange, LayerNotGDN, PositionOutOfRange
from gdnviz.truncation import TruncateCallback, contract


@dataclass(frozen=True)
class HeadInputs:
    """The core inputs of one head over tokens ``0..T-1``, float64 on the CPU.

    q ``[T, K]``: the query the core reads, L2-normalised *and* scaled by ``K**-0.5`` (the core's convention,
    ``gdnviz.gdn.kernels``); k ``[T, K]`` L2-normalised keys; v ``[T, V]`` values; g ``[T]`` log decay
    (α = exp g); beta ``[T]`` write strength. The recurrence starts from the zero state at token 0.
    rank / segment_len: the head is cut to ``rank`` at every multiple of ``segment_len`` (its truncation in the
    run the inputs came from, ``gdnviz.attribution.recurrence``); rank None: untouched.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    rank: int | None = None
    segment_len: int | None = None

    def __post_init__(self):
        if self.rank is not None and (self.segment_len is None or self.segment_len < 1):
            raise ValueError(f"a cut head (rank {self.rank}) needs a positive segment_len; got {self.segment_len!r}")

    @property
    def T(self) -> int:
        return self.k.shape[0]


def as_ids(input_ids) -> torch.Tensor:
    """``input_ids`` as a ``[1, T]`` long tensor (accepts ``[T]``, ``[1, T]``, or a list of ints)."""
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"input_ids must be one document, [T] or [1, T]; got shape {tuple(ids.shape)}")
    return ids


def check_head(info, layer, head) -> None:
    """Raise LayerNotGDN / HeadOutOfRange unless ``layer`` is a GDN layer of the model and ``head`` one of its
    value heads (0-based)."""
    if isinstance(layer, bool) or not isinstance(layer, int) or layer not in info.gdn_layers:
        kind = " (a full-attention layer)" if layer in info.attn_layers else ""
        raise LayerNotGDN(f"layer {layer!r}{kind} is not a Gated DeltaNet layer of {info.name}; "
                          f"its GDN layers are {list(info.gdn_layers)}")
    if isinstance(head, bool) or not isinstance(head, int) or not 0 <= head < info.num_heads:
        raise HeadOutOfRange(f"head {head!r} is out of range: layer {layer} has heads 0..{info.num_heads - 1}")


def check_position(position, T: int, what: str = "position") -> int:
    """``position`` (tokens consumed, 1..T) or PositionOutOfRange naming it and the document length."""
    if isinstance(position, bool) or not isinstance(position, int) or not 1 <= position <= T:
        raise PositionOutOfRange(f"{what} {position!r} is outside the document: it counts tokens consumed and "
                                 f"must be in 1..{T} for this {T}-token document")
    return position


class _Grab:
    """Read-only callback keeping one head's core inputs of one layer (batch row 0)."""

    modifies_state = False

    def __init__(self, layer: int, head: int):
        self.layer, self.head, self.parts = layer, head, []

    def on_core_input(self, layer, offset, queries, keys, values, g, beta):
        if layer != self.layer:
            return
        h = self.head
        self.parts.append(tuple(x[0, :, h].detach().to("cpu", torch.float64)
                                for x in (queries, keys, values, g, beta)))


def head_inputs(lm, input_ids, layer: int, head: int, length: int, spec=None,
                segment_len: int = runner.DEFAULT_SEGMENT_LEN) -> HeadInputs:
    """Run ``lm`` over the first ``length`` tokens of ``input_ids`` and return ``(layer, head)``'s core inputs.

    ``spec``: a ``TruncationSpec`` applied in that run at every ``segment_len`` tokens (so every head's inputs are
    those of the truncated model); the result records this head's rank in it (None when the head is untouched or
    at full rank). Causality makes the prefix enough: nothing a head reads before token ``length`` depends on
    later tokens. Raises LayerNotGDN, HeadOutOfRange, PositionOutOfRange (``length`` outside 1..T), and the
    spec's own errors (ValueError, RankOutOfRange).
    """
    ids = as_ids(input_ids)
    check_head(lm.info, layer, head)
    check_position(length, ids.shape[1], "length")
    runner.check_segment_len(segment_len)
    grab = _Grab(layer, head)
    callbacks, rank = [grab], None
    if spec is not None and len(spec):
        callbacks.insert(0, TruncateCallback(lm.info, spec))
        r = spec.as_dict().get((layer, head))
        rank = r if r is not None and r < min(lm.info.d_k, lm.info.d_v) else None

    def run():
        grab.parts.clear()  # a run answered again (``contract.run_checked``) grabs anew
        runner.forward(lm, ids[:, :length], segment_len=segment_len, callbacks=callbacks, keep_hidden=False)

    contract.run_checked(run, spec)
    q, k, v, g, beta = (torch.cat(p) for p in zip(*grab.parts))
    return HeadInputs(q=q * k.shape[1] ** -0.5, k=k, v=v, g=g, beta=beta, rank=rank,
                      segment_len=segment_len if rank is not None else None)
