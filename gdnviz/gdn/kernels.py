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


FLA_CHUNK = 64  # fla's chunk size: chunk states exist at every multiple of it


def states_fast_path(device, T: int, cuts) -> bool:
    """True when ``core_with_states`` can read the states at local indices ``cuts`` from ONE fla chunk pass:
    fla on CUDA and every cut (< T) on fla's 64-token chunk grid."""
    return (backend_for(device) == "fla" and T > 1 and len(cuts) > 0
            and all(c % FLA_CHUNK == 0 or c == T for c in cuts))


def core_with_states(q, k, v, g, beta, state, cuts):
    """The GDN core over all T tokens in ONE fla chunk pass, also returning the carried state at local indices
    ``cuts`` (each a multiple of 64, or T).

    Returns ``(out [B, T, H, V] in v's dtype, final [B, H, K, V] fp32, states [len(cuts), B, H, K, V] fp32)``.

    fla's chunk kernel already computes the state at the start of every 64-token chunk (``h``, which it keeps in
    the input dtype for its output pass). Here ``h`` is written in float32 by the same Triton kernel, so the states
    are the kernel's own fp32 running state, exactly what a segment-by-segment scan passes between its calls; the
    output pass reads ``h`` rounded to the input dtype exactly as ``chunk_gated_delta_rule`` does. Tests on CUDA
    pin it to the segment loop (``gdn_scan`` with ``RunContext.fast_states=False``).
    Uses fla 0.6's internal functions (pinned in requirements.txt); only for the capture path, which only reads
    states.
    """
    import triton
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_kernel_h_blockdim64 as h_kernel
    from fla.ops.common.chunk_o import chunk_fwd_o

    B, T, H, K = k.shape
    V = v.shape[-1]
    BT = FLA_CHUNK
    q, k, v, beta = (x.contiguous() for x in (q, k, v, beta))
    gc, w, u = intra(k, v, g, beta)
    with torch.cuda.device(q.device.index):
        NT = triton.cdiv(T, BT)
        h = torch.empty(B, NT, H, K, V, device=k.device, dtype=torch.float32)
        v_new = torch.empty_like(u)
        final = torch.zeros(B, H, K, V, device=k.device, dtype=torch.float32)
        h0 = None if state is None else state.float().contiguous()

        def grid(meta):
            return (triton.cdiv(V, meta["BV"]) * B * H,)

        h_kernel[grid](k=k, v=u, w=w, v_new=v_new, g=gc, gk=None, h=h, h0=h0, ht=final, cu_seqlens=None,
                       chunk_offsets=None, T=T, H=H, HV=H, K=K, V=V, BT=BT, STATE_V_FIRST=False)
        o = chunk_fwd_o(q=q, k=k, v=v_new, h=h.to(k.dtype), g=gc, scale=K ** -0.5, chunk_size=BT)
    idx = [c // BT for c in cuts if c < T]
    picked = h[:, idx].transpose(0, 1)  # [n, B, H, K, V]
    if len(idx) < len(cuts):  # the last cut is T itself: the final state
        picked = torch.cat([picked, final[None]], dim=0)
    del h
    return o.to(v.dtype), final, picked


def intra(k, v, g, beta):
    """The chunk-local half of fla's chunk pass over all T tokens of a window (CUDA with fla only): ``(gc, w, u)``,
    the per-64-token-chunk cumulative log2-decays ``gc [B, T, H]`` float32 and the WY factors ``w [B, T, H, K]``,
    ``u [B, T, H, V]`` (fla's ``chunk_local_cumsum`` and ``chunk_gated_delta_rule_fwd_intra``, as
    ``chunk_gated_delta_rule`` runs them). None of it reads the state, and nothing crosses a chunk's edge, so a segment
    that starts on the 64-token grid gets from slices of these exactly what its own chunk call would compute (fla
    0.6's autotuning keys do not include T: the same kernel configurations for a window as for a segment). The
    truncated run's graph windows (``gdnviz.gpu.scan_graph``) compute it once per window instead of once per segment
    and run only :func:`segment` per segment; the capture's one pass (:func:`core_with_states`) starts with it."""
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    with torch.cuda.device(k.device.index):
        gc = chunk_local_cumsum(g.float().contiguous(), chunk_size=FLA_CHUNK, scale=RCP_LN2)
        w, u, _A = chunk_gated_delta_rule_fwd_intra(k=k.contiguous(), v=v.contiguous(), g=gc,
                                                    beta=beta.contiguous(), chunk_size=FLA_CHUNK)
    return gc, w, u


def segment(q, k, gc, w, u, state):
    """The state-dependent half of fla's chunk pass over one segment (slices of :func:`intra`'s outputs over the
    segment's tokens, which start on the 64-token grid): the state recurrence (``chunk_gated_delta_rule_fwd_h``,
    from ``state`` [B, H, K, V] float32) and the output pass (``chunk_fwd_o``, query scale K^-1/2). Returns
    ``(out [B, T, H, V] in q's dtype, final state float32)``, bit for bit what :func:`core` returns for the segment
    (``tests/test_scan_graph.py`` pins them on CUDA)."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_fwd_o

    q, k, gc, w, u = (x.contiguous() for x in (q, k, gc, w, u))  # slices of a batch (B > 1) are strided
    with torch.cuda.device(q.device.index):
        h, v_new, final = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=gc, initial_state=state,
                                                       output_final_state=True, chunk_size=FLA_CHUNK)
        o = chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=gc, scale=k.shape[-1] ** -0.5, chunk_size=FLA_CHUNK)
    return o.to(q.dtype), final


def unit_rows(x: torch.Tensor, dtype: torch.dtype, eps: float = 1e-6) -> torch.Tensor:
    """:func:`l2norm` written straight into ``dtype`` in two passes over ``x``: the row norms in float32
    (``vector_norm``), then one multiplication computed in float32 and stored in ``dtype``. ``l2norm`` then ``.to``
    makes five passes and two float32 copies of a ``[B, T, H, K]`` tensor. The row scale is rsqrt(‖x‖² + eps) with
    ‖x‖² the square of a float32 norm, so it can differ from :func:`l2norm`'s by an ulp (a test bounds the
    difference)."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
    inv = torch.rsqrt(norm.square_().add_(eps))
    return torch.mul(x, inv, out=torch.empty(x.shape, dtype=dtype, device=x.device))


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim in float32, as fla and transformers normalise q and k."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
