"""The exact attention map of one GDN head over a window of query positions (issue 31; docs/attribution.md).

With ``A_s = α_s (I − β_s k_s k_sᵀ)`` and the recurrence from the zero state at token 0, the core's output
``o_t = S^{(t+1)ᵀ} q_t`` (read after token t's write) is exactly ``Σ_{s ≤ t} w_{t,s} v_s`` with::

    w_{t,s} = β_s q_tᵀ A_t A_{t−1} ⋯ A_{s+1} k_s      (the empty product, s = t, is I);  w_{t,s} = 0 for s > t

``q_t`` is the query the core reads (normalised and scaled by ``K**-0.5``). Computed backward over key
positions for all queries of the window at once: O((end − start) · end · d_k) time, float64 on the CPU.
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


def check_window(start, end, T: int) -> None:
    """Raise PositionOutOfRange unless ``0 ≤ start < end ≤ T``, WindowTooLarge when the map would exceed
    ``MAX_MAP_BYTES``."""
    for name, x in (("start", start), ("end", end)):
        if isinstance(x, bool) or not isinstance(x, int):
            raise PositionOutOfRange(f"{name} must be an integer token index; got {x!r}")
    if not 0 <= start < end <= T:
        raise PositionOutOfRange(f"window [{start}, {end}) is outside the document or empty: need "
                                 f"0 <= start < end <= {T} (query positions start..end-1, 0-based)")
    need = 8 * (end - start) * end
    if need > MAX_MAP_BYTES:
        raise WindowTooLarge(f"the map of window [{start}, {end}) is {end - start} x {end} float64 = "
                             f"{need / 2**30:.2f} GiB, over the {MAX_MAP_BYTES / 2**30:.0f} GiB limit; "
                             f"take fewer query positions or an earlier end")


def weights(inp: HeadInputs, start: int, end: int) -> torch.Tensor:
    """``[end − start, end]`` float64 map ``w[t − start, s] = w_{t,s}`` (module docstring) of query positions
    ``start..end−1`` over key positions ``0..end−1``, from a head's float64 inputs. Raises PositionOutOfRange,
    WindowTooLarge."""
    check_window(start, end, inp.T)
    k, alpha, beta = inp.k, inp.g.exp(), inp.beta
    X = inp.q[start:end].clone()                    # row t: q_tᵀ A_t ⋯ A_{s+1}, transported back to key s
    w = torch.zeros(end - start, end, dtype=torch.float64)
    _, proj = recurrence.run(inp, end)
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
                  segment_len: int = DEFAULT_SEGMENT_LEN) -> torch.Tensor:
    """The exact ``[end − start, end]`` attention map of ``(layer, head)`` (module docstring): row ``i`` holds the
    weights of query position ``start + i`` over key positions ``0..end−1``, so the core's output there is
    ``w[i] @ v`` with the head's values. q, k, v, g, β from the model's own run; with ``spec`` (a
    ``TruncationSpec``) from the run truncated at every ``segment_len`` tokens, this head's cuts in the map.
    Raises LayerNotGDN, HeadOutOfRange, PositionOutOfRange, WindowTooLarge (before running the model)."""
    ids = as_ids(input_ids)
    check_head(lm.info, layer, head)
    check_window(start, end, ids.shape[1])
    return weights(head_inputs(lm, ids, layer, head, end, spec, segment_len), start, end)
