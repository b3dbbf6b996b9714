"""A GDN layer's segment loop replayed from a CUDA graph, for runs that replace states at boundaries (truncation).

Why: a truncated run cannot use the one-pass read-out (``gdnviz.gdn.kernels.core_with_states``): every boundary
changes the state the next segment reads, so each GDN layer scans its segments one kernel call at a time, with the
boundary work between the calls. That loop is host-bound (fla's chunk call costs far more host time than GPU time
per 256-token segment, and a layer's truncation launches several kernels: docs/runner.md). Recorded once in a CUDA
graph, a window of ``W`` segments (fla call + boundary function, ``W`` times) is one ``replay()``.

Shapes (as in ``gdnviz.gdn.kernels``): q, k ``[B, T, H, K]`` (unit rows, unscaled), v ``[B, T, H, V]``, g ``[B, T, H]``
float32, beta ``[B, T, H]``, state ``[B, H, K, V]`` float32.

A window covers ``W`` periods of ``L`` tokens (``WINDOW``; the periods left after the last full window form one
shorter window, a graph of its own size), each one kernel call then the boundary function for every row. In a
left-padded batch (``RunContext.row_starts``) the runner first lays the rows out so that they all reach their
boundaries on the same columns (``gdnviz.runner._aligned``), so the same windows serve batches: one graph for every
window of every layer that truncates the same heads to the same ranks.

What is recorded: static input buffers (copied into before each replay), the chunk calls on slices of them — on
CUDA with fla, when every piece lies on fla's 64-token chunk grid (``split_scan``), the chunk-local half of the
chunk pass (decay cumsums, WY factors: ``kernels.intra``) once for the whole window and only the state recurrence and
output pass (``kernels.segment``) per piece, the same numbers with ~2 kernels per segment instead of ~6; otherwise
(pieces off the grid, as in some left-padded batches, or the torch bodies) one ``kernels.core`` call per piece — the
boundary function after each piece that ends at a boundary, the outputs written into a static output buffer and
the final state copied into the static state buffer. Constraints on the boundary function ``fn(state, rows)``
(``rows`` None for all rows, else a device index tensor): no host sync, no data-dependent shapes, constants created
before the capture. The first window of a new graph runs eagerly on a side stream — that run is its real result
and also the capture's warm-up (fla's autotuning for these shapes, lazy constants) — then the body is recorded;
later windows replay. A callback's ``graph_boundary`` (``gdnviz.callbacks.BoundaryCallback``) provides such
functions; truncation's ``TruncateCallback`` does. The body runs under ``gdnviz.truncation.contract.window``: the
truncation kernel's calls in it copy their states into the window's slots, and after each run of the body (replay,
eager run or the capture's eager run) ``contract.check_window`` checks them on a side stream against the 1e-5
contract.

Graphs are cached per (device, shapes, dtypes, L, W, boundary key), a few at a time (``MAX_GRAPHS``,
least recently used dropped): all layers that truncate the same heads to the same ranks share one graph. A capture
that fails marks its key as not graphable and the caller falls back to the eager loop (logged once per key).

``plan_windows`` (pure Python) decides which segments run from a graph; ``eager=True`` in ``run_windows`` runs the
same window body without a graph (CPU tests pin the window plumbing to the plain loop that way).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable

import torch

from gdnviz.gdn import kernels
from gdnviz.truncation import contract

WINDOW = 16  # periods per graph replay (4,096 tokens at L = 256)
MAX_GRAPHS = 6  # e.g. a full and a remainder window for each of three boundary functions
_GRAPHS: "OrderedDict[tuple, _WindowGraph]" = OrderedDict()
_BROKEN: dict = {}  # key -> repr of the capture error
log = logging.getLogger(__name__)


def plan_windows(offset: int, T: int, L: int, W: int = WINDOW, first: int | None = None
                 ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Split a layer call of ``T`` tokens that starts after ``offset`` tokens into graph windows and eager pieces.

    Returns ``(windows, eager_spans)``: consecutive windows ``(local start, periods)`` of ``W`` periods of ``L``
    tokens, then one window of the remaining ``n % W`` whole periods (a graph of its own size), the first at
    ``first`` (default: the first local index on the boundary grid, ``offset + first`` a multiple of ``L``); and the
    remaining ``(start, end)`` spans in order (the part before ``first`` and the part after the last whole
    period), to run with the ordinary segment loop. Nothing is planned when no whole period fits.
    """
    if first is None:
        first = (-offset) % L  # first local index on the boundary grid (0 when the call starts at a boundary)
    n_full = (T - first) // L if T >= first else 0
    if n_full == 0:
        return [], [(0, T)] if T > 0 else []
    sizes = [W] * (n_full // W) + ([n_full % W] if n_full % W else [])
    windows, s = [], first
    for n in sizes:
        windows.append((s, n))
        s += n * L
    eager = []
    if first > 0:
        eager.append((0, first))
    if s < T:
        eager.append((s, T))
    return windows, eager


class _WindowGraph:
    """Static buffers, the window body and (after ``capture``) its CUDA graph."""

    def __init__(self, proto: dict, L: int, W: int, boundary_fn: Callable, split: bool = False):
        self.L, self.W, self.fn, self.split = L, W, boundary_fn, split
        n = L * W
        self.buf = {name: torch.zeros((t.shape[0], n, *t.shape[2:]), dtype=t.dtype, device=t.device)
                    for name, t in proto.items() if name != "state"}
        st = proto["state"]
        self.state = torch.zeros(st.shape, dtype=torch.float32, device=st.device)
        v = proto["v"]
        self.out = torch.zeros((v.shape[0], n, *v.shape[2:]), dtype=v.dtype, device=v.device)
        self.slots = contract.Slots()  # the truncation kernel's answers, checked after each run (``contract``)
        self.graph = None

    def boundaries_per_window(self, row_starts=None) -> int:
        """Boundary callback calls the eager loop would make in one window: one per distinct row position at each
        boundary, i.e. per period one per distinct row start (``row_starts``; None: a plain run, one per period)."""
        return self.W * (1 if row_starts is None else len(set(row_starts)))

    def body(self) -> None:
        b = self.buf
        S = self.state
        pre = kernels.intra(b["k"], b["v"], b["g"], b["beta"]) if self.split else None
        L = self.L
        with contract.window(self.slots):
            for i in range(self.W):
                sl = slice(i * L, (i + 1) * L)
                if pre is not None:
                    gc, w, u = pre
                    o, S = kernels.segment(b["q"][:, sl], b["k"][:, sl], gc[:, sl], w[:, sl], u[:, sl], S)
                else:
                    o, S = kernels.core(b["q"][:, sl], b["k"][:, sl], b["v"][:, sl], b["g"][:, sl],
                                        b["beta"][:, sl], S)
                self.out[:, sl].copy_(o)
                S = self.fn(S, None)
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
        contract.check_window(self.slots)  # the eager run's states (the recording below runs nothing)
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
        contract.check_window(self.slots)


def split_scan(device, L: int) -> bool:
    """Whether a window body runs fla's chunk-local half once per window (``kernels.intra``) and only the
    state-dependent half per segment (``kernels.segment``): fla on CUDA and L on the 64-token chunk grid; else each
    segment is one ``kernels.core`` call."""
    return kernels.backend_for(device) == "fla" and L % kernels.FLA_CHUNK == 0


def run_windows(q, k, v, g, beta, state, windows: list[tuple[int, int]], L: int, fn: Callable, fn_key,
                out: torch.Tensor, eager: bool = False, row_starts=None) -> tuple | None:
    """Run ``windows`` (consecutive ``(local start, periods)``, from ``plan_windows``) from ``state``.

    Writes their outputs into ``out`` ([B, T, H, V]) and returns ``(state after the last window (float32, a new
    tensor), boundary callback calls the eager loop would have made)``, or None when the first window's graph
    could not be made (the caller then runs these segments eagerly; ``out`` is untouched). A later window whose
    graph cannot be made runs the same body without a graph (the same numbers). ``row_starts``: a batch's rows
    (all on the same boundary grid), only to count the eager loop's calls.
    """
    proto = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "state": state}
    split = split_scan(v.device, L)
    base = (str(v.device), tuple(q.shape[:1]) + tuple(q.shape[2:]), tuple(v.shape[2:]),
            q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype, L)
    n_calls = 0
    S = state
    for i, (s, W) in enumerate(windows):
        key = base + (W, fn_key, split)
        wg = _window_graph(key, proto, L, W, fn, split, eager)
        if wg is None and i == 0:
            return None
        if wg is None:  # capture failed for this size: the same body without a graph
            wg = _WindowGraph(proto, L, W, fn, split)
        wg.state.copy_(S)
        wg.load(q, k, v, g, beta, s)
        if wg.graph is None and not eager and key not in _BROKEN:
            try:
                wg.capture()
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # pragma: no cover - depends on the installed fla / driver
                _BROKEN[key] = repr(e)
                log.warning("CUDA graph capture of the segment loop failed (%r); this window size runs without a "
                            "graph", e)
                torch.cuda.synchronize(v.device)
                if i == 0:
                    return None
                wg = _WindowGraph(proto, L, W, fn, split)
                wg.state.copy_(S)
                wg.load(q, k, v, g, beta, s)
                wg.step()
            else:
                _GRAPHS[key] = wg
                while len(_GRAPHS) > MAX_GRAPHS:
                    _GRAPHS.popitem(last=False)
        else:
            wg.step()
        out[:, s:s + L * W].copy_(wg.out)
        S = wg.state.clone()
        n_calls += wg.boundaries_per_window(row_starts)
    return S, n_calls


def _window_graph(key, proto, L: int, W: int, fn, split: bool, eager: bool) -> "_WindowGraph | None":
    """The cached window graph for ``key`` (moved to the LRU end), a fresh uncaptured one, or None when this key's
    capture failed before."""
    if eager:
        return _WindowGraph(proto, L, W, fn, split)
    if key in _BROKEN:
        return None
    wg = _GRAPHS.get(key)
    if wg is None:
        return _WindowGraph(proto, L, W, fn, split)
    _GRAPHS.move_to_end(key)
    return wg


def clear() -> None:
    """Drop every cached graph (and the record of failed captures)."""
    _GRAPHS.clear()
    _BROKEN.clear()
