"""``PatchSpec``: which heads of prompt A are carried into prompt B, at which boundary — and its validation.

Positions count tokens consumed (as everywhere in gdnviz): the state "at boundary b" is the state after b tokens,
the one the segment starting at token b reads. Boundaries are positive multiples of the segment length L, the only
places a runner callback sees states. Head sets use the truncation forms (``gdnviz.probes.sweep.parse_heads``:
"all", "layers:0,1", "L:H,L:H" or pairs); every (layer, head) is checked by ``gdnviz.attribution.inputs.check_head``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gdnviz import runner
from gdnviz.attribution.inputs import check_head
from gdnviz.errors import EmptyHeadSet, ModelMismatch, PositionOutOfRange
from gdnviz.probes.sweep import parse_heads


@dataclass(frozen=True)
class PatchSpec:
    """What to patch. Hashable and JSON-friendly (``to_dict``).

    heads: a head-set form (module docstring). boundary: the boundary of B (tokens consumed, a positive multiple of
    ``segment_len``) whose incoming states are replaced. source: the boundary of A the states come from (None: the
    same position as ``boundary``). max_new_tokens: greedy tokens generated per answer. fingerprint: when given,
    the model must have it (``ModelMismatch`` otherwise).
    """

    heads: Any = "all"
    boundary: int = 256
    source: int | None = None
    segment_len: int = runner.DEFAULT_SEGMENT_LEN
    max_new_tokens: int = 32
    fingerprint: str | None = None

    def __post_init__(self):
        if not isinstance(self.heads, str):
            object.__setattr__(self, "heads", tuple(tuple(int(x) for x in lh) for lh in self.heads))

    @property
    def source_position(self) -> int:
        return self.boundary if self.source is None else self.source

    def to_dict(self) -> dict:
        return dict(heads=self.heads if isinstance(self.heads, str) else [list(x) for x in self.heads],
                    boundary=self.boundary, source=self.source, segment_len=self.segment_len,
                    max_new_tokens=self.max_new_tokens, fingerprint=self.fingerprint)


def resolve_patch_heads(heads: Any, info) -> list[tuple[int, int]]:
    """The sorted (layer, head) pairs of a head-set form; LayerNotGDN / HeadOutOfRange naming the first bad one,
    EmptyHeadSet for none, ValueError for a malformed form."""
    if heads is None or (isinstance(heads, str) and heads.strip().lower() == "all"):
        return [(l, h) for l in info.gdn_layers for h in range(info.num_heads)]
    if isinstance(heads, str) and not heads.strip() or not isinstance(heads, str) and not len(heads):
        raise EmptyHeadSet("no heads to patch: give 'all', 'layers:0,1' or 'layer:head,layer:head'")
    pairs = parse_heads(heads, info.num_heads)
    for l, h in pairs:
        check_head(info, l, h)
    return pairs


def check_boundary(position, segment_len: int, n_tokens: int, prompt: str) -> int:
    """``position`` if it is a boundary inside a prompt of ``n_tokens`` tokens (a positive multiple of
    ``segment_len``, at most ``n_tokens``); PositionOutOfRange naming it, the prompt and the valid range."""
    last = (n_tokens // segment_len) * segment_len
    if isinstance(position, bool) or not isinstance(position, int) or position < 1 or position % segment_len:
        raise PositionOutOfRange(f"boundary {position!r} of prompt {prompt} is not a boundary: it must be a positive "
                                 f"multiple of the segment length {segment_len} (tokens consumed)")
    if position > n_tokens:
        have = f"its boundaries are {segment_len}..{last}" if last else f"it has no boundary (shorter than L = {segment_len})"
        raise PositionOutOfRange(f"boundary {position} is beyond prompt {prompt} ({n_tokens} tokens): {have}")
    return position


def check_patch(spec: PatchSpec, info, n_a: int, n_b: int) -> list[tuple[int, int]]:
    """Validate ``spec`` against the model ``info`` and prompts of ``n_a`` / ``n_b`` tokens; returns the heads.
    Raises ModelMismatch, BadSegmentLength, LayerNotGDN, HeadOutOfRange, EmptyHeadSet, PositionOutOfRange,
    ValueError (max_new_tokens below 1, a malformed head set)."""
    if spec.fingerprint and spec.fingerprint != info.fingerprint:
        raise ModelMismatch(f"the patch was set up for model fingerprint {spec.fingerprint}, but the loaded model "
                            f"{info.name} has {info.fingerprint}")
    runner.check_segment_len(spec.segment_len)
    if isinstance(spec.max_new_tokens, bool) or not isinstance(spec.max_new_tokens, int) or spec.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {spec.max_new_tokens!r}")
    heads = resolve_patch_heads(spec.heads, info)
    check_boundary(spec.boundary, spec.segment_len, n_b, "B")
    check_boundary(spec.source_position, spec.segment_len, n_a, "A")
    return heads


def last_boundary(n_tokens: int, segment_len: int) -> int:
    """The last boundary at or before token ``n_tokens`` (0 when there is none)."""
    return (n_tokens // segment_len) * segment_len
