"""Greedy answers from a GDN hybrid, with or without truncated heads.

The prompt is prefilled in one segmented run (``gdnviz.runner``): at every boundary (absolute positions L, 2L, ...)
the chosen heads are cut to rank r. Decoding continues the same run through the model's cache, one token per
forward, and **truncation continues during decoding**: whenever the absolute position (prompt + generated tokens)
crosses a multiple of L, the chosen heads are cut again, exactly as if the generated text had been part of the
document. The partial segment at the end of the prompt is not cut until its boundary is reached.

On CUDA the decode steps run through a StaticCache and, between boundaries, are replayed from one CUDA graph
(``gdnviz.static_decode``); elsewhere they go through the model's DynamicCache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gdnviz import runner
from gdnviz.truncation import TruncateCallback, TruncationSpec, contract
from gdnviz.static_decode import decoder_for


@dataclass
class Generation:
    """prompt_len: tokens in the prompt; tokens: generated ids (stop token excluded); text: decoded tokens;
    readouts: how the GDN layers ran (``gdnviz.runner.RunContext.readouts``: "segment-loop", "segment-graph", ...)."""

    prompt_len: int
    tokens: list
    text: str
    readouts: tuple = ()


def greedy_generate(lm, prompt_ids, max_new_tokens: int = 32, *, segment_len: int = runner.DEFAULT_SEGMENT_LEN,
                    spec: TruncationSpec | None = None, stop_ids=None, callbacks=()) -> Generation:
    """Greedy decoding of ``prompt_ids`` (list[int] or [T] tensor; batch 1) with ``spec``'s heads truncated.

    ``callbacks``: more runner callbacks (``gdnviz.callbacks.BoundaryCallback``, after the truncation) for the
    prefill and every decode step, e.g. ``gdnviz.patching.PatchCallback``."""
    callbacks = list(callbacks)
    return contract.run_checked(lambda: _greedy(lm, prompt_ids, max_new_tokens, segment_len, spec, stop_ids,
                                                callbacks), spec)


def _greedy(lm, prompt_ids, max_new_tokens, segment_len, spec, stop_ids, callbacks) -> Generation:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(1, -1)
    callbacks = ([TruncateCallback(lm.info, spec)] if spec is not None and len(spec) else []) + callbacks
    ctx = runner.RunContext(segment_len=runner.check_segment_len(segment_len), callbacks=callbacks)
    if stop_ids is None:
        stop_ids = model_stop_ids(lm)
    out = runner.forward(lm, ids, use_cache=True, logits_positions="last", keep_hidden=False, ctx=ctx)
    cache, tokens, logits = out.cache, [], out.logits[0, -1]
    dec = decoder_for(lm, ctx, cache, max_new_tokens)  # on CUDA: a StaticCache, steps replayed from a CUDA graph
    if dec is not None:
        out = cache = None  # the StaticCache holds a copy: free the DynamicCache's keys and values
    for k in range(max_new_tokens):
        nxt = int(logits.argmax())
        if nxt in stop_ids:
            break
        tokens.append(nxt)
        if k == max_new_tokens - 1:
            break
        if dec is not None:
            logits = dec.step([nxt])[0]
        else:
            logits = runner.forward(lm, torch.tensor([[nxt]]), use_cache=True, cache=cache, logits_positions="last",
                                    keep_hidden=False, ctx=ctx).logits[0, -1]
    text = lm.tokenizer.decode(tokens, skip_special_tokens=True) if lm.tokenizer is not None else ""
    return Generation(prompt_len=ids.shape[1], tokens=tokens, text=text, readouts=tuple(sorted(ctx.readouts)))


def model_stop_ids(lm) -> set:
    """The model's end-of-sequence token ids (generation config, model config and tokenizer together)."""
    ids = set()
    for src in (getattr(lm.model, "generation_config", None), lm.model.config, lm.tokenizer):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if eos is None:
            continue
        ids |= set(eos) if isinstance(eos, (list, tuple, set)) else {int(eos)}
    return ids
