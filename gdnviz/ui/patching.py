"""The State patching page's logic (pure: no Streamlit): validate what the page asks for against the inspected
model, build the job spec, shape the result into the tables the page shows and exports."""
from __future__ import annotations

import pandas as pd

#: Where the patched prompts come from: a RULER needle pair, or two typed prompts.
SOURCES = {"needle": "a needle prompt and its needle-free twin (niah_single_1)", "texts": "two prompts I type"}


def check_heads(text: str, info: dict) -> list:
    """(layer, head) pairs of a head-set text ("all", "5:1", "layers:4,5"); the library's errors (LayerNotGDN,
    HeadOutOfRange, EmptyHeadSet, ValueError) for bad input."""
    from types import SimpleNamespace

    from gdnviz.patching import resolve_patch_heads

    ns = SimpleNamespace(**{**info, "gdn_layers": tuple(info["gdn_layers"]),
                            "attn_layers": tuple(info.get("attn_layers") or ()), "name": info.get("name", "the model")})
    return resolve_patch_heads(text, ns)


def check_position(value: int, L: int, what: str) -> None:
    """0 (the default) or a positive multiple of L; ValueError naming ``what`` otherwise."""
    if value and (value < 0 or value % L):
        raise ValueError(f"{what} {value} is not a boundary: give a positive multiple of L = {L}, or 0 for the "
                         "default")


def job_dict(model: str, device: str, dtype: str, info: dict, *, source: str, heads: str, L: int, boundary: int,
             from_a: int, max_new_tokens: int, continuation: str, target_len: int = 1024, seed: int = 0,
             prompt_a: str = "", prompt_b: str = "", trust_remote_code: bool = False) -> dict:
    """The ``PatchJob`` (as the queue's dict) of the page's settings."""
    from gdnviz.jobs import PatchJob, spec_to_dict

    kw = dict(task="niah_single_1", target_len=int(target_len), seed=int(seed)) if source == "needle" else \
        dict(prompt_a=prompt_a, prompt_b=prompt_b)
    return spec_to_dict(PatchJob(model=model, device=device, dtype=dtype, trust_remote_code=trust_remote_code,
                                 heads=heads.strip() or "all",
                                 boundary=int(boundary), source=int(from_a), continuation=continuation,
                                 max_new_tokens=int(max_new_tokens), segment_len=int(L),
                                 fingerprint=str(info.get("fingerprint") or ""), **kw))


def comparison_frame(result: dict) -> pd.DataFrame:
    """The comparison table (``gdnviz.patching.comparison_table``): one row per run, as the CSV export."""
    from gdnviz.patching import comparison_table

    return comparison_table(result)


def states_frame(result: dict) -> pd.DataFrame:
    from gdnviz.patching import states_table

    return states_table(result)


def verdict(result: dict) -> str:
    """One line: did the patched B answer differently, and (with references) did it now answer correctly."""
    sc = result.get("scores") or {}
    changed = "changed" if result["changed"] else "did not change"
    if sc:
        return (f"The patched B's answer {changed}: score A {sc['A']:.0f}, B {sc['B']:.0f}, B patched "
                f"{sc['B patched']:.0f} (RULER string_match_all, %).")
    return f"The patched B's answer {changed}."


def settings_line(result: dict) -> str:
    heads = result["heads"]
    which = ", ".join(f"{l}:{h}" for l, h in heads[:8]) + (f" … ({len(heads)} heads)" if len(heads) > 8 else "")
    return (f"heads **{which}** · B's boundary **{result['boundary']:,}** ← A's **{result['source']:,}** (tokens "
            f"consumed) · L = {result['segment_len']} · A {result['prompt_tokens']['A']:,} tokens, B "
            f"{result['prompt_tokens']['B']:,} · {result['dtype']} on {result['device']}"
            + (" · from the memo" if result.get("memo_hit") else ""))


def job_tokens(tok, source: str, *, max_new_tokens: int, continuation: str = "", target_len: int = 1024,
               prompt_a: str = "", prompt_b: str = "") -> int | None:
    """About the tokens a patch job runs through the model, as ``gdnviz.jobs.patch_tokens`` counts them after it
    ran: A's prompt and B's twice with up to ``max_new_tokens`` for each of the 3 answers, then B and the
    continuation twice (its length: the typed ``continuation``'s tokens, else up to ``max_new_tokens``). A needle
    pair's prompts: ``target_len`` less the task's tokens to generate (the prompt's target); typed prompts are
    counted with ``tok`` (a ``tokenizers.Tokenizer``); None without one."""
    from gdnviz.documents import tokenize

    if continuation and tok is None:
        return None
    new = int(max_new_tokens)
    cont = len(tokenize(tok, continuation)) if continuation else new
    if source == "needle":
        from gdnviz.probes import ruler

        a = b = max(int(target_len) - int(ruler.TASKS["niah_single_1"]["tokens_to_generate"]), 0)
    elif tok is None:
        return None
    else:
        a, b = len(tokenize(tok, prompt_a)), len(tokenize(tok, prompt_b))
    return a + 2 * b + 3 * new + 2 * (b + cont)


def run_text(max_new_tokens: int) -> str:
    """What one patch job runs (``gdnviz.patching.patch_prompts``): three greedy generations and up to two loss
    passes, on one pair of prompts."""
    return (f"One pair of prompts (n = 1): 3 greedy generations (A, B unpatched, B patched), each a prefill of its "
            f"prompt and up to {int(max_new_tokens)} new tokens, then 2 loss passes over B and the scored "
            "continuation (unpatched, patched): **5 passes over a prompt**, none when this exact patch is in the "
            "memo. One pair shows what can happen, not how often: it is an anecdote, not an effect size.")
