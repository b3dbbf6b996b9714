"""How many prompts a sweep answers per batched forward when the user does not say (``batch_size=None``).

On CUDA: from the device's free memory (``torch.cuda.mem_get_info``, the model already loaded) and the prompt length,
``floor(FREE_SHARE · free / row_bytes(...))`` rows, between 1 and ``MAX_ROWS``; elsewhere ``CPU_ROWS``.
``row_bytes`` is an upper estimate of one row's peak memory in a batched greedy run (``gdnviz.probes.batch``): the
attention layers' keys and values twice (the prefill's cache and the decoder's static copy), the GDN states three
times (cache, static copy, the truncation's scratch), one graph window of a layer's states twice (the truncation
check's stage and its copy, ``gdnviz.truncation.contract``), the widest per-layer activations of the prefill, and the
padded batch's attention mask (T × T, 2 bytes). A batch that still runs out of memory is answered in halves
(``gdnviz.probes.sweep.answer_batch``), so an estimate that is too small costs time, never the sweep.
"""
from __future__ import annotations

import torch

from gdnviz.gpu.scan_graph import WINDOW

__all__ = ["auto_batch_size", "row_bytes", "MAX_ROWS", "CPU_ROWS", "FREE_SHARE"]

MAX_ROWS = 64
CPU_ROWS = 8
FREE_SHARE = 0.6


def _cfg(model):
    cfg = model.config
    return getattr(cfg, "text_config", None) or cfg


def row_bytes(model, n_tokens: int, new_tokens: int) -> int:
    """Upper estimate of one row's peak bytes in a batched greedy run of ``n_tokens`` prompt tokens and
    ``new_tokens`` answer tokens (module docstring)."""
    cfg = _cfg(model)
    item = next(model.parameters()).element_size()
    types = list(getattr(cfg, "layer_types", None) or [])
    n_attn = sum(t == "full_attention" for t in types)
    n_gdn = sum(t == "linear_attention" for t in types)
    hidden = int(cfg.hidden_size)
    inter = int(getattr(cfg, "intermediate_size", 0) or 0)
    moe = int(getattr(cfg, "moe_intermediate_size", 0) or 0) * int(getattr(cfg, "num_experts_per_tok", 0) or 0)
    wide = max(inter, moe, hidden)
    kv_heads = int(getattr(cfg, "num_key_value_heads", 1) or 1)
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // max(1, int(cfg.num_attention_heads)))
    H = int(getattr(cfg, "linear_num_value_heads", 0) or 0)
    dk, dv = int(getattr(cfg, "linear_key_head_dim", 0) or 0), int(getattr(cfg, "linear_value_head_dim", 0) or 0)
    T = int(n_tokens) + int(new_tokens)
    kv = 2 * n_attn * 2 * kv_heads * head_dim * T * item
    states = 3 * n_gdn * H * dk * dv * 4
    checked = 2 * WINDOW * H * dk * dv * 4  # the truncation check's stage and its copy (truncation.contract)
    act = n_tokens * (3 * wide * item + 8 * hidden * 4 + 6 * max(1, H) * max(dk, dv) * 4)
    mask = 2 * n_tokens * n_tokens
    return int(kv + states + checked + act + mask)


def auto_batch_size(lm, n_tokens: int, new_tokens: int) -> int:
    """Rows per batch for prompts of up to ``n_tokens`` tokens and ``new_tokens`` answer tokens (module docstring)."""
    dev = torch.device(lm.device)
    if dev.type != "cuda":
        return CPU_ROWS
    # a model spread over several GPUs (device_map): the least free memory among them, against a whole row (an
    # over-estimate: each GPU holds only its layers' share)
    gpus = {dev} | {torch.device(d) for _, d in lm.info.device_map if d.startswith("cuda")}
    free = min(torch.cuda.mem_get_info(d)[0] for d in sorted(gpus, key=str))
    return max(1, min(MAX_ROWS, int(FREE_SHARE * free // max(1, row_bytes(lm.model, n_tokens, new_tokens)))))
