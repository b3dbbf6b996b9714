"""Adapter for transformers' GDN hybrids: Qwen3.5 (dense), Qwen3.5-MoE and Qwen3-Next.

All three call module-level kernel functions ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``
from their layer's ``forward`` (each modeling file has its own copies). ``install()`` replaces those module
globals, once per process, with a dispatcher:

- inside a gdnviz run (``gdnviz.runner.active()``): ``gdnviz.runner.gdn_scan`` (segment scan + callbacks);
- otherwise the original: fla's kernel on CUDA when fla imports, the decorated function's PyTorch body on CPU
  (transformers decides fla-vs-torch at import time without a device check, so on a CPU host with fla
  installed the undecorated call would send CPU tensors to Triton).

The carried state lives in ``cache.layers[i].recurrent_states[0]`` as ``[B, H, d_k, d_v]`` float32: already the
canonical layout, no transpose.

The short convolution (module-level ``causal_conv1d_fn``) is patched too: inside a gdnviz run on CUDA it convolves
with fla's Triton ``causal_conv1d`` on the ``[B, T, D]`` layout the projection produced (the same causal convolution;
fla's GatedDeltaNet layers use it) instead of transformers' PyTorch fallback (a copy of the transposed ``[B, D, T]``
view, ``F.conv1d`` padded on both sides, a slice, SiLU: much slower, docs/runner.md). Outside runs, on CPU, without
fla, and for packed sequences, the call goes to transformers' own function (which takes the ``causal-conv1d``
package's kernel when that is installed).
"""
from __future__ import annotations

import functools
import importlib
import inspect

import torch

from gdnviz import runner

MODULES = {
    "qwen3_5": "transformers.models.qwen3_5.modeling_qwen3_5",
    "qwen3_5_moe": "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    "qwen3_next": "transformers.models.qwen3_next.modeling_qwen3_next",
}
_INSTALLED: set = set()


def _dispatcher(orig):
    torch_body = inspect.unwrap(orig)

    @functools.wraps(orig)
    def dispatch(query, key, value, g=None, beta=None, *args, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, **kwargs):
        ctx = runner.active()
        if ctx is not None and ctx.current_layer is not None:
            if not use_qk_l2norm_in_kernel:  # every supported layer asks the kernel to normalise q and k
                raise RuntimeError("gdnviz expects use_qk_l2norm_in_kernel=True from the GDN layer")
            if kwargs.get("cu_seqlens") is not None:
                raise RuntimeError("gdnviz runs do not support packed sequences (cu_seqlens)")
            q_hat, k_hat = runner.prepare_core_inputs(query, key, value.shape[2], ctx, value.dtype)
            out, state = runner.gdn_scan(ctx, ctx.current_layer, q_hat, k_hat, value, g, beta, initial_state)
            return out, (state if output_final_state else None)
        fn = orig if query.device.type == "cuda" else torch_body
        return fn(query, key, value, g, beta, *args, initial_state=initial_state,
                  output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)

    dispatch.__gdnviz_original__ = orig
    return dispatch


@functools.lru_cache(maxsize=1)
def _fla_causal_conv1d():
    """fla's ``causal_conv1d`` (``x [B, T, D]``, ``weight [D, W]``) or None when fla does not import."""
    try:
        from fla.modules.causal_conv1d.ops import causal_conv1d
    except Exception:  # noqa: BLE001 - fla absent or broken: transformers' convolution stays
        return None
    return causal_conv1d


def fla_conv_on(x: torch.Tensor) -> bool:
    """Whether this short-convolution call goes to fla's kernel (module docstring): inside a gdnviz run, on CUDA,
    with fla importable."""
    return x.is_cuda and runner.active() is not None and _fla_causal_conv1d() is not None


_PACKING_KWARGS = ("seq_idx", "cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k")  # packed sequences: the original


def _conv_dispatcher(orig):
    @functools.wraps(orig)
    def conv(hidden_states, weight, bias=None, activation=None, **kwargs):
        # hidden_states [B, D, T]: the projection's [B, T, D] output transposed. The layer passes its own keyword
        # arguments on (use_cache, ...), which transformers' fallback ignores; those that describe packed sequences
        # keep the original.
        packed = any(kwargs.get(k) is not None for k in _PACKING_KWARGS)
        if not packed and fla_conv_on(hidden_states):
            y, _ = _fla_causal_conv1d()(hidden_states.transpose(1, 2), weight=weight, bias=bias,
                                        activation=activation)
            return y.transpose(1, 2)
        return orig(hidden_states, weight, bias, activation=activation, **kwargs)

    conv.__gdnviz_original__ = orig
    return conv


def install(family: str) -> None:
    """Patch the family's modeling module once per process (idempotent)."""
    if family in _INSTALLED:
        return
    mod = importlib.import_module(MODULES[family])
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        fn = getattr(mod, name)
        if not hasattr(fn, "__gdnviz_original__"):
            setattr(mod, name, _dispatcher(fn))
    conv = getattr(mod, "causal_conv1d_fn", None)
    if conv is not None and not hasattr(conv, "__gdnviz_original__"):
        mod.causal_conv1d_fn = _conv_dispatcher(conv)
    _INSTALLED.add(family)


class TransformersGDNAdapter:
    """Reads and writes GDN states of a transformers Qwen3.5 / Qwen3.5-MoE / Qwen3-Next model."""

    def __init__(self, family: str):
        self.family = family

    # -- structure ---------------------------------------------------------------------------------
    @staticmethod
    def text_config(config):
        return config.get_text_config() if hasattr(config, "get_text_config") else config

    def layer_types(self, config) -> list:
        return list(self.text_config(config).layer_types)

    def gdn_modules(self, model) -> dict:
        return {i: layer.linear_attn for i, layer in enumerate(model.model.layers) if hasattr(layer, "linear_attn")}

    def describe(self, config) -> dict:
        c = self.text_config(config)
        types = self.layer_types(config)
        return dict(
            model_type=c.model_type,
            num_layers=len(types),
            gdn_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
            attn_layers=tuple(i for i, t in enumerate(types) if t == "full_attention"),
            num_heads=c.linear_num_value_heads,
            num_key_heads=c.linear_num_key_heads,
            d_k=c.linear_key_head_dim,
            d_v=c.linear_value_head_dim,
            conv_kernel=c.linear_conv_kernel_dim,
            hidden_size=c.hidden_size,
            vocab_size=c.vocab_size,
            attn_kv_heads=c.num_key_value_heads,
            attn_head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        )

    def prepare(self, model) -> None:
        """Install the kernel dispatcher and the hooks that tell the scan which layer is running."""
        install(self.family)
        for idx, mod in self.gdn_modules(model).items():
            if getattr(mod, "_gdnviz_hooked", False):
                continue

            def pre_hook(module, args, _idx=idx):
                ctx = runner.active()
                if ctx is not None:
                    ctx.current_layer = _idx

            def post_hook(module, args, output):
                ctx = runner.active()
                if ctx is not None:
                    ctx.current_layer = None

            mod.register_forward_pre_hook(pre_hook)
            mod.register_forward_hook(post_hook)
            mod._gdnviz_hooked = True

    # -- running -----------------------------------------------------------------------------------
    def new_cache(self, model, batch_size: int = 1):
        from transformers import DynamicCache

        return DynamicCache(config=model.config)

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def _cache_kw(cls) -> str:
        params = inspect.signature(cls.forward).parameters
        return "past_key_values" if "past_key_values" in params else "cache"

    def base_forward(self, model, input_ids, cache=None, use_cache=False, attention_mask=None, position_ids=None):
        """Final hidden states [B, T, hidden] of the decoder (no LM head).

        attention_mask [B, past + T] (1 = token, 0 = left pad) and position_ids [B, T] for left-padded batches."""
        base = model.model
        kw = {self._cache_kw(type(base)): cache} if cache is not None else {}
        if attention_mask is not None:
            kw["attention_mask"] = attention_mask
        if position_ids is not None:
            kw["position_ids"] = position_ids
        out = base(input_ids=input_ids, use_cache=use_cache, **kw)
        return out.last_hidden_state

    def lm_head(self, model, hidden):
        return model.lm_head(hidden)

    # -- state -------------------------------------------------------------------------------------
    def get_state(self, cache, layer: int) -> torch.Tensor:
        """[B, H, d_k, d_v] float32 carried state of GDN layer ``layer`` (canonical layout)."""
        return cache.layers[layer].recurrent_states[0]

    def set_state(self, cache, layer: int, state: torch.Tensor) -> None:
        cache.layers[layer].recurrent_states[0].copy_(state)
