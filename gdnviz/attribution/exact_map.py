"""The exact attention map of one GDN head over a window of query positions (issue 31; docs/attribution.md).

With ``A_s = α_s (I − β_s k_s k_sᵀ)`` and the recurrence from the zero state at token 0, the core's output
``o_t = S^{(t+1)ᵀ} q_t`` (read after token t's write) is exactly ``Σ_{s ≤ t} w_{t,s} v_s`` with::

    w_{t,s} = β_s q_tᵀ A_t A_{t−1} ⋯ A_{s+1} k_s      (the empty product, s = t, is I);  w_{t,s} = 0 for s > t

``q_t`` is the query the core reads (normalised and scaled by ``K**-0.5``). Computed backward over key
positions for all queries of the window at once: O((end − start) · end · d_k) time, float64 on the CPU by default.
The same code runs on any device and dtype (``device=``, ``dtype=``; ``fast_path(lm)`` picks the model's CUDA device
in float64, docs/attribution.md "The CUDA fast path"); the float64 CPU result is the reference it is tested against.
A truncated head (``gdnviz.attribution.recurrence``) has ``Π_b`` inserted in the product for every boundary
``s < b ≤ t`` (the cut at b comes after token b−1's write and before token b's), O(window · d_k²) per boundary.
"""
from __future__ import annotations

import torch

from gdnviz.attribution import recurrence
from gdnviz.attribution.inputs import HeadInputs, as_ids, check_head, head_inputs
from gdnviz.errors import PositionOutOfRange, WindowTooLarge
from gdnviz.runner import DEFAULT_SEGMENT_LEN

MAX_MAP_BYTES = 2 * 2**30  # the map is float64 [end − start, end]; plus a [end − start, d_k] work array


def check_window(start, end, T: int, limit: int = MAX_MAP_BYTES) -> None:
    """Raise PositionOutOfRange unless ``0 ≤ start < end ≤ T``, WindowTooLarge when the map would exceed ``limit``
    bytes (default ``MAX_MAP_BYTES``)."""
    for name, x in (("start", start), ("end", end)):
        if isinstance(x, bool) or not isinstance(x, int):
            raise PositionOutOfRange(f"{name} must be an integer token index; got {x!r}")
    if not 0 <= start < end <= T:
        raise PositionOutOfRange(f"window [{start}, {end}) is outside the document or empty: need "
                                 f"0 <= start < end <= {T} (query positions start..end-1, 0-based)")
    need = 8 * (end - start) * end
    if need > limit:
        raise WindowTooLarge(f"the map of window [{start}, {end}) is {end - start} x {end} float64 = "
                             f"{need / 2**30:.2f} GiB, over the {limit / 2**30:g} GiB limit; "
                             f"take fewer query positions or an earlier end")


def fast_path(lm) -> tuple[torch.device, torch.dtype]:
    """``(device, dtype)`` the app computes maps and decompositions with: the model's device when it is CUDA, else
    the CPU, always float64 (on an H200 the loop is launch-bound, so float64 costs what float32 does; the float32
    error is measured in docs/attribution.md)."""
    dev = torch.device(lm.device)
    return (dev if dev.type == "cuda" else torch.device("cpu")), torch.float64


def weights(inp: HeadInputs, start: int, end: int, device=None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``[end − start, end]`` map ``w[t − start, s] = w_{t,s}`` (module docstring) of query positions
    ``start..end−1`` over key positions ``0..end−1``, from a head's float64 inputs, computed on ``device`` (None:
    the CPU) in ``dtype`` and returned there (the cut projections come from the float64 reference recurrence).
    Raises PositionOutOfRange, WindowTooLarge."""
    check_window(start, end, inp.T)
    dev = torch.device("cpu") if device is None else torch.device(device)
    on = dict(device=dev, dtype=dtype)
    k, alpha, beta = inp.k.to(**on), inp.g.exp().to(**on), inp.beta.to(**on)
    X = inp.q[start:end].to(**on, copy=True)                # row t: q_tᵀ A_t ⋯ A_{s+1}, transported back to key s
    w = torch.zeros(end - start, end, **on)
    proj = {b: P.to(**on) for b, P in recurrence.run(inp, end)[1].items()} if inp.rank is not None else {}
    for s in range(end - 1, -1, -1):
        lo = max(s - start, 0)                       # queries t ≥ s are rows lo.. of the window
        if s + 1 in proj:                            # queries t ≥ s + 1 read through the cut at s + 1
            hi = max(s + 1 - start, 0)
            X[hi:] = X[hi:] @ proj[s + 1]            # Π is symmetric
        Xa = X[lo:]
        ks = k[s]
        dots = Xa @ ks
        w[lo:, s] = beta[s] * dots
        X[lo:] = alpha[s] * (Xa - beta[s] * dots[:, None] * ks[None])   # A_s is symmetric: X A_s
    return w


def attention_map(lm, input_ids, layer: int, head: int, start: int, end: int, spec=None,
                  segment_len: int = DEFAULT_SEGMENT_LEN, device=None, dtype: torch.dtype = torch.float64
                  ) -> torch.Tensor:
    """The exact ``[end − start, end]`` attention map of ``(layer, head)`` (module docstring): row ``i`` holds the
    weights of query position ``start + i`` over key positions ``0..end−1``, so the core's output there is
    ``w[i] @ v`` with the head's values. q, k, v, g, β from the model's own run; with ``spec`` (a
    ``TruncationSpec``) from the run truncated at every ``segment_len`` tokens, this head's cuts in the map.
    ``device`` / ``dtype``: where the map is computed (:func:`weights`; :func:`fast_path` gives the app's choice).
    Raises LayerNotGDN, HeadOutOfRange, PositionOutOfRange, WindowTooLarge (before running the model)."""
    ids = as_ids(input_ids)
    check_head(lm.info, layer, head)
    check_window(start, end, ids.shape[1])
    return weights(head_inputs(lm, ids, layer, head, end, spec, segment_len), start, end, device, dtype)
