"""The boundary-callback protocol of ``gdnviz.runner``, and the one place that dispatches on it.

A run's callbacks (``RunContext.callbacks``) are objects implementing any subset of :class:`BoundaryCallback`'s
members; every member is optional. The runner never looks a member up itself: it asks :class:`Dispatch`, which is
the only code that inspects a callback (``getattr``) and calls it.
"""
from __future__ import annotations

from typing import Callable, Iterable, Protocol, Sequence

import torch

__all__ = ["BoundaryCallback", "Dispatch"]


class BoundaryCallback(Protocol):
    """What a runner callback may define (every member optional; define the ones you need).

    Shapes: B batch rows, H value heads, K key width, V value width; states are ``[B, H, K, V]`` float32.
    ``layer`` is the model's layer index of a GDN layer; ``position`` counts the tokens that layer has consumed
    (in a left-padded batch: the row's own tokens, pads excluded).

    ``on_layer_input(layer, offset, keys, g, beta) -> None``
        Before one GDN layer call is scanned. ``keys`` ``[B, T, H, K]`` float32, L2-normalised, key heads
        repeated to value heads; ``g`` log-decay ``[B, T, H]`` float32; ``beta`` ``[B, T, H]``; ``offset`` tokens
        the layer had consumed before this call. Defining it keeps q and k in float32 (the runner then does not
        normalise them straight into the value dtype).

    ``on_core_input(layer, offset, queries, keys, values, g, beta) -> None``
        Right after ``on_layer_input``, with everything the core reads: ``queries`` ``[B, T, H, K]`` float32,
        L2-normalised and *unscaled* (the core multiplies them by ``K**-0.5``), key heads repeated; ``keys``,
        ``g``, ``beta`` as above; ``values`` ``[B, T, H, V]`` in the model dtype. Read-only (attribution reads a
        head's recurrence inputs from it). Defining it keeps q and k in float32 too.

    ``on_boundary(layer, position, state, rows=None) -> state | None``
        At every boundary (``position`` a positive multiple of the segment length L), before the next segment
        reads ``state``. Return a replacement of the same shape (cast to float32 by the runner), or None to keep
        ``state``. ``rows``: None when ``state`` holds every batch row; in a left-padded batch, where rows reach
        their boundaries at different tokens, ``state`` is the sub-batch ``state[rows]`` of the rows at
        ``position`` and ``rows`` their batch indices, a long tensor on ``state``'s device. Must accept ``rows``.

    ``on_boundaries(layer, positions, states) -> None``
        The batched read-only form: ``states`` ``[len(positions), B, H, K, V]`` float32, one per position of
        ``positions`` (ascending). Called instead of ``on_boundary`` when a layer's states are read out in one
        pass, and with one state at a time in the segment loop when the callback has no ``on_boundary``. Never
        called in a left-padded batch (there only ``on_boundary`` runs).

    ``on_layer_end(layer, position, state) -> None``
        After one GDN layer call, with the carried state at its end (``position`` tokens consumed).

    ``modifies_state: bool`` (default True)
        False promises that ``on_boundary`` always returns None. When every callback that acts at boundaries
        promises it, the runner may read all of a layer's boundary states out of one chunk pass.

    ``graph_boundary(layer, device) -> "noop" | (fn, key) | None``
        For CUDA-graph windows (``gdnviz.gpu.scan_graph``): ``"noop"`` when ``on_boundary`` does nothing in
        ``layer``; ``(fn, key)`` with ``fn(state [B, H, K, V], rows) -> state`` doing what ``on_boundary`` does,
        free of host syncs (``rows`` None or a device index tensor), and ``key`` a hashable name of what ``fn``
        does (layers with equal keys share a graph); None when this layer's boundaries cannot be captured (the
        runner then runs the eager segment loop). Without the member, the segment loop runs.

    ``note_graph_boundaries(layer, n) -> None``
        Required with ``graph_boundary``: ``n`` boundaries of ``layer`` ran inside a graph (``fn`` was called for
        them, ``on_boundary`` was not).
    """

    modifies_state: bool

    def on_layer_input(self, layer: int, offset: int, keys: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor) -> None: ...

    def on_core_input(self, layer: int, offset: int, queries: torch.Tensor, keys: torch.Tensor,
                      values: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> None: ...

    def on_boundary(self, layer: int, position: int, state: torch.Tensor,
                    rows: torch.Tensor | None = None) -> torch.Tensor | None: ...

    def on_boundaries(self, layer: int, positions: Sequence[int], states: torch.Tensor) -> None: ...

    def on_layer_end(self, layer: int, position: int, state: torch.Tensor) -> None: ...

    def graph_boundary(self, layer: int, device) -> str | tuple | None: ...

    def note_graph_boundaries(self, layer: int, n: int) -> None: ...


def _member(cb, name: str):
    return getattr(cb, name, None)


class Dispatch:
    """A run's callbacks (in order) and the calls of their optional members (:class:`BoundaryCallback`)."""

    __slots__ = ("callbacks",)

    def __init__(self, callbacks: Iterable[BoundaryCallback]):
        self.callbacks = tuple(callbacks)

    # -- what the callbacks do ---------------------------------------------------------------------------
    def acting(self) -> list:
        """The callbacks that act at boundaries (``on_boundary`` or ``on_boundaries``)."""
        return [cb for cb in self.callbacks
                if _member(cb, "on_boundary") is not None or _member(cb, "on_boundaries") is not None]

    def acts_at_boundaries(self) -> bool:
        return bool(self.acting())

    def reads_keys(self) -> bool:
        """Whether some callback reads the float32 keys (``on_layer_input`` or ``on_core_input``)."""
        return any(_member(cb, "on_layer_input") is not None or _member(cb, "on_core_input") is not None
                   for cb in self.callbacks)

    def reads_only(self) -> bool:
        """True when no callback can replace a state: each acting one says ``modifies_state = False``."""
        return all(getattr(cb, "modifies_state", True) is False for cb in self.acting())

    def graph_plan(self, layer: int, device) -> str | tuple | None:
        """``"noop"`` when every acting callback does nothing in ``layer``; ``(fn, key, owner)`` when exactly one
        replaces states there with a capture-safe ``fn`` and the others do nothing; else None (some callback has
        no ``graph_boundary``, or cannot be captured here, or several replace states)."""
        found = []
        for cb in self.acting():
            gb = _member(cb, "graph_boundary")
            if gb is None:
                return None
            p = gb(layer, device)
            if p is None:
                return None
            if p != "noop":
                found.append((p[0], p[1], cb))
        if not found:
            return "noop"
        return found[0] if len(found) == 1 else None

    # -- calls ------------------------------------------------------------------------------------------
    def layer_input(self, layer: int, offset: int, keys, g, beta) -> None:
        for cb in self.callbacks:
            fn = _member(cb, "on_layer_input")
            if fn is not None:
                fn(layer, offset, keys, g, beta)

    def core_input(self, layer: int, offset: int, queries, keys, values, g, beta) -> None:
        for cb in self.callbacks:
            fn = _member(cb, "on_core_input")
            if fn is not None:
                fn(layer, offset, queries, keys, values, g, beta)

    def boundary(self, layer: int, position: int, state: torch.Tensor) -> torch.Tensor:
        """One boundary of every batch row: each callback in turn sees the state the previous one left; returns
        the state the next segment reads (float32)."""
        for cb in self.callbacks:
            fn = _member(cb, "on_boundary")
            if fn is not None:
                new = fn(layer, position, state, rows=None)
                if new is not None:
                    state = new.to(torch.float32)
                continue
            many = _member(cb, "on_boundaries")
            if many is not None:
                many(layer, [position], state[None])
        return state

    def row_boundary(self, layer: int, position: int, state: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """One boundary of the batch rows ``rows`` (a device index tensor) of ``state`` ``[B, H, K, V]``: each
        ``on_boundary`` gets the sub-batch ``state[rows]``; returns the whole batch's state."""
        for cb in self.callbacks:
            fn = _member(cb, "on_boundary")
            if fn is None:
                continue
            new = fn(layer, position, state[rows], rows=rows)
            if new is not None:
                state = state.clone()
                state[rows] = new.to(torch.float32)
        return state

    def read_states(self, layer: int, positions: list, states: torch.Tensor) -> None:
        """Hand read-only callbacks a layer's boundary states at once (``states`` ``[len(positions), B, H, K, V]``):
        ``on_boundaries`` where defined, else ``on_boundary`` per position (its result is ignored)."""
        for cb in self.callbacks:
            many = _member(cb, "on_boundaries")
            if many is not None:
                many(layer, positions, states)
                continue
            fn = _member(cb, "on_boundary")
            if fn is not None:
                for i, pos in enumerate(positions):
                    fn(layer, pos, states[i], rows=None)

    def layer_end(self, layer: int, position: int, state) -> None:
        for cb in self.callbacks:
            fn = _member(cb, "on_layer_end")
            if fn is not None:
                fn(layer, position, state)

    @staticmethod
    def graph_boundaries_ran(owner: BoundaryCallback, layer: int, n: int) -> None:
        """Tell ``owner`` (the callback whose ``graph_boundary`` function ran) that ``n`` boundaries ran in a graph."""
        fn: Callable | None = _member(owner, "note_graph_boundaries")
        if fn is None:
            raise TypeError(f"{type(owner).__name__} defines graph_boundary but not note_graph_boundaries")
        fn(layer, n)
