"""A GDN layer's segment loop replayed from a CUDA graph, for runs that replace states at boundaries (truncation).

Why: a truncated run cannot use the one-pass read-out (``gdnviz.gdn.kernels.core_with_states``): every boundary
changes the state the next segment reads, so each GDN layer scans its segments one kernel call at a time, with the
boundary work between the calls. On an H200 that loop is host-bound: fla's chunk call costs ~0.7 ms of host time
for ~44 µs of GPU work per 256-token segment (issue #6), and the truncation of a layer's 16 states launches dozens of
small kernels. Recorded once in a CUDA graph, a window of ``W`` segments (fla call + boundary function, ``W`` times)
is one ``replay()`` (measured: bench/RESULTS.md, fourth session).

Shapes (as in ``gdnviz.gdn.kernels``): q, k ``[B, T, H, K]`` (unit rows, unscaled), v ``[B, T, H, V]``, g ``[B, T, H]``
float32, beta ``[B, T, H]``, state ``[B, H, K, V]`` float32.

A window covers ``W`` periods of ``L`` tokens. What happens inside one period is its *pattern*: a tuple of pieces
``(length, rows)`` — one kernel call over ``length`` tokens, then the boundary function for ``rows`` (``"all"``:
every row; a tuple of batch rows; None: no boundary). A plain run's windows start at a boundary and the pattern is
``((L, "all"),)``. In a left-padded batch (``RunContext.row_starts``) rows reach their boundaries at different
positions, but those positions repeat every L tokens, so once every row has started, every period has the same
pattern (``row_pattern``): one graph serves every window of every layer of that batch.

What is recorded: static input buffers (copied into before each replay), the chunk calls on slices of them — on
CUDA with fla, when every piece lies on fla's 64-token chunk grid (``split_scan``), the chunk-local half of the
chunk pass (decay cumsums, WY factors: ``kernels.intra``) once for the whole window and only the state recurrence and
output pass (``kernels.segment``) per piece, the same numbers with ~2 kernels per segment instead of ~6 — the
boundary function after each piece that ends at a boundary, the outputs written into a static output buffer and
the final state copied into the static state buffer. Constraints on the boundary function ``fn(state, rows)``
(``rows`` None for all rows, else a device index tensor): no host sync, no data-dependent shapes, constants created
before the capture. The first window of a new graph runs eagerly on a side stream — that run is its real result
and also the capture's warm-up (fla's autotuning for these shapes, lazy constants) — then the body is recorded;
later windows replay. ``gdnviz.truncation.TruncateCallback.graph_boundary`` provides such functions.

Graphs are cached per (device, shapes, dtypes, L, W, pattern, boundary key), a few at a time (``MAX_GRAPHS``,
least recently used dropped): all layers that truncate the same heads to the same ranks share one graph. A capture
that fails marks its key as not graphable and the caller falls back to the eager loop (logged once per key).

``plan_windows`` (pure Python) decides which segments run from a graph; ``eager=True`` in ``run_windows`` runs the
same window body without a graph (CPU tests pin the window plumbing to the plain loop that way).
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from typing import Callable

import torch

from gdnviz.gdn import kernels

WINDOW = 16  # periods per graph replay (4,096 tokens at L = 256)
SPLIT_SCAN = True  # see split_scan: fla's chunk-local half once per window (GDNVIZ_SPLIT_SCAN=0: per piece)
MAX_GRAPHS = 4
_GRAPHS: "OrderedDict[tuple, _WindowGraph]" = OrderedDict()
_BROKEN: dict = {}  # key -> repr of the capture error
log = logging.getLogger(__name__)


def plan_windows(offset: int, T: int, L: int, W: int = WINDOW, first: int | None = None
                 ) -> tuple[list[int], list[tuple[int, int]]]:
    """Split a layer call of ``T`` tokens that starts after ``offset`` tokens into graph windows and eager pieces.

    Returns ``(window_starts, eager_spans)``: local start indices of consecutive windows of ``W·L`` tokens, the first
    at ``first`` (default: the first local index on the boundary grid, ``offset + first`` a multiple of ``L``), and
    the remaining ``(start, end)`` spans in order, to run with the ordinary segment loop. Nothing is planned when
    fewer than ``W`` whole periods fit.
    """
    if first is None:
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


def row_pattern(row_starts, offset: int, first: int, L: int) -> tuple:
    """The period pattern of a left-padded batch for windows starting at local index ``first``, once every row has
    started (``offset + first ≥ max(row_starts)``): row b reaches a boundary ``d_b = (start_b − offset − first) mod
    L`` tokens into each period (L when 0). Pieces in order of d, each followed by the rows that reach a boundary
    there, and a last piece without a boundary when no row's boundary ends the period. ``((L, "all"),)`` when every
    row has its boundaries at the period's end."""
    if offset + first < max(row_starts):
        raise ValueError("windows must start after every row's first token")
    at: dict = {}
    for b, st in enumerate(row_starts):
        d = (st - offset - first) % L or L
        at.setdefault(d, []).append(b)
    if list(at) == [L]:
        return ((L, "all"),)
    pieces, prev = [], 0
    for d in sorted(at):
        pieces.append((d - prev, tuple(at[d])))
        prev = d
    if prev < L:
        pieces.append((L - prev, None))
    return tuple(pieces)


class _WindowGraph:
    """Static buffers, the window body and (after ``capture``) its CUDA graph."""

    def __init__(self, proto: dict, L: int, W: int, boundary_fn: Callable, pattern: tuple, split: bool = False):
        self.L, self.W, self.fn, self.pattern, self.split = L, W, boundary_fn, pattern, split
        n = L * W
        self.buf = {name: torch.zeros((t.shape[0], n, *t.shape[2:]), dtype=t.dtype, device=t.device)
                    for name, t in proto.items() if name != "state"}
        st = proto["state"]
        self.state = torch.zeros(st.shape, dtype=torch.float32, device=st.device)
        v = proto["v"]
        self.out = torch.zeros((v.shape[0], n, *v.shape[2:]), dtype=v.dtype, device=v.device)
        # the row groups' device index tensors, made before any capture
        self.rows = [torch.tensor(r, dtype=torch.long, device=v.device) if isinstance(r, tuple) else None
                     for _, r in pattern]
        self.graph = None

    def boundaries_per_window(self, row_starts=None) -> int:
        """Boundary callback calls the eager loop would make in one window: one per distinct row position at each
        cut, i.e. per period one per distinct row start (``row_starts``; None: a plain run, one per period)."""
        return self.W * (1 if row_starts is None else len(set(row_starts)))

    def body(self) -> None:
        b = self.buf
        S = self.state
        pre = kernels.intra(b["k"], b["v"], b["g"], b["beta"]) if self.split else None
        t = 0
        for _ in range(self.W):
            for (n, rows), idx in zip(self.pattern, self.rows):
                sl = slice(t, t + n)
                if pre is not None:
                    gc, w, u = pre
                    o, S = kernels.segment(b["q"][:, sl], b["k"][:, sl], gc[:, sl], w[:, sl], u[:, sl], S)
                else:
                    o, S = kernels.core(b["q"][:, sl], b["k"][:, sl], b["v"][:, sl], b["g"][:, sl],
                                        b["beta"][:, sl], S)
                self.out[:, sl].copy_(o)
                if rows is not None:
                    S = self.fn(S, idx)
                t += n
        self.state.copy_(S)

    def capture(self) -> None:
        """Run the body once eagerly on a side stream on the loaded inputs (the first window's real result; also
        the warm-up: autotuning, lazy constants, allocator pools), then record it. Recording executes nothing, so
        the eager run's outputs are kept and the input state is restored for the recording's sake."""
        dev = self.state.device
        start = self.state.clone()
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            self.body()
        torch.cuda.current_stream(dev).wait_stream(side)
        out, end = self.out.clone(), self.state.clone()
        self.state.copy_(start)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self.body()
        self.out.copy_(out)
        self.state.copy_(end)
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


def split_scan(device, pattern: tuple) -> bool:
    """Whether a window body runs fla's chunk-local half once per window (``kernels.intra``) and only the
    state-dependent half per piece (``kernels.segment``): fla on CUDA, every piece on the 64-token grid (so every
    piece starts on it), not switched off (``GDNVIZ_SPLIT_SCAN=0``)."""
    return (SPLIT_SCAN and os.environ.get("GDNVIZ_SPLIT_SCAN", "").strip() != "0"
            and kernels.backend_for(device) == "fla"
            and all(n % kernels.FLA_CHUNK == 0 for n, _ in pattern))


def run_windows(q, k, v, g, beta, state, starts: list[int], L: int, W: int, fn: Callable, fn_key,
                out: torch.Tensor, pattern: tuple | None = None, eager: bool = False, row_starts=None
                ) -> tuple | None:
    """Run the windows at local ``starts`` (consecutive, from ``plan_windows``) from ``state``.

    Writes their outputs into ``out`` ([B, T, H, V]) and returns ``(state after the last window (float32, a new
    tensor), boundary callback calls the eager loop would have made)``, or None when no graph could be made (the caller then runs these segments
    eagerly; ``out`` is untouched). ``pattern``: see the module docstring (default: a plain run's).
    """
    pattern = pattern or ((L, "all"),)
    proto = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "state": state}
    split = split_scan(v.device, pattern)
    key = (str(v.device), tuple(q.shape[:1]) + tuple(q.shape[2:]), tuple(v.shape[2:]),
           q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype, L, W, pattern, fn_key, split)
    fresh = False
    if eager:
        wg = _WindowGraph(proto, L, W, fn, pattern, split)
    elif key in _BROKEN:
        return None
    else:
        wg = _GRAPHS.get(key)
        if wg is None:
            wg, fresh = _WindowGraph(proto, L, W, fn, pattern, split), True
        else:
            _GRAPHS.move_to_end(key)
    wg.state.copy_(state)
    n = L * W
    for i, s in enumerate(starts):
        wg.load(q, k, v, g, beta, s)
        if fresh and i == 0:
            try:
                wg.capture()
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # pragma: no cover - depends on the installed fla / driver
                _BROKEN[key] = repr(e)
                log.warning("CUDA graph capture of the segment loop failed (%r); this layer runs the eager loop", e)
                torch.cuda.synchronize(v.device)
                return None
            _GRAPHS[key] = wg
            while len(_GRAPHS) > MAX_GRAPHS:
                _GRAPHS.popitem(last=False)
        else:
            wg.step()
        out[:, s:s + n].copy_(wg.out)
    return wg.state.clone(), len(starts) * wg.boundaries_per_window(row_starts)


def clear() -> None:
    """Drop every cached graph (and the record of failed captures)."""
    _GRAPHS.clear()
    _BROKEN.clear()
