"""``PatchCallback``: a ``gdnviz.runner`` callback that, at one boundary, records chosen heads' incoming states and
(given donor states) replaces them.

It defines ``on_boundary`` only (no ``graph_boundary``), so a patched run takes the runner's segment loop on every
device; the truncation machinery (CUDA-graph windows, the rank kernels) is for cuts at every boundary and does not
apply to one replacement. The unpatched run of a comparison uses the same callback without donor states, so both
runs take the same path and differ only by the replacement.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gdnviz.errors import ModelMismatch


def _group(heads) -> dict:
    """{layer: [(head, index into heads), ...]} of (layer, head) pairs."""
    out: dict = {}
    for i, (l, h) in enumerate(heads):
        out.setdefault(l, []).append((h, i))
    return out


@dataclass(frozen=True)
class DonorStates:
    """States of ``heads`` (sorted (layer, head) pairs) after ``position`` tokens of a prompt: ``states``
    ``[len(heads), K, V]`` float32 on the CPU, canonical layout. ``fingerprint``: the model that made them."""

    fingerprint: str
    position: int
    heads: tuple
    states: torch.Tensor

    def by_layer(self) -> dict:
        """{layer: (head indices [n] long, states [n, K, V])}."""
        return {l: (torch.tensor([h for h, _ in v]), self.states[[i for _, i in v]])
                for l, v in _group(self.heads).items()}


class PatchCallback:
    """At boundary ``position`` (tokens consumed) of each GDN layer with a head in ``heads``: ``seen`` keeps those
    heads' incoming states (a ``DonorStates`` of batch row 0 once the run has passed the boundary); with ``donor``
    (a ``DonorStates`` of the same heads, any position) the next segment reads the donor's states for them instead,
    every other head untouched. Batch rows all get the same donor state; a left-padded batch is refused
    (ValueError). ``ModelMismatch`` when ``donor`` was made by another model than ``info``'s; ValueError when its
    heads differ from ``heads``."""

    def __init__(self, info, heads, position: int, donor: DonorStates | None = None):
        self.heads, self.position, self.fingerprint = tuple(sorted(heads)), int(position), info.fingerprint
        if donor is not None:
            if donor.fingerprint != info.fingerprint:
                raise ModelMismatch(f"the donor states come from model fingerprint {donor.fingerprint}, not from "
                                    f"{info.name} ({info.fingerprint}): patch states between runs of one model")
            if tuple(donor.heads) != self.heads:
                raise ValueError(f"the donor states hold heads {list(donor.heads)}, the patch asks for "
                                 f"{list(self.heads)}")
        self.donor = None if donor is None else donor.by_layer()
        self.per_layer = {l: torch.tensor([h for h, _ in v]) for l, v in _group(self.heads).items()}
        self._seen: dict = {}

    def on_boundary(self, layer, position, state, rows=None):
        if position != self.position or layer not in self.per_layer:
            return None
        if rows is not None:
            raise ValueError("state patching runs one prompt at a time (no left-padded batches)")
        idx = self.per_layer[layer].to(state.device)
        self._seen[layer] = state[0].index_select(0, idx).to("cpu", torch.float32, copy=True)
        if self.donor is None:
            return None
        new = self.donor[layer][1].to(state.device, state.dtype)
        return state.index_copy(1, idx, new[None].expand(state.shape[0], *new.shape))

    @property
    def seen(self) -> DonorStates | None:
        """The recorded incoming states (None until every chosen layer has passed the boundary)."""
        if set(self._seen) != set(self.per_layer):
            return None
        states = torch.cat([self._seen[l] for l in sorted(self.per_layer)])  # heads are sorted by (layer, head)
        return DonorStates(self.fingerprint, self.position, self.heads, states)
