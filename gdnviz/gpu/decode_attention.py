"""Attention of one decoded token over a long cache, split over the keys (flash-decoding), for gdnviz's decoder.

Why: a greedy decode step at batch 16 over a 16K-token cache spends most of its time in the full-attention layers:
SDPA runs one program per (row, key/value head) over all the keys, 32 programs on a 132-SM GPU, about 0.1 TB/s
(bench/RESULTS.md, "One greedy decode step"). Here each program takes one block of keys of one (row, key/value
head) for all the query heads that share it, and a second pass combines the blocks.

:func:`decode_attention` — query ``[B, Hq, 1, D]``, key and value ``[B, Hkv, S, D]`` (Hq a multiple of Hkv), an
additive mask ``[B, 1, 1, S]`` (0 where visible, the dtype's minimum elsewhere), ``scale`` → ``[B, 1, Hq, D]`` in
the query's dtype: softmax(q·kᵀ·scale + mask)·v per query head, scores and the softmax in float32, the
probabilities rounded to the value dtype before the product with the values (as flash attention does); float32
inputs multiply in IEEE float32 (no TF32). :func:`reference` is the same in float64. :func:`supported` says when
the kernel applies (CUDA or Triton's interpreter, D a power of two in [16, 256], a float mask of that shape);
elsewhere :func:`attention_function` hands the call to transformers' own function.

:func:`active` marks the forward passes that may use it (``gdnviz.static_decode`` wraps its steps in it, so the
eager step and the CUDA-graph replay of a step run the same kernels); :func:`install` puts
:func:`attention_function` in front of transformers' "sdpa" attention function once per process (models with
``attn_implementation="eager"`` keep transformers' eager attention).
No host sync (capturable in a CUDA graph).
"""
from __future__ import annotations

import contextlib
import contextvars
import math

import torch

__all__ = ["decode_attention", "reference", "supported", "active", "install", "attention_function", "BLOCK"]

BLOCK = 64  # keys per program
_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("gdnviz_decode_attention", default=False)


@contextlib.contextmanager
def active():
    """Inside: a one-token attention call that :func:`supported` accepts runs :func:`decode_attention`."""
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def reference(query, key, value, mask, scale: float) -> torch.Tensor:
    """:func:`decode_attention` in float64 (``[B, 1, Hq, D]`` float64)."""
    B, Hq, _, D = query.shape
    Hkv = key.shape[1]
    q = query.double().reshape(B, Hkv, Hq // Hkv, D)
    s = torch.einsum("bhgd,bhsd->bhgs", q, key.double()) * scale + mask.double().reshape(B, 1, 1, -1)
    p = torch.softmax(s, dim=-1)
    return torch.einsum("bhgs,bhsd->bhgd", p, value.double()).reshape(B, 1, Hq, D)


def supported(query, key, value, mask) -> bool:
    """Whether :func:`decode_attention` takes this call (module docstring)."""
    if query.dim() != 4 or query.shape[2] != 1 or key.dim() != 4 or mask is None or not mask.is_floating_point():
        return False
    B, Hq, _, D = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    if Hkv == 0 or Hq % Hkv or tuple(value.shape) != tuple(key.shape) or key.shape[0] != B or key.shape[3] != D:
        return False
    if tuple(mask.shape) != (B, 1, 1, S) or D < 16 or D > 256 or D & (D - 1):
        return False
    if query.dtype not in (torch.bfloat16, torch.float16, torch.float32) or key.dtype != query.dtype:
        return False
    return query.device.type == "cuda" or _interpreting()


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def decode_attention(query, key, value, mask, scale: float) -> torch.Tensor:
    """One-token attention (module docstring); ``supported(query, key, value, mask)`` must hold."""
    import triton

    B, Hq, _, D = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    G = Hq // Hkv
    GP = max(16, triton.next_power_of_2(G))
    C = triton.cdiv(S, BLOCK)
    dev = query.device
    q = query.reshape(B, Hkv, G, D)
    k, v, m = key, value, mask.reshape(B, S)
    acc = torch.empty(B * Hkv, C, G, D, device=dev, dtype=torch.float32)
    mx = torch.empty(B * Hkv, C, G, device=dev, dtype=torch.float32)
    den = torch.empty(B * Hkv, C, G, device=dev, dtype=torch.float32)
    _kernel()[(B * Hkv, C)](
        q, k, v, m, acc, mx, den, S, float(scale), Hkv,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), m.stride(0),
        G=G, GP=GP, D=D, BLOCK=BLOCK, IEEE=query.dtype == torch.float32)
    top = mx.amax(dim=1, keepdim=True)  # [BH, 1, G]
    w = torch.exp(mx - top)  # [BH, C, G]
    out = (acc * w[..., None]).sum(1) / (den * w).sum(1)[..., None]  # [BH, G, D]
    return out.reshape(B, 1, Hq, D).to(query.dtype)


_KERNEL = None


def _kernel():
    """The Triton program, compiled on first use (Triton imports only where the kernel runs)."""
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def partial(Q, K, V, M, ACC, MX, DEN, S, scale, Hkv,
                sqb, sqh, sqg, skb, skh, sks, svb, svh, svs, smb,
                G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr):
        bh = tl.program_id(0)
        c = tl.program_id(1)
        C = tl.num_programs(1)
        b = bh // Hkv
        h = bh % Hkv
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        s = c * BLOCK + tl.arange(0, BLOCK)
        inside = s < S
        q = tl.load(Q + b * sqb + h * sqh + g[:, None] * sqg + d[None, :], mask=(g < G)[:, None], other=0.0)
        k = tl.load(K + b * skb + h * skh + s[:, None] * sks + d[None, :], mask=inside[:, None], other=0.0)
        if IEEE:
            x = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            x = tl.dot(q, tl.trans(k))
        add = tl.load(M + b * smb + s, mask=inside, other=0.0).to(tl.float32)
        x = x * scale + add[None, :]
        x = tl.where(inside[None, :], x, float("-inf"))
        top = tl.max(x, axis=1)
        p = tl.exp(x - top[:, None])
        den = tl.sum(p, axis=1)
        v = tl.load(V + b * svb + h * svh + s[:, None] * svs + d[None, :], mask=inside[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(p, v, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v)
        row = (bh * C + c) * G + g
        keep = g < G
        tl.store(ACC + row[:, None] * D + d[None, :], acc, mask=keep[:, None])
        tl.store(MX + row, top, mask=keep)
        tl.store(DEN + row, den, mask=keep)

    _KERNEL = partial
    return _KERNEL


def attention_function(original):
    """transformers' attention function ``original`` behind :func:`decode_attention` (same signature and result
    layout ``[B, q_len, Hq, D]``): taken inside :func:`active` for a call :func:`supported` accepts without
    dropout, soft-capping, sliding window or attention weights asked for; ``original`` otherwise."""

    def attend(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
        if (_ACTIVE.get() and not dropout and kwargs.get("softcap") is None and kwargs.get("sliding_window") is None
                and not kwargs.get("output_attentions") and supported(query, key, value, attention_mask)):
            scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
            return decode_attention(query, key, value, attention_mask, scale), None
        return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)

    attend.__gdnviz_original__ = original
    return attend


def install() -> None:
    """Put :func:`attention_function` in front of transformers' "sdpa" attention (once per process)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    orig = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if not hasattr(orig, "__gdnviz_original__"):
        ALL_ATTENTION_FUNCTIONS["sdpa"] = attention_function(orig)
