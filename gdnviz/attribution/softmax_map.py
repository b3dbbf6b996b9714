"""Softmax attention weights of a full-attention layer, for comparison with a GDN head's exact map (issue 31;
docs/attribution.md "Exact attention map on the Head page").

Recomputed exactly from the layer's own queries and keys after RoPE: during an ordinary run of the model over the
first ``end`` tokens, forward hooks on the attention module's ``q_norm`` / ``k_norm`` keep its normalised q
``[T, H, d]`` and k ``[T, H_kv, d]``, a pre-hook keeps the ``position_embeddings`` (cos, sin) the layer received,
and the modeling module's own ``apply_rotary_pos_emb`` rotates them (transformers' Qwen3.5 / Qwen3.5-MoE /
Qwen3-Next ``*Attention.forward`` does exactly this before its attention kernel). Then, in float64::

    p_h[t, s] = softmax_s( scaling · q_{h,t} · k_{g(h),s} )  over s ≤ t,  0 for s > t

with ``scaling = module.scaling`` (d^-1/2) and ``g(h) = h // (H / H_kv)`` (transformers' ``repeat_kv``). This is
the weight matrix the model's eager attention would produce (it computes in the model's dtype, so the two differ by
its rounding; tests/test_attnmap.py checks against transformers' ``output_attentions=True``). The documents are
unpadded, so the mask is causal only.
"""
from __future__ import annotations

import sys

import torch

from gdnviz import runner
from gdnviz.attribution.exact_map import check_window
from gdnviz.attribution.inputs import as_ids
from gdnviz.errors import HeadOutOfRange, LayerNotAttention, UnsupportedFamily

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")  # transformers' attention modules with q_norm / k_norm + RoPE


def check_attention_layer(info, layer, head=None) -> None:
    """LayerNotAttention unless ``layer`` is a full-attention layer of the model (the message lists them, or says
    the model has none); UnsupportedFamily for a family whose attention is not read here; HeadOutOfRange checks of
    ``head`` (None: the mean over heads) happen in :func:`softmax_weights`, which knows the head count."""
    if isinstance(layer, bool) or not isinstance(layer, int) or layer not in info.attn_layers:
        if not info.attn_layers:
            raise LayerNotAttention(f"{info.name} has no full-attention layer (every layer is Gated DeltaNet): "
                                    "there is no softmax attention to compare with")
        kind = " (a Gated DeltaNet layer)" if layer in info.gdn_layers else ""
        raise LayerNotAttention(f"layer {layer!r}{kind} is not a full-attention layer of {info.name}; its "
                                f"full-attention layers are {list(info.attn_layers)}")
    if info.family not in FAMILIES:
        raise UnsupportedFamily(f"softmax weights are read from transformers' attention modules "
                                f"({', '.join(FAMILIES)}); {info.name} is of the {info.family!r} family: compute "
                                "the GDN map alone (no softmax layer)")


def _capture(lm, ids: torch.Tensor, layer: int):
    """Run the model over ``ids`` and return ``(q [T, H, d], k [T, H_kv, d], module)`` of attention layer ``layer``
    after RoPE, float64 on the CPU."""
    attn = lm.model.model.layers[layer].self_attn
    rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    parts = dict(q=[], k=[], pe=[])

    def keep(name):
        def hook(module, args, output):
            parts[name].append(output.detach())
        return hook

    def pre(module, args, kwargs):
        parts["pe"].append(tuple(x.detach() for x in kwargs["position_embeddings"]))

    hooks = [attn.q_norm.register_forward_hook(keep("q")), attn.k_norm.register_forward_hook(keep("k")),
             attn.register_forward_pre_hook(pre, with_kwargs=True)]
    try:
        runner.forward(lm, ids, keep_hidden=False)
    finally:
        for h in hooks:
            h.remove()
    qs, ks = [], []
    for q, k, (cos, sin) in zip(parts["q"], parts["k"], parts["pe"], strict=True):
        qr, kr = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)   # [B, H, T, d], the module's own order
        qs.append(qr[0].transpose(0, 1))
        ks.append(kr[0].transpose(0, 1))
    f64 = dict(device="cpu", dtype=torch.float64)
    return torch.cat(qs).to(**f64), torch.cat(ks).to(**f64), attn


def weights_from_qk(q: torch.Tensor, k: torch.Tensor, scaling: float, start: int, end: int) -> torch.Tensor:
    """``[H, end − start, end]`` causal softmax weights (module docstring) of query positions ``start..end−1`` from
    post-RoPE ``q [T, H, d]`` and ``k [T, H_kv, d]`` (float64; ``H`` a multiple of ``H_kv``)."""
    H, Hkv = q.shape[1], k.shape[1]
    kk = k[:end].repeat_interleave(H // Hkv, dim=1)                      # [end, H, d], repeat_kv's order
    logits = torch.einsum("thd,shd->hts", q[start:end], kk) * scaling
    t = torch.arange(start, end)[:, None]
    logits = logits.masked_fill(torch.arange(end)[None] > t, float("-inf"))
    return torch.softmax(logits, dim=-1)


def softmax_weights(lm, input_ids, layer: int, start: int, end: int, head: int | None = None) -> torch.Tensor:
    """Softmax attention of full-attention layer ``layer`` at query positions ``start..end−1`` over key positions
    ``0..end−1`` (module docstring): ``[end − start, end]`` float64 for ``head`` (a query head, 0-based), or the
    mean over the layer's query heads for ``head`` None. Rows sum to 1. Raises LayerNotAttention,
    UnsupportedFamily, HeadOutOfRange, PositionOutOfRange, WindowTooLarge (all before the model runs, except the
    head count, which is read from the layer)."""
    ids = as_ids(input_ids)
    check_attention_layer(lm.info, layer)
    check_window(start, end, ids.shape[1])
    attn = lm.model.model.layers[layer].self_attn
    H = int(attn.config.num_attention_heads)
    if head is not None and (isinstance(head, bool) or not isinstance(head, int) or not 0 <= head < H):
        raise HeadOutOfRange(f"attention head {head!r} is out of range: layer {layer} has query heads 0..{H - 1}")
    q, k, attn = _capture(lm, ids[:, :end], layer)
    p = weights_from_qk(q, k, float(attn.scaling), start, end)
    return p.mean(0) if head is None else p[head]


def num_heads(lm, layer: int) -> int:
    """The number of query heads of full-attention layer ``layer`` (LayerNotAttention for any other layer)."""
    check_attention_layer(lm.info, layer)
    return int(lm.model.model.layers[layer].self_attn.config.num_attention_heads)
