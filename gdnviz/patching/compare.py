"""Run prompt B with chosen heads' states at one boundary replaced by prompt A's, and compare (docs/attribution.md,
"State patching between prompts").

Three greedy runs (``gdnviz.generate.greedy_generate``, ``max_new_tokens`` each): A, recording the chosen heads'
states at the source boundary a; B, recording its own states at boundary b (the unpatched baseline); B with those
heads' incoming states at b replaced by A's (``PatchCallback``). Then the loss on a continuation c_1..c_m (token
ids; default B's unpatched greedy answer) appended to B, teacher-forced, in both B runs:

    loss = (1/m) Σ_j −log p(c_j | B, c_<j)   (nats / token),   Δloss = loss_patched − loss_B.

Per head, the size of the replacement: ‖S_A − S_B‖_F / ‖S_B‖_F at the boundary (S_A after a tokens of A, S_B after
b tokens of B). With ``references``, every answer is scored with RULER's ``string_match_all``. The whole result is
memoised under :func:`patch_key` (model fingerprint, dtype, device type, both prompts, the resolved spec, the
continuation, ``VERSION``).
"""
from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd
import torch

from gdnviz import runner
from gdnviz.errors import EmptyDocument
from gdnviz.generate import greedy_generate
from gdnviz.patching.callback import PatchCallback
from gdnviz.patching.spec import PatchSpec, check_patch
from gdnviz.probes.memo import MemoStore
from gdnviz.store import content_hash

VERSION = 1  # of a patch comparison's computation: bump it to invalidate every stored one
RUNS = ("A", "B", "B patched")
COMPARISON_COLUMNS = ["run", "prompt_tokens", "answer", "n_generated", "score", "loss", "delta_loss",
                      "continuation_tokens"]


def _ids(x, what: str) -> list[int]:
    ids = [int(i) for i in torch.as_tensor(x, dtype=torch.long).reshape(-1).tolist()]
    if not ids:
        raise EmptyDocument(f"prompt {what} has no tokens")
    return ids


def _hash(ids) -> str:
    return hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()[:32]


def patch_key(info, a_ids, b_ids, spec: PatchSpec, heads, continuation) -> str:
    """Memo key (``"patch:<hash>"``) of one comparison: what its result depends on, and ``VERSION``."""
    d = dict(v=VERSION, fp=info.fingerprint, dtype=info.dtype, device=info.memo_device, a=_hash(a_ids),
             b=_hash(b_ids), heads=[list(h) for h in heads], boundary=spec.boundary, source=spec.source_position,
             L=spec.segment_len, new=spec.max_new_tokens,
             cont=None if continuation is None else _hash(continuation) if continuation else "empty")
    return "patch:" + content_hash(d)


def continuation_nll(lm, prompt_ids, continuation, *, segment_len: int = runner.DEFAULT_SEGMENT_LEN,
                     callbacks=()) -> np.ndarray:
    """[m] float64: −log p(c_j | prompt, c_<j) of the m continuation tokens, teacher-forced in one segmented run of
    prompt + continuation with ``callbacks``."""
    p, c = list(prompt_ids), list(continuation)
    ids = torch.tensor([p + c], dtype=torch.long)
    out = runner.forward(lm, ids, segment_len=segment_len, callbacks=callbacks, keep_hidden=False,
                         logits_positions=list(range(len(p) - 1, len(p) + len(c) - 1)))
    logp = torch.log_softmax(out.logits[0].double(), dim=-1).cpu()
    return (-logp[torch.arange(len(c)), torch.tensor(c)]).numpy()


def _score(text: str, refs) -> float | None:
    from gdnviz.probes import ruler

    return None if not refs else float(ruler.string_match_all([text], [list(refs)]))


def patch_prompts(lm, a_ids, b_ids, spec: PatchSpec, *, continuation=None, references=None, store=None,
                  progress=None) -> dict:
    """Compare B with and without ``spec``'s heads patched from A (module docstring); a JSON-able dict.

    a_ids / b_ids: token ids (lists or tensors, batch 1). continuation: token ids to score (None: B's unpatched
    greedy answer; its loss is None when that answer is empty). references: answers to score with
    ``string_match_all`` (or None). store: a memo (``MemoStore``: a path, a mapping or None). progress:
    ``fn(done, total, text)`` before each run. Raises what ``check_patch`` raises, EmptyDocument.
    Keys: heads, boundary, source, segment_len, max_new_tokens, prompt_tokens {A, B}, answers {A, B, B patched:
    {text, tokens}}, changed (the patched answer differs), scores, references, continuation {tokens, given},
    loss {B, B patched, delta, n, nll_B, nll_patched} or None, states [{layer, head, norm_A, norm_B, rel_change}],
    model, fingerprint, dtype, device, memo_key, version, memo_hit."""
    info = lm.info
    a, b = _ids(a_ids, "A"), _ids(b_ids, "B")
    heads = check_patch(spec, info, len(a), len(b))
    cont = None if continuation is None else [int(i) for i in continuation]
    memo = MemoStore(store)
    key = patch_key(info, a, b, spec, heads, cont)
    try:
        hit = memo.get(key)
        if hit is not None:
            return dict(hit, memo_hit=True)
        res = _compare(lm, a, b, spec, heads, cont, references, progress or (lambda *x: None))
        res.update(memo_key=key)
        memo.set(key, res)
    finally:
        memo.close()
    return dict(res, memo_hit=False)


def _compare(lm, a, b, spec: PatchSpec, heads, cont, references, progress) -> dict:
    info, L, new, pos_b, pos_a = lm.info, spec.segment_len, spec.max_new_tokens, spec.boundary, spec.source_position
    steps = 5
    progress(0, steps, f"A: generating, recording {len(heads)} head state(s) at token {pos_a}")
    rec_a = PatchCallback(info, heads, pos_a)
    g_a = greedy_generate(lm, a, new, segment_len=L, callbacks=[rec_a])
    progress(1, steps, "B unpatched: generating")
    rec_b = PatchCallback(info, heads, pos_b)
    g_b = greedy_generate(lm, b, new, segment_len=L, callbacks=[rec_b])
    donor, own = rec_a.seen, rec_b.seen
    if donor is None or own is None:  # check_patch put both boundaries inside their prompts
        raise RuntimeError(f"the runs did not reach boundary {pos_a} of A / {pos_b} of B in every chosen layer")
    progress(2, steps, f"B patched at token {pos_b}: generating")
    g_p = greedy_generate(lm, b, new, segment_len=L, callbacks=[PatchCallback(info, heads, pos_b, donor)])
    given = cont is not None
    c = cont if given else list(g_b.tokens)
    loss = None
    if c:
        progress(3, steps, f"loss on {len(c)} continuation token(s): B unpatched")
        nll_b = continuation_nll(lm, b, c, segment_len=L, callbacks=[PatchCallback(info, heads, pos_b)])
        progress(4, steps, f"loss on {len(c)} continuation token(s): B patched")
        nll_p = continuation_nll(lm, b, c, segment_len=L, callbacks=[PatchCallback(info, heads, pos_b, donor)])
        loss = {"B": float(nll_b.mean()), "B patched": float(nll_p.mean()),
                "delta": float(nll_p.mean() - nll_b.mean()), "n": len(c), "nll_B": nll_b.tolist(),
                "nll_patched": nll_p.tolist()}
    progress(steps, steps, "done")
    sa, sb = donor.states.double(), own.states.double()
    nb = sb.flatten(1).norm(dim=1)
    states = [dict(layer=l, head=h, norm_A=float(sa[i].norm()), norm_B=float(nb[i]),
                   rel_change=float((sa[i] - sb[i]).norm() / nb[i]) if nb[i] > 0 else None)
              for i, (l, h) in enumerate(heads)]
    gens = {"A": g_a, "B": g_b, "B patched": g_p}
    refs = list(references) if references else []
    return dict(
        heads=[list(h) for h in heads], boundary=pos_b, source=pos_a, segment_len=L, max_new_tokens=new,
        prompt_tokens={"A": len(a), "B": len(b)},
        answers={k: dict(text=g.text, tokens=list(g.tokens)) for k, g in gens.items()},
        changed=list(g_p.tokens) != list(g_b.tokens),
        scores={k: _score(g.text, refs) for k, g in gens.items()} if refs else {}, references=refs,
        continuation=dict(tokens=c, given=given), loss=loss, states=states, model=info.name,
        fingerprint=info.fingerprint, dtype=info.dtype, device=info.device, version=VERSION)


def comparison_table(result: dict) -> pd.DataFrame:
    """One row per run (A, B, B patched): prompt tokens, answer, tokens generated, score (NaN without references),
    mean continuation loss and its change vs B (nats / token; NaN for A, and without a continuation)."""
    loss = result.get("loss") or {}
    rows = []
    for run in RUNS:
        ans = result["answers"][run]
        prompt = result["prompt_tokens"]["A" if run == "A" else "B"]
        rows.append(dict(run=run, prompt_tokens=prompt, answer=ans["text"], n_generated=len(ans["tokens"]),
                         score=(result.get("scores") or {}).get(run, np.nan),
                         loss=loss.get(run, np.nan), delta_loss=(loss["delta"] if run == "B patched" else 0.0)
                         if loss else np.nan, continuation_tokens=loss.get("n", 0) if run != "A" else 0))
    t = pd.DataFrame(rows, columns=COMPARISON_COLUMNS)
    t.loc[t["run"] == "A", "delta_loss"] = np.nan
    return t


def states_table(result: dict) -> pd.DataFrame:
    """One row per patched head: layer, head, ‖S_A‖_F, ‖S_B‖_F, ‖S_A − S_B‖_F / ‖S_B‖_F at the boundary."""
    return pd.DataFrame(result["states"], columns=["layer", "head", "norm_A", "norm_B", "rel_change"])


