"""Next-token loss under truncation (seed 000 §3, "Perplexity says the residue is dead").

``token_nll`` gives the loss of every next-token prediction of one document (natural log, nats), computed from
the segmented run's hidden states in chunks so a long document never materialises [T, vocab] logits.
``copy_mask`` marks the copy/induction subset: predictions whose preceding bigram already appeared more than
``min_distance`` tokens earlier. ``loss_vs_rank`` runs a document set for each r and reports the mean loss and
its difference to the untouched model, on all tokens and on the copy subset.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import pandas as pd
import torch

from gdnviz import runner
from gdnviz.errors import EmptyDocumentSet
from gdnviz.truncation import TruncateCallback, TruncationSpec, check_rank

DEFAULT_RANKS = (1, 4, 12, 32, 128)


def token_nll(lm, input_ids, *, segment_len: int = runner.DEFAULT_SEGMENT_LEN, spec: TruncationSpec | None = None,
              chunk: int = 2048) -> np.ndarray:
    """[T-1] float64: −log p(x_{t+1} | x_{≤t}) for t = 0..T-2 with ``spec``'s heads truncated at every boundary."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1)
    callbacks = [TruncateCallback(lm.info, spec)] if spec is not None and len(spec) else []
    out = runner.forward(lm, ids, segment_len=segment_len, callbacks=callbacks)
    h = out.hidden[0, :-1]
    tgt = ids[0, 1:].to(h.device)
    nll = []
    with torch.inference_mode():
        for s in range(0, h.shape[0], chunk):
            logits = lm.adapter.lm_head(lm.model, h[s:s + chunk]).float()
            nll.append(torch.nn.functional.cross_entropy(logits, tgt[s:s + chunk], reduction="none").double().cpu())
    return torch.cat(nll).numpy()


def copy_mask(input_ids, min_distance: int = 512) -> np.ndarray:
    """[T-1] bool: prediction t (of token t+1) is in the copy/induction subset when the bigram (x_{t-1}, x_t)
    first occurred ending at a position j with j ≤ t − min_distance − 1 (i.e. more than min_distance earlier)."""
    x = np.asarray(torch.as_tensor(input_ids).reshape(-1).tolist(), dtype=np.int64)
    T = len(x)
    mask = np.zeros(max(T - 1, 0), dtype=bool)
    first_end: dict = {}
    for t in range(1, T):
        bg = (x[t - 1], x[t])
        j = first_end.setdefault(bg, t)
        if t < T - 1 and j < t - min_distance:
            mask[t] = True
    return mask


def loss_vs_rank(lm, documents: Sequence, ranks: Iterable[int] = DEFAULT_RANKS, *, heads=None,
                 segment_len: int = runner.DEFAULT_SEGMENT_LEN, min_distance: int = 512,
                 progress=None) -> pd.DataFrame:
    """Mean next-token loss over ``documents`` (lists of token ids) for each r, all heads (or ``heads``) cut.

    Returns columns: r, loss, delta (loss − untouched), copy_loss, copy_delta, n_tokens, n_copy. r equal to
    min(d_k, d_v) is the untouched model (always computed, as the baseline).
    """
    if not documents:
        raise EmptyDocumentSet("loss vs rank needs at least one document")
    rmax = min(lm.info.d_k, lm.info.d_v)
    ranks = sorted({check_rank(r, upper=rmax) for r in ranks} | {rmax})  # 2.5 is refused, not rounded
    heads = heads if heads is not None else [(l, h) for l in lm.info.gdn_layers for h in range(lm.info.num_heads)]
    masks = [copy_mask(d, min_distance) for d in documents]
    rows, total = [], len(ranks) * len(documents)
    for i, r in enumerate(ranks):
        spec = None if r == rmax else TruncationSpec.uniform(heads, r)
        nll = []
        for j, d in enumerate(documents):
            nll.append(token_nll(lm, d, segment_len=segment_len, spec=spec))
            if progress is not None:
                progress(i * len(documents) + j + 1, total)
        allv = np.concatenate(nll)
        cp = np.concatenate([n[m] for n, m in zip(nll, masks)])
        rows.append(dict(r=r, loss=float(allv.mean()), copy_loss=float(cp.mean()) if cp.size else float("nan"),
                         n_tokens=int(allv.size), n_copy=int(cp.size)))
    df = pd.DataFrame(rows)
    base = df.loc[df.r == rmax].iloc[0]
    df["delta"] = df["loss"] - base["loss"]
    df["copy_delta"] = df["copy_loss"] - base["copy_loss"]
    return df[["r", "loss", "delta", "copy_loss", "copy_delta", "n_tokens", "n_copy"]]
