"""Greedy decode steps through a StaticCache, replayed from one CUDA graph between boundaries.

Why: a retrieval sweep is decode-bound and one decode step of a 24-layer model is host work (measurements:
docs/runner.md). transformers' ``StaticCache`` keeps every tensor a decode step writes at a fixed address (the
attention keys and values are written by ``index_copy_`` at a device-side length, the GDN conv and recurrent states
are updated in place), so one step can be captured and replayed with only the token, its position and one mask
column changed between replays.

What it does (:class:`StaticDecoder`), after a prefill through gdnviz's runner into its usual DynamicCache:

1. copies that cache into a StaticCache of ``prompt + steps`` positions (the attention layers' keys and values, the
   GDN layers' conv and recurrent states) through the cache layers' own ``update`` methods;
2. runs each step with static inputs: the token ``[B, 1]``, position ids ``[B, 1]`` (each row's own position in a
   left-padded batch) and an additive attention mask ``[B, 1, 1, prompt + steps]`` in the model's dtype (0 where a
   column is visible: the row's real prompt tokens and the tokens decoded so far; the dtype's minimum elsewhere),
   passed to the model as its per-layer-type mask mapping, so transformers builds no mask;
3. inside the same ``RunContext`` as the prefill, so the GDN layers go through ``gdnviz.runner.gdn_scan`` and
   **truncation continues at every row's own boundaries**. A step is one fla kernel call per GDN layer, replayed
   from one CUDA graph captured at the first step without a boundary after one eager warm-up step. After a
   replayed step after which some row's position is a multiple of L, the boundary callbacks cut those rows' states
   in the static cache (``Dispatch.row_boundary``, as the eager step's segment loop calls it: the step's own output
   read the uncut state there too). Steps before the capture that reach a boundary run eagerly. The Python side of
   a replayed step (the layers' token counts in ``RunContext.offsets``) is advanced by hand.

When the graph is used (:func:`graph_reason` returns None): CUDA with fla, a transformers-family model (Qwen3.5,
Qwen3.5-MoE, Qwen3-Next) with sdpa or eager attention, and no callbacks but gdnviz's truncation (a recorder's
``on_layer_end`` would not run on replays); elsewhere the steps go through the run's DynamicCache. A capture that
fails (an operation that syncs with the host) is logged once per model class, dtype and experts implementation
(:func:`_failure_key`), and that decoder runs its steps eagerly through the StaticCache; the capture executes
nothing, so no state is lost. Mixture-of-experts models capture in bfloat16 with transformers' ``grouped_mm`` or
``batched_mm`` experts (a replay equals the eager step bit for bit); float32 ``grouped_mm`` (its fallback copies
group offsets to the host) and ``eager`` experts (a loop over the experts hit) do not, and fall back.

On CUDA the attention layers of a step attend through :mod:`gdnviz.gpu.decode_attention` (keys split over many
programs; a float64 reference beside it), where it applies; elsewhere through transformers' SDPA.

Exactness: the eager static step computes what the runner's DynamicCache step computes, except that attention runs
over the static buffer with an explicit mask (float32 CPU tests: logits within 1e-5, greedy tokens equal, batched
and truncated, tests/test_static_decode.py); a replay is the eager static step bit for bit (GPU tests). In bfloat16
the two attention forms can round differently, so a near-tie can decode another token than the DynamicCache path.
"""
from __future__ import annotations

import logging

import torch

from gdnviz import runner
from gdnviz.gdn import kernels
from gdnviz.gpu import decode_attention

__all__ = ["StaticDecoder", "decoder_for", "graph_reason"]

_FAILED: dict = {}  # _failure_key(model) -> why its capture failed (then never tried again in this process)
_LOG = logging.getLogger(__name__)


def graph_reason(lm, ctx: runner.RunContext, device) -> str | None:
    """Why decode steps of ``lm`` in ``ctx`` cannot be replayed from a CUDA graph, or None when they can."""
    from gdnviz.truncation import TruncateCallback

    if torch.device(device).type != "cuda" or kernels.backend_for(device) != "fla":
        return "needs CUDA with fla"
    if lm.info.family == "fla":
        return "fla-family models decode through their own cache"
    if lm.info.device_map:
        return "the model is spread over several devices (device_map)"
    impl = getattr(lm.model.config, "_attn_implementation", None) or "sdpa"
    if impl not in ("sdpa", "eager"):
        return f"attention implementation {impl!r} (sdpa or eager only)"
    if any(type(cb) is not TruncateCallback for cb in ctx.callbacks):
        return "callbacks other than truncation"
    key = _failure_key(lm.model)
    if key in _FAILED:
        return f"an earlier capture failed for {key}: {_FAILED[key]}"
    return None


def _failure_key(model) -> str:
    """What a failed capture is remembered by: the model class, its dtype and its experts implementation — whether
    a step captures depends on all three (transformers' default ``grouped_mm`` experts capture in bfloat16 but not
    in float32, whose fallback copies the group offsets to the host; ``eager`` experts never)."""
    experts = getattr(model.config, "_experts_implementation", None)
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    return f"{type(model).__name__} ({dtype}" + (f", experts {experts})" if experts else ")")


def static_copy(model, cache, max_cache_len: int):
    """A ``StaticCache`` of ``max_cache_len`` positions holding what the DynamicCache ``cache`` holds: each attention
    layer's keys and values at positions 0 … P−1 (its length P on the device), each GDN layer's conv and recurrent
    states — written through the layers' own ``update`` / ``update_conv_state`` / ``update_recurrent_state``."""
    from transformers import StaticCache

    static = StaticCache(config=model.config, max_cache_len=max_cache_len)
    if len(static.layers) != len(cache.layers):
        raise RuntimeError(f"StaticCache has {len(static.layers)} layers, the run's cache {len(cache.layers)}")
    for d, s in zip(cache.layers, static.layers):
        if getattr(d, "is_initialized", False) and getattr(d, "keys", None) is not None and d.keys.numel():
            s.update(d.keys, d.values)
        conv = getattr(d, "conv_states", None)
        if conv is not None and getattr(d, "is_conv_states_initialized", {}).get(0, False):
            s.update_conv_state(conv[0], state_idx=0)
        rec = getattr(d, "recurrent_states", None)
        if rec is not None and getattr(d, "is_recurrent_states_initialized", {}).get(0, False):
            s.update_recurrent_state(rec[0], state_idx=0)
    return static


def decoder_for(lm, ctx: runner.RunContext, cache, max_new_tokens: int, **kw) -> "StaticDecoder | None":
    """The decoder ``gdnviz.generate`` and ``gdnviz.probes.batch`` use for the ``max_new_tokens - 1`` steps after a
    prefill, or None where the graph cannot be used (:func:`graph_reason`): they then decode through ``cache``.
    ``kw``: :class:`StaticDecoder`'s ``attention_mask`` and ``positions``. The caller should drop its references to
    ``cache`` once it has a decoder (the StaticCache holds a copy)."""
    if max_new_tokens < 2 or graph_reason(lm, ctx, lm.device) is not None:
        return None
    return StaticDecoder(lm, ctx, cache, max_new_tokens - 1, **kw)


class StaticDecoder:
    """Decode ``steps`` tokens after a prefill (module docstring).

    lm: a ``gdnviz.models.LoadedModel``; ctx: the prefill's RunContext (continued); cache: the prefill's
    DynamicCache (not modified); attention_mask: the prefill's 2-D mask ``[B, P]`` (1 = token, 0 = left pad) or None
    (every column a token); positions: each row's position of its first decoded token ``[B]`` (None: P);
    graph: replay steps between boundaries from a CUDA graph (CUDA only; see :func:`graph_reason`).
    """

    def __init__(self, lm, ctx: runner.RunContext, cache, steps: int, *, attention_mask=None, positions=None,
                 graph: bool = True):
        model = lm.model
        dev = lm.device
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self.ctx = ctx
        if attention_mask is None:  # batch 1, no padding: every column the GDN layers consumed is a token
            attention_mask = torch.ones(1, self._offset(), dtype=torch.long)
        B, P = attention_mask.shape
        if self._offset() != P:
            raise ValueError(f"the attention mask has {P} columns, the run's GDN layers consumed {self._offset()}")
        self.lm, self.B, self.P, self.steps = lm, B, P, steps
        self.static = static_copy(model, cache, P + steps)
        if torch.device(dev).type == "cuda":
            decode_attention.install()
        dtype = next(model.parameters()).dtype
        self.tok = torch.zeros(B, 1, dtype=torch.long, device=dev)
        first = torch.full((B,), P) if positions is None else torch.as_tensor(positions).reshape(B)
        self.pos = first.to(device=dev, dtype=torch.long).reshape(B, 1).clone()
        self.mask = torch.full((B, 1, 1, P + steps), torch.finfo(dtype).min, dtype=dtype, device=dev)
        self.mask[:, 0, 0, :P].masked_fill_(attention_mask.to(dev).bool(), 0.0)
        self.mask_arg = {"full_attention": self.mask, "linear_attention": None}
        self.starts = list(ctx.row_starts) if ctx.row_starts is not None else [0] * B
        self.i = 0
        self.reason = graph_reason(lm, ctx, dev) if graph else "graph=False"
        self.graph = None
        self.out = None
        self.warm = False
        self.replays = 0
        self.boundary_replays = 0  # replayed steps after which some row's boundary was applied to the cache

    # -- one step ------------------------------------------------------------------------------------
    def step(self, tokens) -> torch.Tensor:
        """Feed ``tokens`` (``[B]`` ids, a tensor on any device or a list) at this step's position; returns the
        next-token logits ``[B, vocab]`` float32 (a tensor of its own)."""
        if self.i >= self.steps:
            raise RuntimeError(f"StaticDecoder was built for {self.steps} steps")
        tok = torch.as_tensor(tokens).reshape(self.B, 1)
        self.tok.copy_(tok)
        if self.i:
            self.pos.add_(1)
        self.mask[:, 0, 0, self.P + self.i] = 0.0
        offset = self._offset()
        if self.reason is None and self.graph is not None:
            self.graph.replay()
            for layer in self.ctx.offsets:
                self.ctx.offsets[layer] += 1
            self.replays += 1
            self.ctx.readouts.add("decode-graph")
            logits = self.out.clone()
            self._cut_boundary_rows(offset)
        elif self.reason is not None or self._at_boundary(offset):
            logits = self._forward()
        elif not self.warm:  # one eager step first: Triton compiles, cuBLAS and the allocator settle
            logits = self._forward()
            self.warm = True
        else:
            logits = self._capture()
        self.i += 1
        return logits

    def _offset(self) -> int:
        """Tokens every GDN layer has consumed (all equal between steps)."""
        seen = set(self.ctx.offsets.values())
        if len(seen) != 1:
            raise RuntimeError(f"GDN layers disagree on the tokens consumed: {sorted(seen)}")
        return seen.pop()

    def _at_boundary(self, offset: int) -> bool:
        """Whether, after this step's token, some row's own position is a positive multiple of L and a callback
        acts at boundaries (before the capture such a step runs eagerly; after it, the cut follows the replay)."""
        return bool(self._boundary_rows(offset))

    def _boundary_rows(self, offset: int) -> dict:
        """{position: [rows]} of the rows whose own position after this step's token (``offset`` consumed before
        it) is a positive multiple of L, as the eager step's segment loop groups them; {} when no callback acts at
        boundaries."""
        if not self.ctx.dispatch.acts_at_boundaries():
            return {}
        return runner.step_boundaries(self.starts, offset, self.ctx.segment_len)

    def _cut_boundary_rows(self, offset: int) -> None:
        """After a replayed step: the boundary of every row that reached one, applied to each GDN layer's state in
        the StaticCache as the eager step applies it (``Dispatch.row_boundary`` per position, in order). Exact: the
        step's output read the state before the cut in the eager step too; only the next steps read the cut."""
        groups = self._boundary_rows(offset)
        if not groups:
            return
        calls, adapter = self.ctx.dispatch, self.lm.adapter
        dev = self.tok.device
        groups = [(pos, torch.tensor(rows, device=dev)) for pos, rows in sorted(groups.items())]
        with torch.inference_mode():
            for layer in self.ctx.offsets:
                state = adapter.get_state(self.static, layer)
                new = state
                for pos, rows in groups:
                    new = calls.row_boundary(layer, pos, new, rows)
                if new is not state:
                    adapter.set_state(self.static, layer, new)
        self.boundary_replays += 1

    def _forward(self) -> torch.Tensor:
        lm = self.lm
        with torch.inference_mode(), runner.run_context(self.ctx), decode_attention.active():
            hidden = lm.adapter.base_forward(lm.model, self.tok, cache=self.static, use_cache=True,
                                             attention_mask=self.mask_arg, position_ids=self.pos)
            return lm.adapter.lm_head(lm.model, hidden[:, -1:])[:, -1].float()

    def _capture(self) -> torch.Tensor:
        """Capture this step (nothing executes), then replay it once. On failure: restore the Python side, log,
        run the step eagerly, and decode eagerly from now on."""
        before = dict(self.ctx.offsets)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                out = self._forward()
        except Exception as e:  # noqa: BLE001 - a model whose step cannot be captured decodes eagerly
            self.ctx.current_layer = None
            self.ctx.offsets.clear()
            self.ctx.offsets.update(before)
            name = _failure_key(self.lm.model)
            _FAILED[name] = f"{type(e).__name__}: {str(e)[:200]}"
            self.reason = f"capture failed: {_FAILED[name]}"
            _LOG.warning("decode step of %s could not be captured in a CUDA graph (%s); decoding eagerly", name,
                         _FAILED[name])
            torch.cuda.synchronize()
            return self._forward()
        self.graph, self.out = graph, out
        graph.replay()
        self.replays += 1
        self.ctx.readouts.add("decode-graph")
        return out.clone()
