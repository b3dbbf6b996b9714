"""``TruncationSpec``: which heads are cut to which rank — the one representation from the Truncate page to the kernel.

It maps (layer, head) → r, with ``layer`` the model's own layer index and ``head`` the value-head index; heads not
in it are untouched, attention layers never touched. Ranks are validated on construction by
``gdnviz.truncation.ranks.check_rank`` (integers ≥ 1: ``RankOutOfRange`` otherwise; 2.5 is refused, not rounded) and
against the model by ``validate``.
"""
from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Iterable

from gdnviz.truncation.ranks import check_rank


def _index(v, what: str) -> int:
    if isinstance(v, bool):
        raise ValueError(f"{what} must be an integer; got {v!r}.")
    try:
        return operator.index(v)
    except TypeError:
        raise ValueError(f"{what} must be an integer; got {v!r}.") from None


@dataclass(frozen=True)
class TruncationSpec:
    """Ranks per head: ``ranks`` is a sorted tuple of ((layer, head), r) pairs (hashable; JSON via ``to_list``).

    Built from ``{(layer, head): r}``, pairs ``((layer, head), r)`` or triples ``(layer, head, r)``. Raises
    ``RankOutOfRange`` for a rank that is not an integer ≥ 1, ``ValueError`` for a malformed entry."""

    ranks: tuple = field(default_factory=tuple)

    def __post_init__(self):
        items = self.ranks.items() if isinstance(self.ranks, Mapping) else self.ranks
        pairs = []
        try:
            for e in items:
                (l, h), r = ((e[0], e[1]), e[2]) if len(e) == 3 else (tuple(e[0]), e[1])
                lh = (_index(l, "layer"), _index(h, "head"))
                pairs.append((lh, check_rank(r, f" for layer {lh[0]} head {lh[1]}")))
        except (TypeError, IndexError):
            raise ValueError("ranks must be {(layer, head): r} or pairs ((layer, head), r) or triples (layer, head, "
                             f"r); got {self.ranks!r:.200}") from None
        object.__setattr__(self, "ranks", tuple(sorted(pairs)))

    @classmethod
    def from_dict(cls, mapping: dict) -> "TruncationSpec":
        return cls(mapping)

    @classmethod
    def uniform(cls, heads: Iterable, r: int) -> "TruncationSpec":
        return cls.from_dict({(l, h): r for l, h in heads})

    @classmethod
    def all_heads(cls, info, r: int) -> "TruncationSpec":
        return cls.uniform([(l, h) for l in info.gdn_layers for h in range(info.num_heads)], r)

    @classmethod
    def layers(cls, info, layers: Iterable[int], r: int) -> "TruncationSpec":
        return cls.uniform([(l, h) for l in layers for h in range(info.num_heads)], r)

    def as_dict(self) -> dict:
        return {lh: r for lh, r in self.ranks}

    def to_list(self) -> list:
        return [[l, h, r] for (l, h), r in self.ranks]

    def __len__(self) -> int:
        return len(self.ranks)

    def validate(self, info) -> None:
        """Against the model ``info``: ``ValueError`` for a layer that is not GDN or a head out of range,
        ``RankOutOfRange`` for a rank above min(d_k, d_v); the first bad entry is named."""
        rmax = min(info.d_k, info.d_v)
        for (l, h), r in self.ranks:
            if l not in info.gdn_layers:
                raise ValueError(f"layer {l} is not a Gated DeltaNet layer (GDN layers: {list(info.gdn_layers)})")
            if not 0 <= h < info.num_heads:
                raise ValueError(f"head {h} out of range: GDN layers have {info.num_heads} heads "
                                 f"(0..{info.num_heads - 1})")
            check_rank(r, f" for layer {l} head {h}", upper=rmax)
