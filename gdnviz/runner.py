"""Run token ids through a GDN hybrid in segments of L tokens, with boundary callbacks.

Semantics (seed 000 §3): the document goes through the model in segments of ``segment_len`` tokens; at every
segment boundary (absolute token positions L, 2L, 3L, ...) each GDN head's carried state can be read (capture)
or replaced (truncation) before the next segment reads it.

Design: one model forward, not a loop of forwards over a cache. Layer l+1 only reads layer l's outputs, so each
GDN layer can scan its own segments inside its kernel call and call the boundary callbacks between them; the
full-attention layers, MLPs and short convolutions see the whole sequence, exactly as they would through a
cache. ``cache_loop`` (below) is the plain segment-by-segment loop through the model's cache; tests pin the
two together, with and without truncation.

The adapters (``gdnviz.models``) route every GDN kernel call of a loaded model to ``gdn_scan`` while a
``RunContext`` is active; outside a run the model behaves exactly as without gdnviz.

Callbacks (``RunContext.callbacks``) implement any subset of ``gdnviz.callbacks.BoundaryCallback`` (its docstring
documents every member: ``on_layer_input``, ``on_core_input``, ``on_boundary``, ``on_boundaries``, ``on_layer_end``,
``modifies_state``, ``graph_boundary``, ``note_graph_boundaries``); ``gdnviz.callbacks.Dispatch`` calls them.

Read-only runs (capture): when every boundary callback declares ``modifies_state = False``, nothing it does can
change what the next segment reads, so on CUDA with fla (boundaries on fla's 64-token chunk grid) each layer's
call is ONE chunk pass that also writes the fp32 state at every chunk start
(``gdnviz.gdn.kernels.core_with_states``) instead of one kernel call per segment; ``RunContext.fast_states=False``
forces the segment loop (tests pin the two together on CUDA).

Runs without boundary callbacks (untouched generation, losses, untouched rows of a sweep) on CUDA with fla: one
kernel call per GDN layer call, nothing read out (``readouts`` "one-call"). State-replacing runs (truncation) on
CUDA replay their segment loop from CUDA-graph windows (``gdnviz.gpu.scan_graph``, see ``_graph_plan``).

Left-padded batches (``gdnviz.probes.batch``): ``RunContext.row_starts`` gives each row's number of leading pad
tokens. Then every pad position is the exact core no-op (g = 0 i.e. alpha = 1, beta = 0, q = k = v = 0), each row's
positions count from its own first real token, and boundaries fall at each row's own multiples of L. A call of at
least L tokens is scanned in a layout where every row's boundaries fall on the same columns (``_aligned``: each row's
tokens shifted, outputs moved back), so each segment is one kernel call for all rows; a shorter call (a decode step)
cuts at the union of the rows' boundaries. ``on_boundary`` is called once per distinct position with the sub-batch
``state[rows]`` of the rows that reached it and their batch indices ``rows``. ``row_starts=None`` (the default) is
the plain behaviour above.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from gdnviz.callbacks import BoundaryCallback, Dispatch
from gdnviz.errors import BadSegmentLength
from gdnviz.gdn import kernels
from gdnviz.gpu import scan_graph

DEFAULT_SEGMENT_LEN = 256


@dataclass
class RunContext:
    """State of one segmented run; lives in a context variable while the model forward runs."""

    segment_len: int
    callbacks: list[BoundaryCallback] = field(default_factory=list)
    offsets: dict = field(default_factory=dict)  # GDN layer index -> tokens that layer has consumed
    current_layer: int | None = None
    backends: set = field(default_factory=set)  # kernel paths that ran: {"fla", "torch"}
    row_starts: list | None = None  # left-padded batch: leading pad tokens per row (see the module docstring)
    fast_states: bool = True  # allow the one-pass state read-out when every callback only reads (see gdn_scan)
    readouts: set = field(default_factory=set)  # how GDN calls ran: "one-pass", "segment-loop", "segment-graph", ...
    graphs: bool | str = True  # CUDA-graph windows for state-replacing runs on CUDA (see _graph_plan); "eager": the
    # same windows without a graph, on any device (tests)

    @property
    def dispatch(self) -> Dispatch:
        """The callbacks' optional members, looked up and called in one place (``gdnviz.callbacks``)."""
        return Dispatch(self.callbacks)


_ACTIVE: contextvars.ContextVar[RunContext | None] = contextvars.ContextVar("gdnviz_run", default=None)


def active() -> RunContext | None:
    """The RunContext of the run in progress, or None outside a run."""
    return _ACTIVE.get()


@contextlib.contextmanager
def run_context(ctx: RunContext):
    token = _ACTIVE.set(ctx)
    try:
        yield ctx
    finally:
        _ACTIVE.reset(token)


def check_segment_len(segment_len: Any) -> int:
    if isinstance(segment_len, bool) or not isinstance(segment_len, int) or segment_len < 1:
        raise BadSegmentLength(f"segment length must be a positive integer number of tokens, got {segment_len!r}")
    return segment_len


def boundary_cuts(offset: int, length: int, segment_len: int) -> list[int]:
    """Local indices c in (0, length] where offset + c is a multiple of segment_len."""
    first = (offset // segment_len + 1) * segment_len
    return list(range(first - offset, length + 1, segment_len))


def fast_qk_norm(ctx: RunContext | None, device) -> bool:
    """Whether :func:`prepare_core_inputs` hands q̂, k̂ back in the value dtype (``kernels.unit_rows``): inside a
    run, fla on CUDA, and no callback reads the float32 keys (``on_layer_input``). Elsewhere (CPU, outside a run,
    a capture) the float32 normalisation ``kernels.l2norm`` runs."""
    return (ctx is not None and kernels.backend_for(device) == "fla" and not ctx.dispatch.reads_keys())


def prepare_core_inputs(query, key, num_value_heads: int, ctx: RunContext | None = None, dtype=None):
    """L2-normalise q and k (fp32, eps 1e-6) and repeat key heads to value heads (repeat_interleave).

    With ``ctx`` and ``dtype`` (the values' dtype) where :func:`fast_qk_norm` allows it, q̂ and k̂ are computed
    straight into ``dtype`` (``kernels.unit_rows``): the kernels read them in that dtype anyway, and nothing reads
    the float32 copies."""
    if dtype is not None and fast_qk_norm(ctx, query.device):
        q_hat, k_hat = kernels.unit_rows(query, dtype), kernels.unit_rows(key, dtype)
    else:
        q_hat, k_hat = kernels.l2norm(query), kernels.l2norm(key)
    if k_hat.shape[2] != num_value_heads:
        rep = num_value_heads // k_hat.shape[2]
        q_hat = q_hat.repeat_interleave(rep, dim=2)
        k_hat = k_hat.repeat_interleave(rep, dim=2)
    return q_hat, k_hat


@dataclass(frozen=True)
class _Rows:
    """Where each row of a left-padded batch has real tokens in one layer call: local columns ``[lo[b], hi[b])``.
    ``starts[b]``: the column of the row's first real token in the run's coordinates, so the row's own position
    after local index ``c`` is ``offset + c − starts[b]``. Row b takes a boundary at cut ``c`` when
    ``lo[b] < c ≤ hi[b]`` and that position is a positive multiple of L. ``shift``: per row, how far the aligned
    layout moved its tokens (``_aligned``; None: the call's own layout)."""

    starts: tuple
    lo: tuple
    hi: tuple
    shift: tuple | None = None


def _call_rows(ctx: RunContext, offset: int, T: int) -> _Rows:
    """The rows as the call gives them (left padding: every row's real tokens end at T)."""
    return _Rows(tuple(ctx.row_starts), tuple(max(0, s - offset) for s in ctx.row_starts), (T,) * len(ctx.row_starts))


def _aligned(rows: _Rows, offset: int, L: int) -> tuple[_Rows, int] | None:
    """A layout of the call in which every row reaches its boundaries on the same columns (the local columns
    that are multiples of L): row b's tokens move by ``shift[b]`` ≡ −(start − offset) (mod L), chosen so the layout is as
    narrow as possible (the widest-needing row at its least shift, every other row as far right as that width
    allows; leading padding common to all rows drops out). Then the segment loop makes one kernel call per segment
    for all rows, each on the same token span as the row alone, instead of one call per distinct row phase; the pads
    stay the core no-op. Returns (the rows in the new layout, the width change Δ: the layout has T + Δ columns), or
    None when every shift is 0."""
    need = [(-(s - offset)) % L for s in rows.starts]
    least = [d - ((d + lo) // L) * L for d, lo in zip(need, rows.lo)]
    width = max(least)
    shift = [width - ((width - d) % L) for d in need]
    if not any(shift):
        return None
    return (_Rows(tuple(s + d for s, d in zip(rows.starts, shift)), tuple(lo + d for lo, d in zip(rows.lo, shift)),
                  tuple(hi + d for hi, d in zip(rows.hi, shift)), tuple(shift)), width)


def _relayout(x: torch.Tensor, shift, lo, hi, width: int) -> torch.Tensor:
    """``x [B, T, ...]`` → ``[B, T', ...]`` with ``y[b, j] = x[b, j − shift[b]]`` on ``[lo[b], hi[b])``, 0 elsewhere."""
    B, T = x.shape[:2]
    dev = x.device
    j = torch.arange(width, device=dev).reshape(1, width)
    sh = torch.as_tensor(shift, device=dev).reshape(B, 1)
    keep = (j >= torch.as_tensor(lo, device=dev).reshape(B, 1)) & (j < torch.as_tensor(hi, device=dev).reshape(B, 1))
    idx = (j - sh).clamp(0, T - 1)
    tail = (1,) * (x.dim() - 2)
    y = torch.gather(x, 1, idx.reshape(B, width, *tail).expand(B, width, *x.shape[2:]))
    return torch.where(keep.reshape(B, width, *tail), y, torch.zeros((), dtype=x.dtype, device=dev))


def _row_boundaries(rows: _Rows, offset: int, end: int, L: int) -> dict:
    """{position: [rows]} of the rows that take a boundary at local cut ``end`` (``_Rows``)."""
    groups: dict = {}
    for b, (start, lo, hi) in enumerate(zip(rows.starts, rows.lo, rows.hi)):
        pos = offset + end - start
        if lo < end <= hi and pos > 0 and pos % L == 0:
            groups.setdefault(pos, []).append(b)
    return groups


def step_boundaries(starts, offset: int, L: int) -> dict:
    """{position: [rows]} of the batch rows (first real token at column ``starts[b]``) that take a boundary after
    a one-token call at ``offset`` (a decode step): the grouping the segment loop gives that call."""
    n = len(starts)
    return _row_boundaries(_Rows(tuple(starts), tuple(max(0, s - offset) for s in starts), (1,) * n), offset, 1, L)


def _row_cuts(rows: _Rows, offset: int, T: int, L: int) -> list[int]:
    """The local cuts in (0, T] where some row takes a boundary."""
    return sorted({c for start, lo, hi in set(zip(rows.starts, rows.lo, rows.hi))
                   for c in boundary_cuts(offset - start, T, L) if lo < c <= hi and offset + c - start > 0})


def _mask_pads(rows: _Rows, q_hat, k_hat, v, g, beta):
    """Make every left-pad position the exact core no-op: g = 0 (alpha = 1), beta = 0, and q = k = v = 0."""
    B, T = v.shape[:2]
    if max(rows.lo) == 0:
        return q_hat, k_hat, v, g, beta
    starts = torch.as_tensor(rows.lo, device=v.device).reshape(B, 1)
    pad = torch.arange(T, device=v.device).reshape(1, T) < starts  # [B, T]
    p3, p4 = pad[:, :, None], pad[:, :, None, None]
    zero = torch.zeros((), device=v.device)
    return (torch.where(p4, zero, q_hat).to(q_hat.dtype), torch.where(p4, zero, k_hat).to(k_hat.dtype),
            torch.where(p4, zero, v).to(v.dtype), torch.where(p3, zero, g).to(g.dtype),
            torch.where(p3, zero, beta).to(beta.dtype))


def _on_device(dev: torch.device):
    """Make the layer's CUDA device current while it scans (Triton launches, CUDA-graph capture and the callbacks'
    streams use the current device): a model spread over several GPUs (``device_map``) runs each GDN layer on its
    own. A no-op on CPU and where the layer's device is already current (one-device models)."""
    if dev.type != "cuda" or dev.index is None or dev.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(dev)


def gdn_scan(ctx: RunContext, layer: int, q_hat, k_hat, v, g, beta, initial_state):
    """Scan one GDN layer's call segment by segment, calling the boundary callbacks between segments.

    q_hat, k_hat: [B, T, H, K] unit rows (queries unscaled); v: [B, T, H, V]; g, beta: [B, T, H];
    initial_state: [B, H, K, V] or None (zeros). Returns (out [B, T, H, V] in v.dtype, final [B, H, K, V] fp32).
    Everything runs on the layer's device (the device of ``v``), where the callbacks receive its states.
    """
    with _on_device(v.device):
        return _gdn_scan(ctx, layer, q_hat, k_hat, v, g, beta, initial_state)


def _gdn_scan(ctx: RunContext, layer: int, q_hat, k_hat, v, g, beta, initial_state):
    B, T, H, _ = v.shape
    K, V = k_hat.shape[-1], v.shape[-1]
    offset = ctx.offsets.get(layer, 0)
    g = g.float()
    state = (torch.zeros(B, H, K, V, device=v.device, dtype=torch.float32)
             if initial_state is None else initial_state.float())
    rows_mode = ctx.row_starts is not None
    rows = None
    if rows_mode:
        if len(ctx.row_starts) != B:
            raise ValueError(f"RunContext.row_starts has {len(ctx.row_starts)} rows, the batch has {B}")
        rows = _call_rows(ctx, offset, T)
        q_hat, k_hat, v, g, beta = _mask_pads(rows, q_hat, k_hat, v, g, beta)
    calls = ctx.dispatch
    calls.layer_input(layer, offset, k_hat, g, beta)
    calls.core_input(layer, offset, q_hat, k_hat, v, g, beta)
    ctx.backends.add(kernels.backend_for(v.device))
    q_in = q_hat.to(v.dtype) if v.dtype != torch.float32 else q_hat
    k_in = k_hat.to(v.dtype) if v.dtype != torch.float32 else k_hat
    L = ctx.segment_len
    cuts = _row_cuts(rows, offset, T, L) if rows_mode else boundary_cuts(offset, T, L)
    if (not cuts or not calls.acts_at_boundaries()) and kernels.backend_for(v.device) == "fla":
        # nothing happens at any boundary (none in this call, e.g. a decode step between boundaries, or no callback
        # acts at one): one kernel call, what the segment loop would run (pads are the exact no-op; fla's chunk
        # kernel gives the loop's result, and no state read-out is computed for nobody). Host work only: a decode
        # step replayed from a CUDA graph (gdnviz.static_decode) captures just this call
        ctx.readouts.add("one-call")
        out, state = kernels.core(q_in, k_in, v, g, beta, state)
        return _finish(ctx, layer, offset, T, out, state, v.dtype)
    one_pass = None
    if not rows_mode and ctx.fast_states and calls.reads_only() and kernels.states_fast_path(v.device, T, cuts):
        one_pass = _try_one_pass(q_in, k_in, v, g, beta, state, cuts)
    if one_pass is not None:
        ctx.readouts.add("one-pass")
        out, state, states = one_pass
        calls.read_states(layer, [offset + c for c in cuts], states)
        return _finish(ctx, layer, offset, T, out, state, v.dtype)
    plan = _graph_plan(ctx, calls, layer, v)
    if plan == "noop":  # no callback does anything in this layer: one kernel call (fla: same result as the loop)
        ctx.readouts.add("one-call")
        out, state = kernels.core(q_in, k_in, v, g, beta, state)
        return _finish(ctx, layer, offset, T, out, state, v.dtype)
    aligned = _aligned(rows, offset, L) if rows_mode and T >= L else None
    if aligned is None:
        out, state = _scan(ctx, calls, layer, offset, q_in, k_in, v, g, beta, state, cuts, rows, plan)
        return _finish(ctx, layer, offset, T, out, state, v.dtype)
    # a left-padded batch whose rows reach their boundaries at different columns: scan it in the layout where they
    # all reach them at the same ones (``_aligned``), then move the outputs back
    ctx.readouts.add("aligned-rows")
    new, width = aligned
    Tn = T + width
    q2, k2, v2, g2, b2 = (_relayout(x, new.shift, new.lo, new.hi, Tn) for x in (q_in, k_in, v, g, beta))
    o2, state = _scan(ctx, calls, layer, offset, q2, k2, v2, g2, b2, state, _row_cuts(new, offset, Tn, L), new, plan)
    back = [-d for d in new.shift]
    out = _relayout(o2, back, rows.lo, rows.hi, T)
    return _finish(ctx, layer, offset, T, out, state, v.dtype)


def _scan(ctx: RunContext, calls: Dispatch, layer: int, offset: int, q_in, k_in, v, g, beta, state, cuts,
          rows: "_Rows | None", plan):
    """The segments of one call with the callbacks at ``cuts``: in CUDA-graph windows where ``plan`` (``_graph_plan``)
    allows and every row (``rows``; None: no batch rows) takes every boundary of a window, the rest in the plain
    segment loop. Returns (out [B, T, H, V], state)."""
    T = v.shape[1]
    if plan is not None:
        fn, fn_key, owner = plan
        L = ctx.segment_len
        if rows is not None:  # windows from the first cut after every row has started to the last before any ends
            # (starting at a cut keeps the kernel calls exactly the loop's: an extra split would change rounding)
            first = min((c for c in cuts if c >= max(rows.lo)), default=T)
            windows, _ = scan_graph.plan_windows(offset, min(rows.hi), L, first=first)
            if len({(offset - s) % L for s in rows.starts}) > 1:
                windows = []  # rows off each other's boundary grid: the segment loop (``_aligned`` avoids this)
        else:
            windows, _ = scan_graph.plan_windows(offset, T, L)
        if windows:
            out = torch.empty_like(v)
            s0 = windows[0][0]
            end = windows[-1][0] + windows[-1][1] * L
            o, state = _segment_loop(ctx, layer, offset, q_in, k_in, v, g, beta, state, cuts, rows, 0, s0)
            out[:, :s0] = o
            res = scan_graph.run_windows(q_in, k_in, v, g, beta, state, windows, L, fn, fn_key, out,
                                         eager=ctx.graphs == "eager",
                                         row_starts=None if rows is None else rows.starts)
            if res is not None:
                ctx.readouts.add("segment-graph")
                state, n_calls = res
                calls.graph_boundaries_ran(owner, layer, n_calls)
                o, state = _segment_loop(ctx, layer, offset, q_in, k_in, v, g, beta, state, cuts, rows, end, T)
                out[:, end:] = o
                return out, state
            # no graph: the rest runs the ordinary loop
            o, state = _segment_loop(ctx, layer, offset, q_in, k_in, v, g, beta, state, cuts, rows, s0, T)
            out[:, s0:] = o
            return out, state
    return _segment_loop(ctx, layer, offset, q_in, k_in, v, g, beta, state, cuts, rows, 0, T)


def _segment_loop(ctx: RunContext, layer: int, offset: int, q_in, k_in, v, g, beta, state, cuts, rows, lo: int,
                  hi: int):
    """The plain scan of local tokens [lo, hi): one kernel call per segment, callbacks at every cut in (lo, hi]
    (for the batch rows ``rows`` that take it; None: a plain run). Returns (out [B, hi - lo, H, V], state)."""
    calls = ctx.dispatch
    edges = sorted({c for c in cuts if lo < c <= hi} | {hi})
    outs, start = [], lo
    if hi <= lo:
        return v[:, lo:lo], state
    ctx.readouts.add("segment-loop")
    for end in edges:
        if end > start:
            o, state = kernels.core(q_in[:, start:end], k_in[:, start:end], v[:, start:end],
                                    g[:, start:end], beta[:, start:end], state)
            outs.append(o)
        if rows is not None:
            if end > 0:
                for pos, rs in sorted(_row_boundaries(rows, offset, end, ctx.segment_len).items()):
                    state = calls.row_boundary(layer, pos, state, torch.tensor(rs, device=state.device))
        elif (offset + end) % ctx.segment_len == 0 and end > 0:
            state = calls.boundary(layer, offset + end, state)
        start = end
    out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    return out, state


def _graph_plan(ctx: RunContext, calls: Dispatch, layer: int, v):
    """How this layer's segments may run:

    - ``"noop"``: every boundary callback says it does nothing in this layer (``graph_boundary`` returned
      ``"noop"``) and fla runs the core: one kernel call over all tokens (the boundaries change nothing);
    - ``(fn, key, owner)``: exactly one callback replaces states here, with a capture-safe boundary function
      ``fn(state, rows) -> state``, and the others do nothing: segments run in CUDA-graph windows
      (``gdnviz.gpu.scan_graph``; in a left-padded batch laid out by ``_aligned``, from the first boundary after
      every row has started to the last before any row ends) on CUDA with fla, or in the same windows without a
      graph when ``ctx.graphs == "eager"`` (tests);
    - None: the ordinary segment loop (CPU, callbacks without ``graph_boundary``, ``ctx.graphs`` False, ...).
    """
    if not ctx.graphs or not ctx.callbacks:
        return None
    fla = kernels.backend_for(v.device) == "fla"
    if ctx.graphs is True and not fla:
        return None
    plan = calls.graph_plan(layer, v.device)
    return None if plan == "noop" and not fla else plan


_ONE_PASS_BROKEN: list = []  # the first failure of the one-pass read-out in this process (then never tried again)


def _try_one_pass(q, k, v, g, beta, state, cuts):
    """``kernels.core_with_states`` or None when it fails (fla internals changed, say): the caller then runs the
    segment loop, which computes the same thing. Out-of-memory is not swallowed."""
    if _ONE_PASS_BROKEN:
        return None
    try:
        return kernels.core_with_states(q, k, v, g, beta, state, cuts)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # pragma: no cover - depends on the installed fla
        import logging

        _ONE_PASS_BROKEN.append(repr(e))
        logging.getLogger(__name__).warning("one-pass state read-out failed (%r); using the segment loop", e)
        return None


def _finish(ctx: RunContext, layer: int, offset: int, T: int, out, state, dtype):
    ctx.offsets[layer] = offset + T
    ctx.dispatch.layer_end(layer, offset + T, state)
    return out.to(dtype), state


@dataclass
class RunOutput:
    """What a segmented forward returns.

    hidden: [B, T, hidden] final hidden states (after the final norm) or None;
    logits: [B, P, vocab] float32 at ``logits_positions`` (P positions) or None;
    cache: the model cache when ``use_cache`` was set; backends: kernel paths that ran; readouts: how the GDN
    calls ran ("one-pass": one chunk pass with the states read out; "segment-loop": one kernel call per segment).
    """

    hidden: torch.Tensor | None
    logits: torch.Tensor | None
    cache: Any
    backends: set
    readouts: set = field(default_factory=set)


def forward(lm, input_ids: torch.Tensor, *, segment_len: int = DEFAULT_SEGMENT_LEN, callbacks: Iterable = (),
            cache=None, use_cache: bool = False, logits_positions=None, keep_hidden: bool = True,
            ctx: RunContext | None = None, attention_mask=None, position_ids=None,
            fast_states: bool = True) -> RunOutput:
    """One segmented forward of ``input_ids`` ([B, T] long) through ``lm`` (a ``gdnviz.models.LoadedModel``).

    logits_positions: None (no logits), "last", "all", or a list/tensor of positions: logits are computed only
    there, so a 128K-token document never materialises [T, vocab].
    ctx: pass an existing RunContext to continue a run (decoding after a prefill): offsets carry over.
    attention_mask / position_ids ([B, T_total] / [B, T]): passed to the model for left-padded batches
    (``gdnviz.probes.batch``; set ``ctx.row_starts`` too); None keeps the plain call.
    fast_states: False forces the segment-by-segment scan even for read-only callbacks (module docstring).
    """
    check_segment_len(segment_len)
    if ctx is None:
        ctx = RunContext(segment_len=segment_len, callbacks=list(callbacks), fast_states=fast_states)
    input_ids = input_ids.to(lm.device)
    with torch.inference_mode(), run_context(ctx):
        if use_cache and cache is None:
            cache = lm.adapter.new_cache(lm.model, batch_size=input_ids.shape[0])
        extra = {}
        if attention_mask is not None:
            extra["attention_mask"] = attention_mask.to(lm.device)
        if position_ids is not None:
            extra["position_ids"] = position_ids.to(lm.device)
        hidden = lm.adapter.base_forward(lm.model, input_ids, cache=cache, use_cache=use_cache, **extra)
        logits = None
        if logits_positions is not None:
            if isinstance(logits_positions, str) and logits_positions == "last":
                h = hidden[:, -1:]
            elif isinstance(logits_positions, str) and logits_positions == "all":
                h = hidden
            else:
                h = hidden[:, torch.as_tensor(logits_positions, device=hidden.device)]
            logits = lm.adapter.lm_head(lm.model, h).float()
    return RunOutput(hidden=hidden if keep_hidden else None, logits=logits, cache=cache, backends=set(ctx.backends),
                     readouts=set(ctx.readouts))


def cache_loop(lm, input_ids: torch.Tensor, *, segment_len: int = DEFAULT_SEGMENT_LEN, on_boundary=None,
               logits: bool = True):
    """The plain reference: the model called once per segment through its own cache.

    After each segment call, for every GDN layer, ``on_boundary(layer, position, state [B,H,K,V])`` may return a
    replacement state that is written back into the cache (only when ``position`` is a multiple of L).
    Returns (logits [B, T, vocab] float32 or None, {layer: final state [B, H, K, V]}, cache).
    """
    check_segment_len(segment_len)
    input_ids = input_ids.to(lm.device)
    ad = lm.adapter
    cache = ad.new_cache(lm.model, batch_size=input_ids.shape[0])
    T = input_ids.shape[1]
    outs = []
    with torch.inference_mode():
        for s in range(0, T, segment_len):
            h = ad.base_forward(lm.model, input_ids[:, s:s + segment_len], cache=cache, use_cache=True)
            if logits:
                outs.append(ad.lm_head(lm.model, h).float())
            end = min(s + segment_len, T)
            if on_boundary is not None and end % segment_len == 0:
                for layer in lm.info.gdn_layers:
                    new = on_boundary(layer, end, ad.get_state(cache, layer).clone())
                    if new is not None:
                        ad.set_state(cache, layer, new)
        states = {layer: ad.get_state(cache, layer).clone() for layer in lm.info.gdn_layers}
    return (torch.cat(outs, dim=1) if logits else None), states, cache
