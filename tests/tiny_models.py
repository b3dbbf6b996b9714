"""Tiny real models of every supported family, built from configs (random weights, CPU, float32)."""
from __future__ import annotations

import torch


def qwen3_5(seed: int = 0, layers=("linear_attention", "linear_attention", "full_attention", "linear_attention"),
            k_heads: int = 2, v_heads: int = 4, dk: int = 16, dv: int = 16, vocab: int = 97):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    cfg = Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=len(layers),
        layer_types=list(layers), num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=k_heads, linear_num_value_heads=v_heads, linear_key_head_dim=dk,
        linear_value_head_dim=dv, linear_conv_kernel_dim=4, max_position_embeddings=4096,
        tie_word_embeddings=True)
    m = Qwen3_5ForCausalLM(cfg).float().eval()
    _liven_gates(m)
    return m


def qwen3_5_moe(seed: int = 0):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(seed)
    cfg = Qwen3_5MoeTextConfig(
        vocab_size=97, hidden_size=64, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        max_position_embeddings=4096)
    m = Qwen3_5MoeForCausalLM(cfg).float().eval()
    _liven_gates(m)
    return m


def qwen3_next(seed: int = 0):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        max_position_embeddings=4096)
    m = Qwen3NextForCausalLM(cfg).float().eval()
    _liven_gates(m)
    return m


def _liven_gates(model) -> None:
    """Random init leaves A_log ~ log U(0.01, 16), so most heads forget within a token. Spread the decays so that
    states carry information across boundaries (tests of boundary semantics need long-horizon heads)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            la = getattr(layer, "linear_attn", None)
            if la is None:
                continue
            n = la.A_log.numel()
            la.A_log.copy_(torch.log(torch.rand(n, generator=g) * 0.05 + 0.001))
            la.dt_bias.copy_(torch.randn(n, generator=g) * 0.5 - 2.0)


def fla_gdn(seed: int = 0, hybrid: bool = False, fuse: bool = False, expand_v: float = 1, vocab: int = 97):
    """fla's GatedDeltaNetForCausalLM: 3 GDN layers (GVA: 2 key heads, 4 value heads, d_k = 16, d_v = 16 *
    expand_v), or with ``hybrid`` 4 layers [GDN, GDN, attention, GDN]. ``fuse`` keeps fla's fused (Triton)
    norm/SwiGLU modules, which gdnviz's adapter runs in torch off CUDA. Without flash_attn, the hybrid is built
    with gdnviz's SDPA stand-in (``install_attention_fallback``)."""
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

    from gdnviz.models.fla_family import install_attention_fallback

    kw = {}
    if hybrid:
        install_attention_fallback()
        kw["attn"] = {"layers": [2], "num_heads": 4, "num_kv_heads": 2}
    torch.manual_seed(seed)
    cfg = GatedDeltaNetConfig(
        vocab_size=vocab, hidden_size=64, head_dim=16, num_heads=2, num_v_heads=4, expand_v=expand_v,
        num_hidden_layers=4 if hybrid else 3, intermediate_size=128, conv_size=4, max_position_embeddings=4096,
        fuse_norm=fuse, fuse_swiglu=fuse, fuse_cross_entropy=fuse, **kw)
    m = GatedDeltaNetForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for block in m.model.layers:
            la = block.attn
            if not hasattr(la, "A_log"):
                continue
            n = la.A_log.numel()
            la.A_log.copy_(torch.log(torch.rand(n, generator=g) * 0.05 + 0.001))
            la.dt_bias.copy_(torch.randn(n, generator=g) * 0.5 - 2.0)
            if la.use_gate:
                la.o_norm.weight.copy_(1.0 + 0.1 * torch.randn(la.o_norm.weight.shape, generator=g))
    return m
