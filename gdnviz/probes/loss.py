"""Next-token loss of one document and its copy/induction subsets (seed 000 §3, "Perplexity says the residue is
dead"). The sweep over documents x ranks is ``gdnviz.probes.loss_sweep``.

``token_nll`` gives the loss of every next-token prediction of one document (natural log, nats), computed from
the segmented run's hidden states in chunks so a long document never materialises [T, vocab] logits.

The copy/induction subset, in two readings. For tokens x_0 .. x_{T-1}, prediction t (0 ≤ t ≤ T-2) predicts
x_{t+1} from x_0 .. x_t; its preceding bigram is b_t = (x_{t-1}, x_t), defined for t ≥ 1, and b_t "occurred
earlier at j" when 1 ≤ j < t and b_j = b_t (the earlier copy ends at token j; the distance is t - j tokens).
With d = ``min_distance``:

- ``"any"``: prediction t is in the subset when some earlier occurrence j has t - j > d (equivalently the first
  occurrence of b_t is more than d tokens back). A bigram repeated every few tokens counts once it has been in
  the document for more than d tokens.
- ``"recent"`` (strict): b_t occurred earlier and its most recent earlier occurrence j* = max{j < t : b_j = b_t}
  has t - j* > d: the bigram has not been seen within the last d tokens, so only a memory older than d tokens
  can supply the continuation.

"recent" ⊆ "any". Prediction 0 (no preceding bigram) is in neither subset.
"""
from __future__ import annotations

import numpy as np
import torch

from gdnviz import runner
from gdnviz.truncation import TruncateCallback, TruncationSpec, contract

#: The readings of "bigram seen more than ``min_distance`` tokens back" (the module docstring defines them).
COPY_READINGS = ("any", "recent")


def token_nll(lm, input_ids, *, segment_len: int = runner.DEFAULT_SEGMENT_LEN, spec: TruncationSpec | None = None,
              chunk: int = 2048) -> np.ndarray:
    """[T-1] float64: −log p(x_{t+1} | x_{≤t}) for t = 0..T-2 with ``spec``'s heads truncated at every boundary."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1)
    callbacks = [TruncateCallback(lm.info, spec)] if spec is not None and len(spec) else []
    out = contract.run_checked(lambda: runner.forward(lm, ids, segment_len=segment_len, callbacks=callbacks), spec)
    h = out.hidden[0, :-1]
    tgt = ids[0, 1:].to(h.device)
    nll = []
    with torch.inference_mode():
        for s in range(0, h.shape[0], chunk):
            logits = lm.adapter.lm_head(lm.model, h[s:s + chunk]).float()
            nll.append(torch.nn.functional.cross_entropy(logits, tgt[s:s + chunk].to(logits.device),
                                                         reduction="none").double().cpu())
    return torch.cat(nll).numpy()


def copy_mask(input_ids, min_distance: int = 512, reading: str = "any") -> np.ndarray:
    """[T-1] bool over the predictions of ``input_ids`` (a list, array or tensor of T token ids): the copy/induction
    subset in ``reading`` "any" or "recent" (module docstring). ValueError for another reading or a negative
    ``min_distance``."""
    if reading not in COPY_READINGS:
        raise ValueError(f"copy subset reading {reading!r}: expected one of {', '.join(COPY_READINGS)}")
    if isinstance(min_distance, bool) or not isinstance(min_distance, (int, np.integer)) or min_distance < 0:
        raise ValueError(f"min_distance must be a whole number of tokens ≥ 0, got {min_distance!r}")
    x = np.asarray(torch.as_tensor(input_ids).reshape(-1).tolist(), dtype=np.int64)
    T = len(x)
    mask = np.zeros(max(T - 1, 0), dtype=bool)
    seen: dict = {}  # bigram -> the end of its first ("any") or latest ("recent") occurrence so far
    for t in range(1, T - 1):
        bg = (int(x[t - 1]), int(x[t]))
        j = seen.get(bg)
        mask[t] = j is not None and t - j > min_distance
        if j is None or reading == "recent":
            seen[bg] = t
    return mask
