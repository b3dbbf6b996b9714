"""Float64 reference of the Gated DeltaNet core: the single source of truth the kernels are checked against.

Only the associative core is here (seed 003 §2 and §6). No L2 normalisation of q/k, no query scaling, no
short convolution, no gate computation (``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``),
no output norm or gate: callers prepare those. :func:`l2_normalise` is a helper for tests and callers that
mirrors fla/transformers; the core functions never call it.

Conventions (one head; every function handles ``H`` heads at once, each with its own state):

* State ``S`` has the canonical layout ``[K, V]`` (key space × value space), the layout of transformers'
  cache ``[B, H, K, V]`` and of fla with ``state_v_first=False``. Seed 003 writes the value-first transpose
  ``[V, K]`` with column vectors; its four lines ``S = αS; r = β(v − S k); S = S + r kᵀ; o = S q`` become,
  in this layout::

      S = α S
      r = β (v − Sᵀ k)        # residual: target minus what the decayed state predicts for k
      S = S + k rᵀ            # write the residual along the key
      o = Sᵀ q                # read after the write (the current token is visible to its own query)

* ``g`` is the natural log of the per-token decay factor, ``α = exp(g)`` (dimensionless, 0 ≤ α; ``g = -inf``
  gives α = 0 exactly). ``beta`` is the dimensionless write strength (usually in [0, 1]).
* Keys are expected already L2-normalised and queries already scaled (transformers/fla use
  ``q̂ = l2_normalise(q) * K**-0.5``). The core does not check this: unnormalised keys are allowed and
  behave as the recurrence says (seed 003: ``β = 1/2, k = 3`` maps old state 1 to ``-7/2``).
* Shapes: ``q, k: [T, H, K]``; ``v: [T, H, V]``; ``g, beta: [T, H]``; ``initial_state: [H, K, V]`` or None
  (zeros). Outputs: ``out [T, H, V]`` and ``final_state [H, K, V]``, float64, on the device of ``q``,
  whatever the input dtypes.
"""

from __future__ import annotations

import torch

__all__ = ["recurrent", "chunked", "l2_normalise"]


def l2_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x², -1) + eps)`` over the last axis, as fla and transformers' ``l2norm`` do.

    Computed in the dtype of ``x`` (pass float64 for a reference); shape unchanged. The epsilon makes the
    result slightly shorter than unit length (``‖x̂‖ = ‖x‖ / sqrt(‖x‖² + eps)``), exactly like the kernels.
    """
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, initial_state):
    """Validate shapes, cast to float64 and return ``(q, k, v, alpha, beta, S0)`` with ``S0 [H, K, V]``."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [T, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape [T, H, K]; got {tuple(q.shape)} and {tuple(k.shape)}")
    T, H, K = k.shape
    if v.shape[:2] != (T, H):
        raise ValueError(f"v must be [T={T}, H={H}, V]; got {tuple(v.shape)}")
    V = v.shape[2]
    if g.shape != (T, H) or beta.shape != (T, H):
        raise ValueError(f"g and beta must be [T={T}, H={H}]; got {tuple(g.shape)} and {tuple(beta.shape)}")
    dev = q.device
    f64 = dict(dtype=torch.float64, device=dev)
    q, k, v, g, beta = (x.to(**f64) for x in (q, k, v, g, beta))
    if initial_state is None:
        S = torch.zeros(H, K, V, **f64)
    else:
        if initial_state.shape != (H, K, V):
            raise ValueError(f"initial_state must be [H={H}, K={K}, V={V}]; got {tuple(initial_state.shape)}")
        S = initial_state.to(**f64).clone()
    return q, k, v, torch.exp(g), beta, S


def recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token Gated DeltaNet core in float64 (decode form).

    Args:
        q: ``[T, H, K]`` queries, already normalised and scaled.
        k: ``[T, H, K]`` keys, already L2-normalised.
        v: ``[T, H, V]`` values.
        g: ``[T, H]`` log decay, ``α = exp(g)``.
        beta: ``[T, H]`` write strength.
        initial_state: ``[H, K, V]`` state before token 0, or None for zeros. Not modified.

    Returns:
        ``(out, final_state)``: ``out [T, H, V]`` with ``out[t] = S_tᵀ q_t`` read after token t's write, and
        ``final_state [H, K, V]`` = ``S_{T-1}`` (the initial state when T = 0). Both float64.

    Per token (each head independently): ``S = α S; r = β (v − Sᵀ k); S = S + k rᵀ; o = Sᵀ q``.
    """
    q, k, v, alpha, beta, S = _prepare(q, k, v, g, beta, initial_state)
    T, H, _ = k.shape
    # heads first, tokens as [1, D] rows so every step is a batched (over heads) matrix product
    qr, kr, vr = (x.transpose(0, 1).unsqueeze(2) for x in (q, k, v))   # [H, T, 1, D]
    a, b = (x.T[:, :, None, None] for x in (alpha, beta))               # [H, T, 1, 1]
    out = torch.empty(H, T, 1, v.shape[2], dtype=torch.float64, device=S.device)
    for t in range(T):
        k_t = kr[:, t]                                                   # [H, 1, K]
        S = a[:, t] * S                                                  # decay the old state first
        r = b[:, t] * (vr[:, t] - torch.bmm(k_t, S))                     # residual β (v − Sᵀk), [H, 1, V]
        S = torch.baddbmm(S, k_t.transpose(1, 2), r)                     # S + k rᵀ
        out[:, t] = torch.bmm(qr[:, t], S)                               # read after the write: Sᵀq
    return out.squeeze(2).transpose(0, 1).contiguous(), S


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (prefill) form of the same core, seed 003 §6, in float64.

    Same arguments, shapes and results as :func:`recurrent`, plus ``chunk_size`` (tokens per chunk, ≥ 1; the
    last chunk may be shorter). Equal to :func:`recurrent` up to float64 rounding.

    Per chunk of ``C`` tokens (indices ``i, j`` inside the chunk, 0-based here), incoming state ``S_in``:

    * decay products, formed as explicit running products (an empty product is 1) so that α = 0 is
      exact and no ratio of cumulative products (0/0) appears::

          γ_i     = α_0 α_1 … α_i               decay from the chunk start through token i
          D[i, j] = α_{j+1} … α_i   (j ≤ i)     decay from just after token j through token i; D[i, i] = 1

    * residuals ``e_i = r_i`` (rows of ``E [C, V]``) satisfy, after substituting the expanded state
      ``S_{i-1} = γ_{i-1} S_in + Σ_{j<i} D[i-1, j] k_j e_jᵀ``::

          e_i + Σ_{j<i} β_i D[i, j] (k_iᵀ k_j) e_j = β_i (v_i − γ_i S_inᵀ k_i)

      i.e. ``(I + L) E = R`` with ``L`` strictly lower triangular: a unit-diagonal lower-triangular system,
      solved by forward substitution (no inverse is formed).
    * readout includes the diagonal (token i writes before it reads) and the local decay::

          o_i = γ_i S_inᵀ q_i + Σ_{j≤i} D[i, j] (q_iᵀ k_j) e_j

    * carry: ``S_out = γ_{C-1} S_in + Σ_j D[C-1, j] k_j e_jᵀ``, the next chunk's ``S_in``. A chunk is not a
      sample boundary.
    """
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer; got {chunk_size!r}")
    q, k, v, alpha, beta, S = _prepare(q, k, v, g, beta, initial_state)
    T, H, _ = k.shape
    V = v.shape[2]
    dev = S.device
    out = torch.empty(T, H, V, dtype=torch.float64, device=dev)
    for start in range(0, T, chunk_size):
        stop = min(start + chunk_size, T)
        C = stop - start
        # heads first: [H, C, ...]
        qc, kc, vc = (x[start:stop].transpose(0, 1) for x in (q, k, v))
        a, b = alpha[start:stop].T, beta[start:stop].T                    # [H, C]

        # --- decay products (explicit products, no division) -----------------------------------------
        gamma = torch.cumprod(a, dim=1)                                   # γ_i = Π_{m ≤ i} α_m
        idx = torch.arange(C, device=dev)
        # X[h, m, j] = α_m where m > j, else 1; the running product down m gives D[h, i, j] = Π_{j<m≤i} α_m
        X = torch.where(idx[:, None] > idx[None, :], a[:, :, None], torch.ones((), dtype=a.dtype, device=dev))
        D = torch.cumprod(X, dim=1).tril()                                # zero above the diagonal (causal)

        # --- residual system (I + L) E = R, forward substitution -----------------------------------------
        KK = torch.einsum("hik,hjk->hij", kc, kc)
        L = (b[:, :, None] * D * KK).tril(-1)                             # strictly lower
        R = b[:, :, None] * (vc - gamma[:, :, None] * torch.einsum("hik,hkv->hiv", kc, S))
        E = torch.empty(H, C, V, dtype=torch.float64, device=dev)
        for i in range(C):                                                # row i needs rows < i only
            E[:, i] = R[:, i] - torch.bmm(L[:, i, None, :i], E[:, :i]).squeeze(1)

        # --- readout: incoming state + decay-weighted causal matrix including the diagonal ---------------
        rho = D * torch.einsum("hik,hjk->hij", qc, kc)                   # D is already lower incl. diagonal
        o = gamma[:, :, None] * torch.einsum("hik,hkv->hiv", qc, S) + torch.einsum("hij,hjv->hiv", rho, E)
        out[start:stop] = o.transpose(0, 1)

        # --- carry the terminal state -----------------------------------------------------------------
        S = gamma[:, -1, None, None] * S + torch.einsum("hj,hjk,hjv->hkv", D[:, -1, :], kc, E)
    return out, S
