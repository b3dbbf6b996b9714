"""A RULER needle prompt and its needle-free twin, for carrying a needle-bearing state into a haystack without it.

``needle_pair`` builds A = a RULER sample of a noise-haystack NIAH task (``niah_single_1``; ``gdnviz.probes.ruler``)
and B = the same prompt with every needle line replaced by the haystack's noise line (same lines, same question,
a few tokens shorter or longer), and finds, in tokens, where each prompt's question starts and where A's needle
lies (half-open token ranges, from the fast tokenizer's character offsets).
"""
from __future__ import annotations

from dataclasses import dataclass

from gdnviz.errors import UnknownTask
from gdnviz.probes import ruler


@dataclass(frozen=True)
class NeedlePair:
    """a: the RULER sample (its ``answers`` are the needle values); b_prompt / b_ids: the twin without needles;
    a_question / b_question: the first token of each prompt's question (the tokens before it are the instructions
    and the haystack); needles: [(start, end)] token ranges of A's needle lines."""

    a: ruler.Sample
    b_prompt: str
    b_ids: list
    a_question: int
    b_question: int
    needles: tuple


def _is_needle(line: str) -> bool:
    return line.startswith("One of the special magic ")


def _token_at(offsets, char: int) -> int:
    """Index of the first token ending after character ``char``."""
    return next((i for i, (_, e) in enumerate(offsets) if e > char), len(offsets))


def _encode(tokenizer, text: str, chat: bool):
    enc = tokenizer(text, add_special_tokens=not chat, return_offsets_mapping=True, verbose=False)
    return list(enc["input_ids"]), list(enc["offset_mapping"])


def _question_char(text: str) -> int:
    """Character index where the question starts: the line after the last haystack line."""
    lines, pos, end = text.split("\n"), 0, None
    for line in lines:
        if line == ruler.NOISE or _is_needle(line):
            end = pos + len(line) + 1
        pos += len(line) + 1
    if end is None:
        raise ValueError("no haystack line found in the prompt")
    return end


def needle_pair(tokenizer, target_len: int, seed: int, task: str = "niah_single_1", *,
                chat_template="auto") -> NeedlePair:
    """The pair for ``task`` (a noise-haystack NIAH task; UnknownTask otherwise) at ``target_len`` tokens and
    ``seed`` (as ``ruler.generate``)."""
    spec = ruler.TASKS.get(task) if isinstance(task, str) else None
    if spec is None or spec.get("family") != "niah" or spec.get("type_haystack") != "noise":
        noise = [t for t, s in ruler.TASKS.items() if s.get("family") == "niah" and s.get("type_haystack") == "noise"]
        raise UnknownTask(f"needle pairs need a NIAH task with a noise haystack ({', '.join(noise)}); got {task!r}")
    a = ruler.generate(task, tokenizer, int(target_len), int(seed), chat_template=chat_template)
    lines = a.prompt.split("\n")
    b_prompt = "\n".join(ruler.NOISE if _is_needle(l) else l for l in lines)
    a_ids, a_off = _encode(tokenizer, a.prompt, a.chat)
    b_ids, b_off = _encode(tokenizer, b_prompt, a.chat)
    if a_ids != list(a.input_ids):
        raise ValueError("the tokenizer does not reproduce the sample's tokens with offsets")
    needles, pos = [], 0
    for line in lines:
        if _is_needle(line):
            needles.append((_token_at(a_off, pos), _token_at(a_off, pos + len(line) - 1) + 1))
        pos += len(line) + 1
    return NeedlePair(a=a, b_prompt=b_prompt, b_ids=b_ids, a_question=_token_at(a_off, _question_char(a.prompt)),
                      b_question=_token_at(b_off, _question_char(b_prompt)), needles=tuple(needles))


def continuation_ids(tokenizer, text: str) -> list:
    """The token ids of a continuation text as it follows a prompt (no special tokens)."""
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def pair_inputs(pair: NeedlePair, tokenizer, segment_len: int) -> dict:
    """What ``patch_prompts`` needs for a needle pair: a_ids, b_ids, boundary (the last boundary before B's
    question), continuation (" " + the first needle value: the answer after the answer prefix), references, and
    meta (question and needle positions, for the record)."""
    from gdnviz.patching.spec import last_boundary

    return dict(a_ids=list(pair.a.input_ids), b_ids=list(pair.b_ids),
                boundary=last_boundary(pair.b_question, segment_len),
                continuation=continuation_ids(tokenizer, " " + pair.a.answers[0]), references=list(pair.a.answers),
                meta=dict(task=pair.a.task, seed=pair.a.seed, a_question=pair.a_question,
                          b_question=pair.b_question, needles=[list(n) for n in pair.needles]))
