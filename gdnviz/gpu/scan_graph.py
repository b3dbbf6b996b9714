"""A GDN layer's segment loop replayed from a CUDA graph, for runs that replace states at boundaries (truncation).

Why: a truncated run cannot use the one-pass read-out (``gdnviz.gdn.kernels.core_with_states``): every boundary
changes the state the next segment reads, so each GDN layer scans its segments one kernel call at a time, with the
boundary work between the calls. On an H200 that loop is host-bound: fla's chunk call costs ~0.7 ms of host time
for ~44 µs of GPU work per 256-token segment (issue #6), and the truncation of a layer's 16 states launches dozens of
small kernels. Recorded once in a CUDA graph, a window of ``W`` segments (fla call + boundary function, ``W`` times)
is one ``replay()``.

Shapes (as in ``gdnviz.gdn.kernels``): q, k ``[B, T, H, K]`` (unit rows, unscaled), v ``[B, T, H, V]``, g ``[B, T, H]``
float32, beta ``[B, T, H]``, state ``[B, H, K, V]`` float32. A window covers ``W·L`` tokens that start at a boundary
(absolute position a multiple of ``L``) and is followed by a boundary after each of its ``W`` segments.

What is recorded: static input buffers (copied into before each replay), the ``W`` chunk calls on slices of them,
the boundary function after each, the outputs written into a static output buffer and the final state copied into
the static state buffer. Constraints on ``boundary_fn``: no host sync, no data-dependent shapes, all constants
created before the capture (it is called twice eagerly on the static buffers before capture, which also runs fla's
Triton autotuning for these shapes). ``gdnviz.intervene.TruncateCallback.graph_boundary`` provides such functions.

Graphs are cached per (device, shapes, dtypes, L, W, boundary key), a few at a time (``MAX_GRAPHS``, least recently
used dropped): all layers that truncate the same heads to the same ranks share one graph. A capture that fails marks
its key as not graphable and the caller falls back to the eager loop (logged once per key).

``plan_windows`` (pure Python) decides which segments run from a graph; ``eager=True`` in ``run_windows`` runs the
same window body without a graph (CPU tests pin the window plumbing to the plain loop that way).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable

import torch

from gdnviz.gdn import kernels

WINDOW = 16  # segments per graph replay (4,096 tokens at L = 256)
MAX_GRAPHS = 4
_GRAPHS: "OrderedDict[tuple, _WindowGraph]" = OrderedDict()
_BROKEN: dict = {}  # key -> repr of the capture error
log = logging.getLogger(__name__)


def plan_windows(offset: int, T: int, L: int, W: int = WINDOW) -> tuple[list[int], list[tuple[int, int]]]:
    """Split a layer call of ``T`` tokens that starts after ``offset`` tokens into graph windows and eager pieces.

    Returns ``(window_starts, eager_spans)``: local start indices of windows of ``W·L`` tokens (each starts at a
    boundary, i.e. ``offset + start`` is a multiple of ``L``), and the remaining ``(start, end)`` spans in order, to
    run with the ordinary segment loop. Nothing is planned when fewer than ``W`` whole segments fit.
    """
    first = (-offset) % L  # first local index on the boundary grid (0 when the call starts at a boundary)
    n_full = (T - first) // L if T >= first else 0
    n_win = n_full // W
    if n_win == 0:
        return [], [(0, T)] if T > 0 else []
    starts = [first + i * W * L for i in range(n_win)]
    eager = []
    if first > 0:
        eager.append((0, first))
    tail = first + n_win * W * L
    if tail < T:
        eager.append((tail, T))
    return starts, eager


class _WindowGraph:
    """Static buffers + (after ``capture``) the CUDA graph of one window of ``W`` segments."""

    def __init__(self, proto: dict, L: int, W: int, boundary_fn: Callable):
        self.L, self.W, self.fn = L, W, boundary_fn
        n = L * W
        self.buf = {name: torch.zeros((t.shape[0], n, *t.shape[2:]), dtype=t.dtype, device=t.device)
                    for name, t in proto.items() if name != "state"}
        st = proto["state"]
        self.state = torch.zeros(st.shape, dtype=torch.float32, device=st.device)
        v = proto["v"]
        self.out = torch.zeros((v.shape[0], n, *v.shape[2:]), dtype=v.dtype, device=v.device)
        self.graph = None

    def body(self) -> None:
        b, L = self.buf, self.L
        S = self.state
        for j in range(self.W):
            sl = slice(j * L, (j + 1) * L)
            o, S = kernels.core(b["q"][:, sl], b["k"][:, sl], b["v"][:, sl], b["g"][:, sl], b["beta"][:, sl], S)
            self.out[:, sl].copy_(o)
            S = self.fn(S)
        self.state.copy_(S)

    def capture(self) -> None:
        side = torch.cuda.Stream(device=self.state.device)
        side.wait_stream(torch.cuda.current_stream(self.state.device))
        with torch.cuda.stream(side):  # warm-up: autotuning, lazy constants, allocator pools
            for _ in range(2):
                self.body()
        torch.cuda.current_stream(self.state.device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self.body()
        self.graph = g

    def load(self, q, k, v, g, beta, s: int) -> None:
        n = self.L * self.W
        for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
            self.buf[name].copy_(t[:, s:s + n])

    def step(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.body()


def _graph_for(key: tuple, proto: dict, L: int, W: int, fn: Callable, eager: bool) -> _WindowGraph | None:
    if eager:
        return _WindowGraph(proto, L, W, fn)
    if key in _BROKEN:
        return None
    wg = _GRAPHS.get(key)
    if wg is not None:
        _GRAPHS.move_to_end(key)
        return wg
    wg = _WindowGraph(proto, L, W, fn)
    try:
        wg.capture()
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # pragma: no cover - depends on the installed fla / driver
        _BROKEN[key] = repr(e)
        log.warning("CUDA graph capture of the segment loop failed (%r); this layer runs the eager loop", e)
        torch.cuda.synchronize(proto["v"].device)
        return None
    _GRAPHS[key] = wg
    while len(_GRAPHS) > MAX_GRAPHS:
        _GRAPHS.popitem(last=False)
    return wg


def run_windows(q, k, v, g, beta, state, starts: list[int], L: int, W: int, fn: Callable, fn_key,
                out: torch.Tensor, eager: bool = False) -> torch.Tensor | None:
    """Run the windows at local ``starts`` (consecutive, from ``plan_windows``) starting from ``state``; writes their
    outputs into ``out`` ([B, T, H, V]) and returns the state after the last window (float32, a new tensor), or None
    when no graph could be made (the caller then runs these segments eagerly; ``out`` is untouched)."""
    proto = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "state": state}
    key = (str(v.device), tuple(q.shape[:1]) + tuple(q.shape[2:]), tuple(v.shape[2:]),
           q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype, L, W, fn_key)
    wg = _graph_for(key, proto, L, W, fn, eager)
    if wg is None:
        return None
    wg.state.copy_(state)
    n = L * W
    for s in starts:
        wg.load(q, k, v, g, beta, s)
        wg.step()
        out[:, s:s + n].copy_(wg.out)
    return wg.state.clone()


def clear() -> None:
    """Drop every cached graph (and the record of failed captures)."""
    _GRAPHS.clear()
    _BROKEN.clear()
