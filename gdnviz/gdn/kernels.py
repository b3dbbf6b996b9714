"""Device dispatch of the GDN core for the runner: fla's Triton kernels on CUDA, PyTorch on CPU.

All functions here take the *prepared* core inputs, batch-first, value heads already expanded:

    q, k : [B, T, H, K]  L2-normalised, **unscaled** (every backend applies the 1/sqrt(K) query scale itself)
    v    : [B, T, H, V]
    g    : [B, T, H]     log-decay, float32 (alpha = exp(g))
    beta : [B, T, H]     write strength in (0, 1)
    state: [B, H, K, V]  float32, canonical key-space x value-space layout (fla's default, transformers' layout)

and return ``(out [B, T, H, V] in v's dtype, final_state [B, H, K, V] float32)``.

On CPU we never call a Triton kernel: the torch bodies of transformers' kernels are used (they are the
functions the ``use_kernel_func_from_hub_with_fallback`` decorator wraps, reached through ``__wrapped__``).
"""
from __future__ import annotations

import functools
import inspect

import torch


@functools.lru_cache(maxsize=1)
def _torch_bodies():
    import transformers.models.qwen3_5.modeling_qwen3_5 as m

    # inspect.unwrap follows __wrapped__ through gdnviz's dispatcher and transformers' hub decorator to the body.
    return inspect.unwrap(m.torch_chunk_gated_delta_rule), inspect.unwrap(m.torch_recurrent_gated_delta_rule)


@functools.lru_cache(maxsize=1)
def fla_ops():
    """fla's (chunk, fused_recurrent) GDN ops, or None when fla/triton cannot be imported."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception:  # pragma: no cover - depends on the environment
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def backend_for(device: torch.device | str) -> str:
    """'fla' when the tensors live on CUDA and fla imports, else 'torch'."""
    dev = torch.device(device)
    if dev.type == "cuda" and fla_ops() is not None:
        return "fla"
    return "torch"


def core(q, k, v, g, beta, state):
    """One call of the GDN core over all T tokens; see the module docstring for shapes.

    On CUDA with fla: ``chunk_gated_delta_rule`` (``fused_recurrent`` for T == 1).
    On CPU: transformers' torch chunk body (recurrent body for T == 1).
    """
    if backend_for(q.device) == "fla":
        chunk, rec = fla_ops()
        fn = rec if q.shape[1] == 1 else chunk
        out, final = fn(
            q, k, v, g=g.float(), beta=beta, initial_state=state, output_final_state=True,
            use_qk_l2norm_in_kernel=False,
        )
        return out, final
    chunk, rec = _torch_bodies()
    fn = rec if q.shape[1] == 1 else chunk
    out, final = fn(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                    use_qk_l2norm_in_kernel=False)
    return out, final


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim in float32, as fla and transformers normalise q and k."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
