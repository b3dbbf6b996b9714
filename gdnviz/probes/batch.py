"""Several prompts per forward, each run exactly as if it were alone (left padding, per-sample boundaries).

A batch is left-padded to a common length. Three things keep every row's run identical to its run alone:

1. **Padding is the core no-op and leaves the short convolution's history empty** (seed 003 §5). transformers'
   GDN layers multiply the hidden states by the 2-D padding mask (``apply_mask_to_padding_states``) before any
   projection; the Qwen3.5 / Qwen3.5-MoE / Qwen3-Next ``in_proj_*`` have no bias, so q, k, v, a, b are exactly 0
   at pads and the causal conv sees zero inputs there, which is exactly the zero history a row alone starts with
   (checked in ``_check_isolation``). The gates are *not* the no-op at pads: b = 0 gives beta = 1/2 and a = 0
   gives g = -exp(A_log) softplus(dt_bias) != 0. With k = v = 0 a zero state would still stay zero, but gdnviz does
   not rely on it: the scan (``gdnviz.runner``, ``RunContext.row_starts``) forces g = 0 (alpha = 1), beta = 0 and
   q = k = v = 0 at every pad position, the exact core no-op, whatever the inputs there.
2. **Boundaries at each row's own multiples of L**: a row's positions count from its first real token, so its
   segment boundaries sit at absolute index ``pad_b + k L``. The scan cuts at the union of all rows' boundaries
   and applies the boundary callbacks (truncation) only to the rows that reached one, with their own position.
3. **Attention**: the 2-D attention mask (grown by one column per decoded token) and per-row position ids
   ``cumsum(mask) - 1`` (pads 0; Qwen3.5 expands a 2-D ``position_ids`` to its four mrope rows, all equal for text,
   which is plain RoPE) — what ``generate()`` does for left padding.

Decoding continues the same run through the cache; truncation continues at each row's own boundaries. On CUDA the
decode steps run through a StaticCache, replayed from one CUDA graph between boundaries (``gdnviz.static_decode``).
The fla family runs one prompt at a time (its layers turn a padding mask into packed sequences, which gdnviz's scan
refuses).
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import torch

from gdnviz import runner
from gdnviz.errors import EmptyDocument, EmptyDocumentSet
from gdnviz.generate import Generation, greedy_generate, model_stop_ids
from gdnviz.truncation import TruncateCallback, TruncationSpec, contract
from gdnviz.static_decode import decoder_for

__all__ = ["pad_left", "batched_forward", "batched_token_nll", "batched_greedy"]


def _as_lists(prompts) -> list[list[int]]:
    if prompts is None or len(prompts) == 0:
        raise EmptyDocumentSet("a batch needs at least one prompt")
    out = [list(torch.as_tensor(p).reshape(-1).tolist()) for p in prompts]
    for i, p in enumerate(out):
        if not p:
            raise EmptyDocument(f"prompt {i} of the batch has no tokens")
    return out


def pad_left(prompts: Sequence, pad_id: int = 0):
    """Left-pad token lists to a common length: (ids [B, T] long, mask [B, T] long, starts = pads per row)."""
    prompts = _as_lists(prompts)
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(prompts), T), dtype=torch.long)
    starts = []
    for b, p in enumerate(prompts):
        s = T - len(p)
        ids[b, s:] = torch.tensor(p, dtype=torch.long)
        mask[b, s:] = 1
        starts.append(s)
    return ids, mask, starts


def _position_ids(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


def _check_isolation(lm) -> None:
    """Padding isolates the conv history only if nothing before the conv adds a bias at zeroed pad inputs."""
    if lm.info.family == "fla":
        raise NotImplementedError("batched runs support the transformers families (Qwen3.5, Qwen3.5-MoE, "
                                  "Qwen3-Next); fla models run one prompt at a time")
    for idx, mod in lm.adapter.gdn_modules(lm.model).items():
        for name, sub in mod.named_modules():
            if name.startswith("in_proj") and getattr(sub, "bias", None) is not None:
                raise NotImplementedError(
                    f"GDN layer {idx}: {name} has a bias, so left padding would write into the short convolution's "
                    "history; run these prompts one at a time")


def _callbacks(lm, spec: TruncationSpec | None, callbacks: Iterable) -> list:
    cbs = [TruncateCallback(lm.info, spec)] if spec is not None and len(spec) else []
    return cbs + list(callbacks)


def batched_forward(lm, prompts: Sequence, *, segment_len: int = runner.DEFAULT_SEGMENT_LEN,
                    spec: TruncationSpec | None = None, callbacks: Iterable = (), use_cache: bool = False,
                    logits_positions=None, keep_hidden: bool = True, pad_id: int = 0):
    """One segmented forward of a left-padded batch; returns (RunOutput, ctx, mask, starts).

    Hidden states / logits of row b's token i sit at column ``starts[b] + i``. ``ctx`` continues the run (decode).
    With a ``spec`` on CUDA, make the whole run (with its decode) through ``truncation.contract.run_checked`` so
    that a breach of the 1e-5 contract in a graph window answers it again (``batched_greedy`` and
    ``batched_token_nll`` do).
    """
    _check_isolation(lm)
    ids, mask, starts = pad_left(prompts, pad_id)
    ctx = runner.RunContext(segment_len=runner.check_segment_len(segment_len),
                            callbacks=_callbacks(lm, spec, callbacks), row_starts=list(starts))
    out = runner.forward(lm, ids, use_cache=use_cache, logits_positions=logits_positions, keep_hidden=keep_hidden,
                         ctx=ctx, attention_mask=mask, position_ids=_position_ids(mask))
    return out, ctx, mask, starts


def batched_token_nll(lm, prompts: Sequence, *, segment_len: int = runner.DEFAULT_SEGMENT_LEN,
                      spec: TruncationSpec | None = None, chunk: int = 2048) -> list[np.ndarray]:
    """``gdnviz.probes.loss.token_nll`` for several prompts in one forward: one [len - 1] float64 array each."""
    prompts = _as_lists(prompts)
    out, _, _, starts = contract.run_checked(lambda: batched_forward(lm, prompts, segment_len=segment_len, spec=spec),
                                             spec)
    res = []
    with torch.inference_mode():
        for b, (p, s) in enumerate(zip(prompts, starts)):
            h = out.hidden[b, s:-1]
            tgt = torch.tensor(p[1:], dtype=torch.long, device=h.device)
            nll = []
            for c in range(0, h.shape[0], chunk):
                logits = lm.adapter.lm_head(lm.model, h[c:c + chunk]).float()
                nll.append(torch.nn.functional.cross_entropy(logits, tgt[c:c + chunk].to(logits.device),
                                                             reduction="none")
                           .double().cpu())
            res.append(torch.cat(nll).numpy() if nll else np.zeros(0))
    return res


def batched_greedy(lm, prompts: Sequence, max_new_tokens: int = 32, *,
                   segment_len: int = runner.DEFAULT_SEGMENT_LEN, spec: TruncationSpec | None = None,
                   stop_ids=None, callbacks: Iterable = (), pad_id: int = 0) -> list[Generation]:
    """Greedy answers for several prompts in one batch, each identical to ``greedy_generate`` alone.

    ``spec``'s heads are cut at each sample's own boundaries (its positions count from its first real token),
    during the prefill and during decoding. A row stops at its first stop token (excluded from ``tokens``);
    the batch stops when every row has stopped or after ``max_new_tokens``. ``callbacks`` are extra runner
    callbacks (e.g. a recorder of the final states, ``[B, H, K, V]`` rows in prompt order).
    """
    prompts = _as_lists(prompts)
    if stop_ids is None:
        stop_ids = model_stop_ids(lm)
    stop_ids = set(stop_ids)
    callbacks = list(callbacks)
    if lm.info.family == "fla":
        if callbacks:
            raise NotImplementedError("extra callbacks are not supported for fla models in batched_greedy")
        return [greedy_generate(lm, p, max_new_tokens, segment_len=segment_len, spec=spec, stop_ids=stop_ids)
                for p in prompts]
    return contract.run_checked(lambda: _batched_greedy(lm, prompts, max_new_tokens, segment_len, spec, stop_ids,
                                                        callbacks, pad_id), spec)


def _batched_greedy(lm, prompts, max_new_tokens, segment_len, spec, stop_ids, callbacks, pad_id) -> list[Generation]:
    out, ctx, mask, _ = batched_forward(lm, prompts, segment_len=segment_len, spec=spec, callbacks=callbacks,
                                        use_cache=True, logits_positions="last", keep_hidden=False, pad_id=pad_id)
    B = len(prompts)
    cache = out.cache
    n_real = mask.sum(-1)  # the position of each row's next token
    tokens: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    logits = out.logits[:, -1]
    # on CUDA: a StaticCache, steps replayed from a CUDA graph
    dec = decoder_for(lm, ctx, cache, max_new_tokens, attention_mask=mask, positions=n_real)
    if dec is not None:
        out = cache = None  # the StaticCache holds a copy: free the DynamicCache's keys and values
    for step in range(max_new_tokens):
        nxt = logits.argmax(-1).tolist()
        for b in range(B):
            if not done[b]:
                if nxt[b] in stop_ids:
                    done[b] = True
                else:
                    tokens[b].append(int(nxt[b]))
        if all(done) or step == max_new_tokens - 1:
            break
        if dec is not None:
            logits = dec.step(nxt)
            continue
        feed = torch.tensor([[t] for t in nxt], dtype=torch.long)
        mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], dim=1)
        out = runner.forward(lm, feed, use_cache=True, cache=cache, logits_positions="last", keep_hidden=False,
                             ctx=ctx, attention_mask=mask, position_ids=n_real.reshape(B, 1))
        logits = out.logits[:, -1]
        n_real = n_real + 1
    tok = lm.tokenizer
    return [Generation(prompt_len=len(p), tokens=t, text=tok.decode(t, skip_special_tokens=True) if tok else "")
            for p, t in zip(prompts, tokens)]
