"""Adapter for flash-linear-attention's ``GatedDeltaNetForCausalLM`` (model_type ``gated_deltanet``, fla 0.6).

fla's GDN layer (``fla.layers.gated_deltanet.GatedDeltaNet``) runs Triton kernels only: its short convolutions,
its gated output RMSNorm and the core (``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``, called
with ``use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True,
state_v_first=True``). The blocks' ``RMSNorm`` (``fuse_norm``), the MLP's SwiGLU (Triton even with
``fuse_swiglu=False``) and the hybrid attention layers' rotary embedding are Triton too. So:

* **CUDA** (fla's real kernels): every module runs fla's own forward; ``prepare`` only replaces the two core
  functions, as module globals of ``fla.layers.gated_deltanet``, with a dispatcher. Inside a gdnviz run it
  recomputes what the kernel would have computed in-kernel (``g = -exp(A_log) * softplus(a + dt_bias)``,
  ``beta = sigmoid(b)`` (x2 with ``allow_neg_eigval``), L2-normalised q/k, key heads repeated to value heads),
  transposes fla's value-first state to the canonical ``[B, H, K, V]`` and calls ``gdnviz.runner.gdn_scan``;
  outside a run it calls fla's original function untouched.
* **Anywhere else** (CPU): ``prepare`` gives each GDN layer, each fla ``RMSNorm``, each ``GatedMLP`` and each
  ``RotaryEmbedding`` a per-instance forward that runs PyTorch code with fla's math when its input is not on
  CUDA (on CUDA it calls fla's own forward). The GDN layer's torch forward: projections; depthwise causal
  conv + SiLU in fp32 with fla's conv cache (``[B, D, W]``: the last W *pre-conv* inputs, newest last);
  gates as above; the core through ``gdn_scan`` inside a run, ``gdnviz.gdn.kernels.core`` outside;
  ``RMSNorm(o) * act(g_proj(x))`` (act = swish or sigmoid, fp32, eps = ``norm_eps``); ``o_proj``.
  ``adjust_config`` also sets ``fuse_norm = fuse_swiglu = fuse_cross_entropy = False`` on CPU so the blocks
  are built from torch modules (``nn.RMSNorm``; parameter names are unchanged, checkpoints load as saved).
  Checked on an H200 (tests/test_fla_adapter.py, gpu): with fp32 weights, fla's CUDA layers through the cache
  loop (64-token calls, fused_recurrent) and this torch path agree to ~1e-6 relative (logits and states).

State layout: fla 0.6 caches ``cache[i]['recurrent_state']`` value-first, ``[B, HV, V, K]`` fp32. ``get_state``
/ ``set_state`` (and the CUDA dispatcher / CPU forward, at the kernel boundary) transpose to and from the
canonical ``[B, H, K, V]``; nothing else in gdnviz sees fla's layout.

Hybrid attention layers (``config.attn = {'layers': [...], ...}``): fla's ``Attention`` layer calls
``flash_attn_func`` and refuses to be *built* without the ``flash_attn`` package. When flash_attn is missing,
``install_attention_fallback()`` (called by ``adjust_config``, ``prepare`` and the test builder) puts a
``torch.nn.functional.scaled_dot_product_attention`` stand-in with flash_attn's semantics (bottom-right-aligned
causal mask, sliding window ``(left, right)``, grouped KV heads mapped like flash_attn, scale ``1/sqrt(d)``) in
its place; fla's own layer code (projections, RoPE, KV cache, window bookkeeping) runs unchanged. Padding masks
and packed sequences (the ``flash_attn_varlen_func`` path) are not supported by the stand-in and raise.
With flash_attn installed nothing is replaced.
"""
from __future__ import annotations

import functools
import inspect
import math
import types

import torch
import torch.nn.functional as F

from gdnviz import runner
from gdnviz.errors import UnsupportedFamily
from gdnviz.gdn import kernels


class UnsupportedFlaFeature(UnsupportedFamily):
    """An fla GatedDeltaNet checkpoint uses a feature gdnviz cannot run here (says which and what to do)."""


# ------------------------------------------------------------------------------------------------
# Attention fallback (flash_attn missing)
# ------------------------------------------------------------------------------------------------
def _sdpa_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                          softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``flash_attn.flash_attn_func`` semantics on torch SDPA. q [B, Tq, H, D]; k, v [B, Tk, Hk, D] → [B, Tq, H, D].

    The causal mask is aligned to the bottom-right corner (query i sits at key position Tk - Tq + i), as in
    flash_attn >= 2.1; ``window_size = (left, right)`` keeps keys j with i - left <= j <= i + right (-1: no limit).
    """
    if dropout_p or softcap or alibi_slopes is not None or return_attn_probs:
        raise NotImplementedError("gdnviz's SDPA stand-in for flash_attn supports no dropout, softcap, ALiBi or "
                                  "attention probabilities")
    B, Tq, H, D = q.shape
    Tk, Hk = k.shape[1], k.shape[2]
    if Hk != H:
        k = k.repeat_interleave(H // Hk, dim=2)
        v = v.repeat_interleave(H // Hk, dim=2)
    i = torch.arange(Tq, device=q.device)[:, None] + (Tk - Tq)
    j = torch.arange(Tk, device=q.device)[None, :]
    allowed = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device)
    if causal:
        allowed &= j <= i
    left, right = window_size
    if left is not None and left >= 0:
        allowed &= j >= i - left
    if right is not None and right >= 0:
        allowed &= j <= i + right
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=allowed, scale=softmax_scale)
    return o.transpose(1, 2).contiguous()


def _sdpa_flash_attn_varlen_func(*args, **kwargs):
    raise NotImplementedError(
        "fla's attention layer took its padded/packed (flash_attn_varlen_func) path, which needs the flash_attn "
        "package; gdnviz's SDPA stand-in covers unpadded batches only (no attention_mask, no cu_seqlens)")


_sdpa_flash_attn_func.__gdnviz_fallback__ = True


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except Exception:
        return False
    return True


def install_attention_fallback() -> bool:
    """Give fla's ``Attention`` layer a torch SDPA ``flash_attn_func`` when flash_attn is not installed.

    Idempotent; returns True when the stand-in is (now) in place, False when fla uses the real flash_attn.
    Must run before a hybrid model is *built*: fla's ``Attention.__init__`` raises ImportError otherwise.
    """
    import fla.layers.attn as attn_mod

    fn = getattr(attn_mod, "flash_attn_func", None)
    if fn is not None and not getattr(fn, "__gdnviz_fallback__", False):
        return False
    attn_mod.flash_attn_func = _sdpa_flash_attn_func
    attn_mod.flash_attn_varlen_func = _sdpa_flash_attn_varlen_func
    return True


# ------------------------------------------------------------------------------------------------
# CUDA: dispatcher for the core functions the GDN layer calls
# ------------------------------------------------------------------------------------------------
_CORE_NAMES = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")
_INSTALLED = False


def _gates(g_raw, beta_raw, a):
    """The gate and write strength fla computes in-kernel, from the raw projections, in fp32."""
    if a.get("use_gate_in_kernel"):
        A_log, dt_bias = a["A_log"], a.get("dt_bias")
        x = g_raw.float() + (dt_bias.float() if dt_bias is not None else 0.0)
        g = -A_log.float().exp() * F.softplus(x)
    else:
        g = g_raw.float()
    beta = beta_raw.float()
    if a.get("use_beta_sigmoid_in_kernel"):
        beta = beta.sigmoid()
        if a.get("allow_neg_eigval"):
            beta = beta * 2.0
    return g, beta


def _dispatcher(orig):
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def dispatch(*args, **kwargs):
        ctx = runner.active()
        if ctx is None or ctx.current_layer is None:
            return orig(*args, **kwargs)
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        a = dict(bound.arguments)
        a.update(a.pop("kwargs", {}) or {})
        if not a.get("use_qk_l2norm_in_kernel"):
            raise RuntimeError("gdnviz expects use_qk_l2norm_in_kernel=True from fla's GatedDeltaNet layer")
        if a.get("cu_seqlens") is not None:
            raise RuntimeError("gdnviz runs do not support packed sequences (cu_seqlens)")
        if a.get("gk") is not None or a.get("gv") is not None:
            raise RuntimeError("gdnviz supports scalar per-head gates only (no gk/gv)")
        q, k, v = a["q"], a["k"], a["v"]
        scale = a.get("scale")
        if scale is not None and not math.isclose(scale, k.shape[-1] ** -0.5, rel_tol=1e-6):
            raise RuntimeError(f"gdnviz expects the default query scale K**-0.5, got {scale}")
        v_first = bool(a.get("state_v_first") or a.get("transpose_state_layout"))
        g, beta = _gates(a["g"], a["beta"], a)
        init = a.get("initial_state")
        if init is not None and v_first:
            init = init.transpose(-1, -2)
        q_hat, k_hat = runner.prepare_core_inputs(q, k, v.shape[2], ctx, v.dtype)
        out, state = runner.gdn_scan(ctx, ctx.current_layer, q_hat, k_hat, v, g, beta, init)
        out = out.to(q.dtype)
        if not a.get("output_final_state"):
            return out, None
        return out, (state.transpose(-1, -2).contiguous() if v_first else state)

    dispatch.__gdnviz_original__ = orig
    return dispatch


def install() -> None:
    """Replace the core functions in ``fla.layers.gated_deltanet`` with the dispatcher (once per process)."""
    global _INSTALLED
    if _INSTALLED:
        return
    import fla.layers.gated_deltanet as m

    for name in _CORE_NAMES:
        fn = getattr(m, name)
        if not hasattr(fn, "__gdnviz_original__"):
            setattr(m, name, _dispatcher(fn))
    _INSTALLED = True


# ------------------------------------------------------------------------------------------------
# Torch forwards (everything that is not on CUDA)
# ------------------------------------------------------------------------------------------------
def _on_cuda(x: torch.Tensor) -> bool:
    return x.device.type == "cuda"


def _rms(x: torch.Tensor, weight, bias, eps: float) -> torch.Tensor:
    """fla's RMSNorm arithmetic: fp32, ``x * rsqrt(mean(x^2) + eps) * w (+ b)``."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y


def rmsnorm_torch(self, x, residual=None, prenorm=False, residual_in_fp32=False):
    """``fla.modules.RMSNorm.forward`` (with its fused residual-add / prenorm variant) in torch."""
    xf = x.float()
    if residual is not None:
        xf = xf + residual.float()
        res_dtype = residual.dtype
    else:
        res_dtype = torch.float32 if residual_in_fp32 else x.dtype
    y = _rms(xf, self.weight, self.bias, self.eps).to(x.dtype)
    return (y, xf.to(res_dtype)) if prenorm else y


def mlp_torch(self, x, **kwargs):
    """``fla.modules.GatedMLP.forward`` in torch: ``down(swish(gate(x)) * up(x))``, SwiGLU in fp32."""
    gate, y = self.gate_proj(x), self.up_proj(x)
    if self.hidden_act != "swish":
        raise UnsupportedFlaFeature(f"gdnviz's CPU path supports hidden_act='swish' only, not {self.hidden_act!r}")
    z = (F.silu(gate.float()) * y.float()).to(gate.dtype)
    return self.down_proj(z)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rotary(x, cos, sin, interleaved):
    """fla's ``rotary_embedding_ref`` in fp32: rotate the first 2*cos.shape[-1] channels."""
    ro = cos.shape[-1] * 2
    xf = x.float()
    if interleaved:
        c = cos.float().repeat_interleave(2, dim=-1)[:, None, :]
        s = sin.float().repeat_interleave(2, dim=-1)[:, None, :]
        x1, x2 = xf[..., :ro:2], xf[..., 1:ro:2]
        rot = torch.stack((-x2, x1), dim=-1).flatten(-2)
    else:
        c = torch.cat((cos, cos), dim=-1).float()[:, None, :]
        s = torch.cat((sin, sin), dim=-1).float()[:, None, :]
        rot = _rotate_half(xf[..., :ro])
    out = torch.cat((xf[..., :ro] * c + rot * s, xf[..., ro:]), dim=-1)
    return out.to(x.dtype)


def rotary_torch(self, q, k, seqlen_offset=0, cu_seqlens=None, max_seqlen=None, chunk_indices=None):
    """``fla.modules.RotaryEmbedding.forward`` in torch (integer offsets, no packing, no XPos)."""
    if cu_seqlens is not None or not isinstance(seqlen_offset, int) or self.scale is not None:
        raise UnsupportedFlaFeature("gdnviz's CPU rotary embedding supports unpadded batches with one integer "
                                    "offset and no XPos scaling")
    T = q.shape[1]
    self._update_cos_sin_cache(max(max_seqlen or 0, T + seqlen_offset), device=q.device, dtype=q.dtype)
    cos = self._cos_cached[seqlen_offset:seqlen_offset + T]
    sin = self._sin_cached[seqlen_offset:seqlen_offset + T]
    return _apply_rotary(q, cos, sin, self.interleaved), _apply_rotary(k, cos, sin, self.interleaved)


def _short_conv(x, conv, cache, use_cache):
    """fla's ``ShortConvolution`` (depthwise causal conv + SiLU) in fp32, with fla's cache.

    x: [B, T, D]; cache: [B, D, W] (the last W pre-conv inputs, newest last) or None (zeros).
    Returns (y [B, T, D] in x.dtype, new cache [B, D, W] in x.dtype or None).
    """
    B, T, D = x.shape
    W = conv.kernel_size[0]
    xt = x.transpose(1, 2)
    if cache is None:
        cache = x.new_zeros(B, D, W)
    full = torch.cat([cache.to(x.dtype), xt], dim=-1)  # [B, D, W + T]; column W + t is token t
    y = F.conv1d(full[..., 1:].float(), conv.weight.float(), None if conv.bias is None else conv.bias.float(),
                 groups=D)  # [B, D, T]: output t reads columns t+1 .. t+W, i.e. tokens t-W+1 .. t
    if conv.activation in ("silu", "swish"):
        y = F.silu(y)
    new_cache = full[..., -W:].contiguous() if use_cache else None
    return y.transpose(1, 2).to(x.dtype), new_cache


def _core(layer_idx, q, k, v, g, beta, init_canonical):
    """The GDN core on prepared gates: gdn_scan inside a run, kernels.core outside. States canonical."""
    ctx = runner.active()
    q_hat, k_hat = runner.prepare_core_inputs(q, k, v.shape[2], ctx, v.dtype)
    if ctx is not None:
        return runner.gdn_scan(ctx, layer_idx, q_hat, k_hat, v, g, beta, init_canonical)
    q_in = q_hat.to(v.dtype) if v.dtype != torch.float32 else q_hat
    k_in = k_hat.to(v.dtype) if v.dtype != torch.float32 else k_hat
    state = init_canonical.float() if init_canonical is not None else None
    out, final = kernels.core(q_in, k_in, v, g, beta, state)
    return out.to(v.dtype), final


def gdn_torch(self, hidden_states, attention_mask=None, past_key_values=None, use_cache=False,
              output_attentions=False, **kwargs):
    """fla's ``GatedDeltaNet.forward`` in torch (same math and cache; see the module docstring), any device."""
    from fla.layers.utils import get_layer_cache, update_layer_cache

    if attention_mask is not None and not bool((attention_mask != 0).all()):
        raise UnsupportedFlaFeature("gdnviz's CPU GatedDeltaNet forward does not support padding masks")
    if kwargs.get("cu_seqlens") is not None:
        raise UnsupportedFlaFeature("gdnviz's CPU GatedDeltaNet forward does not support packed sequences")
    x = hidden_states
    B, T, _ = x.shape
    last_state = get_layer_cache(module=self, past_key_values=past_key_values)

    conv_q = conv_k = conv_v = None
    if self.use_short_conv:
        if last_state is not None and last_state.get("conv_state") is not None:
            conv_q, conv_k, conv_v = last_state["conv_state"]
        q, conv_q = _short_conv(self.q_proj(x), self.q_conv1d, conv_q, use_cache)
        k, conv_k = _short_conv(self.k_proj(x), self.k_conv1d, conv_k, use_cache)
        v, conv_v = _short_conv(self.v_proj(x), self.v_conv1d, conv_v, use_cache)
    else:
        q, k, v = F.silu(self.q_proj(x)), F.silu(self.k_proj(x)), F.silu(self.v_proj(x))
    q = q.reshape(B, T, -1, self.head_k_dim)
    k = k.reshape(B, T, -1, self.head_k_dim)
    v = v.reshape(B, T, -1, self.head_v_dim)

    g, beta = _gates(self.a_proj(x), self.b_proj(x),
                     dict(use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias,
                          use_beta_sigmoid_in_kernel=True, allow_neg_eigval=self.allow_neg_eigval))
    rec = last_state.get("recurrent_state") if last_state is not None else None
    init = rec.transpose(-1, -2) if rec is not None else None  # fla [B, HV, V, K] -> [B, HV, K, V]
    ctx = runner.active()
    idx = ctx.current_layer if ctx is not None and ctx.current_layer is not None else self.layer_idx
    o, state = _core(idx, q, k, v, g, beta, init)

    update_layer_cache(
        module=self, past_key_values=past_key_values,
        recurrent_state=state.transpose(-1, -2).contiguous() if use_cache else None,
        conv_state=(conv_q, conv_k, conv_v) if self.use_short_conv else None,
        offset=T,
    )

    norm = self.o_norm
    of = o.float()
    if self.use_gate:
        gate = self.g_proj(x).reshape(B, T, -1, self.head_v_dim).float()
        y = _rms(of, norm.weight, getattr(norm, "bias", None), norm.eps)
        y = y * (F.silu(gate) if norm.activation in ("swish", "silu") else gate.sigmoid())
    else:
        y = _rms(of, norm.weight, getattr(norm, "bias", None), norm.eps)
    o = y.to(o.dtype).reshape(B, T, -1)
    return self.o_proj(o), None, past_key_values


def _device_dispatch(torch_fn):
    """A forward that runs fla's own (Triton) forward on CUDA inputs and ``torch_fn`` on any other device."""

    @functools.wraps(torch_fn)
    def forward(self, *args, **kwargs):
        x = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
        if _on_cuda(x):
            return type(self).forward(self, *args, **kwargs)
        return torch_fn(self, *args, **kwargs)

    forward.__gdnviz_torch__ = torch_fn
    return forward


_FORWARDS = {name: _device_dispatch(fn) for name, fn in
             (("rmsnorm", rmsnorm_torch), ("mlp", mlp_torch), ("rotary", rotary_torch), ("gdn", gdn_torch))}


def _patch(module, kind: str) -> None:
    fn = _FORWARDS[kind]
    if getattr(module, "_gdnviz_forward", None) is fn:
        return
    module.forward = types.MethodType(fn, module)
    module._gdnviz_forward = fn


# ------------------------------------------------------------------------------------------------
# The adapter
# ------------------------------------------------------------------------------------------------
def _attn_specs(config) -> list:
    attn = getattr(config, "attn", None)
    if attn is None:
        return []
    return [attn] if isinstance(attn, dict) else list(attn)


class FlaGDNAdapter:
    """Reads and writes GDN states of fla's GatedDeltaNetForCausalLM (with or without hybrid attention)."""

    family = "fla"

    # -- structure ---------------------------------------------------------------------------------
    def layer_types(self, config) -> list:
        attn_layers = {i for spec in _attn_specs(config) for i in spec.get("layers", ())}
        return ["full_attention" if i in attn_layers else "linear_attention"
                for i in range(config.num_hidden_layers)]

    def describe(self, config) -> dict:
        types_ = self.layer_types(config)
        specs = _attn_specs(config)
        kv_heads = head_dim = 0
        for spec in specs:
            kv_heads = max(kv_heads, int(spec.get("num_kv_heads") or spec["num_heads"]))
            head_dim = max(head_dim, config.hidden_size // int(spec["num_heads"]))
        return dict(
            model_type=config.model_type,
            num_layers=len(types_),
            gdn_layers=tuple(i for i, t in enumerate(types_) if t == "linear_attention"),
            attn_layers=tuple(i for i, t in enumerate(types_) if t == "full_attention"),
            num_heads=int(config.num_v_heads or config.num_heads),
            num_key_heads=int(config.num_heads),
            d_k=int(config.head_dim),
            d_v=int(config.head_dim * config.expand_v),
            conv_kernel=int(config.conv_size) if getattr(config, "use_short_conv", True) else 0,
            hidden_size=int(config.hidden_size),
            vocab_size=int(config.vocab_size),
            attn_kv_heads=kv_heads,
            attn_head_dim=head_dim,
        )

    def gdn_modules(self, model) -> dict:
        return {i: block.attn for i, block in enumerate(model.model.layers)
                if hasattr(block.attn, "A_log") and hasattr(block.attn, "b_proj")}

    def adjust_config(self, config, device):
        """Before ``from_pretrained``: torch block modules on CPU; the attention stand-in when flash_attn is absent."""
        dev = torch.device(device) if device is not None else torch.device("cpu")
        if dev.type != "cuda":
            if getattr(config, "attnres_block_size", None) is not None:
                raise UnsupportedFlaFeature(
                    "this fla checkpoint uses attention residuals (attnres_block_size), whose kernel needs Triton "
                    "on a CUDA GPU: load it with device='cuda'")
            config.fuse_norm = False
            config.fuse_swiglu = False
            config.fuse_cross_entropy = False
            config.fuse_linear_cross_entropy = False
        if _attn_specs(config):
            install_attention_fallback()
        return config

    def prepare(self, model) -> None:
        """Install the CUDA dispatcher, the torch forwards (used off CUDA) and the layer-index hooks."""
        from fla.layers.attn import Attention
        from fla.modules import GatedMLP, RMSNorm, RotaryEmbedding

        p = next(model.parameters())
        if p.device.type != "cuda" and getattr(model.config, "attnres_block_size", None) is not None:
            raise UnsupportedFlaFeature("attention residuals (attnres_block_size) need fla's Triton kernel on CUDA")
        install()
        if any(isinstance(m, Attention) for m in model.modules()):
            install_attention_fallback()
        for m in model.modules():
            if isinstance(m, RMSNorm):
                _patch(m, "rmsnorm")
            elif isinstance(m, GatedMLP):
                _patch(m, "mlp")
            elif isinstance(m, RotaryEmbedding):
                _patch(m, "rotary")
        for idx, mod in self.gdn_modules(model).items():
            _patch(mod, "gdn")
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
        from fla.models.utils import Cache

        return Cache()

    def base_forward(self, model, input_ids, cache=None, use_cache=False):
        """Final hidden states [B, T, hidden] of the decoder (after its final norm; no LM head)."""
        out = model.model(input_ids=input_ids, past_key_values=cache, use_cache=use_cache, return_dict=True)
        return out.last_hidden_state

    def lm_head(self, model, hidden):
        return model.lm_head(hidden)

    # -- state -------------------------------------------------------------------------------------
    @staticmethod
    def _layer_state(cache, layer: int) -> dict:
        try:
            st = cache[layer]
        except (KeyError, IndexError):
            st = None
        if not st or st.get("recurrent_state") is None:
            raise KeyError(f"the cache holds no GDN state for layer {layer} yet (run at least one token through "
                           f"the model with use_cache=True first)")
        return st

    def get_state(self, cache, layer: int) -> torch.Tensor:
        """[B, H, d_k, d_v] float32 carried state of GDN layer ``layer`` (canonical layout; a copy)."""
        return self._layer_state(cache, layer)["recurrent_state"].transpose(-1, -2).float().contiguous()

    def set_state(self, cache, layer: int, state: torch.Tensor) -> None:
        """Replace GDN layer ``layer``'s carried state with ``state`` [B, H, d_k, d_v] (canonical layout)."""
        st = self._layer_state(cache, layer)
        old = st["recurrent_state"]
        new = state.transpose(-1, -2)
        if tuple(new.shape) != tuple(old.shape):
            raise ValueError(f"state for layer {layer} must be [B, H, d_k, d_v] = "
                             f"{tuple(old.transpose(-1, -2).shape)}, got {tuple(state.shape)}")
        st["recurrent_state"] = new.to(device=old.device, dtype=old.dtype).contiguous()
