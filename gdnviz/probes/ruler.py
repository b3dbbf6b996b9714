"""RULER-style synthetic tasks, generated offline, and RULER's scoring (NVIDIA/RULER, seed 000 §3).

Six tasks need no downloaded data (word lists come from the installed ``wonderwords`` package):

- ``niah_single_1``: noise lines + 1 needle (adjective-noun key, 7-digit value); generates 128 tokens
- ``niah_multikey_2``: every haystack line a distractor needle (word keys) + 1 needle; 128
- ``niah_multikey_3``: the same with uuid keys and values; 128
- ``vt``: noise lines + 1 chain of 4 hops (5 variables), after RULER's randomised one-shot demo; 30
- ``cwe``: numbered word list, the 10 most common words, after one demo; 120
- ``fwe``: Zipf(α=2) coded words with '...' as the top word, the next 3 words; 50

All six are scored with ``string_match_all``.

Templates, answer prefixes, needles and haystacks are RULER's verbatim (``scripts/data/synthetic/constants.py``,
``niah.py``, ``variable_tracking.py``, ``common_words_extraction.py``, ``freq_words_extraction.py``), including
the NIAH singular rewrite ("A special magic number is hidden ...") when one value is asked for.

``generate(task, tokenizer, target_len, seed)`` sizes a sample the way RULER does: a binary search over the
haystack size (niah lines, vt noise lines, cwe words; fwe grows its word count linearly, as RULER's does) so that
``n_tokens + tokens_to_generate <= target_len``, where ``n_tokens`` counts the full prompt as the model receives
it: chat template (``apply_chat_template``, one user message, generation prompt) and answer prefix included, plus
the tokenizer's own special tokens (BOS) on the plain path. The prompt ends with the answer prefix; the model
continues from it.

Randomness: only local ``random.Random`` objects. Every rendering of a haystack size starts again from
``random.Random(seed)``, so a sample is a function of (task, seed, haystack size, target regime) alone and the
same (task, tokenizer, target_len, seed) gives the identical prompt in every process.

Scoring is RULER's: ``postprocess`` (evaluate.py), then ``string_match_all`` (fraction of references found,
case-insensitive substring, averaged, ×100, 2 decimals) for every task here and ``string_match_part`` (any
reference) for RULER's qa tasks.

Deviations from RULER, all either forced by running offline or guarding against a degenerate sample:

- RULER draws from the global ``random``/``numpy`` state, so its probes consume the stream and samples depend on
  the tokenizer; here each rendering restarts from ``Random(seed)`` (numpy's ``randint(10000, 99999)`` becomes
  ``randint(10000, 99998)``, same range; RULER's fixed ``Random(42).shuffle`` calls use the sample's seed).
  RULER's datasets are therefore not reproduced byte for byte; the generators' logic and text are.
- ``n_tokens`` also counts the special tokens the tokenizer adds on the plain path (e.g. a BOS), which RULER's
  ``text_to_tokens`` leaves out, so a plain prompt can be a token shorter than RULER's at the same target.
- NIAH word keys: a uniform draw over (unique adjective, unique noun), which is exactly RULER's uniform choice
  over ``sorted(set(f"{adj}-{noun}"))`` (no two pairs collide) without building the 6.2M-entry list. A distractor
  needle never reuses a real needle's key (RULER allows it, making the answer ambiguous with tiny probability).
- NIAH singular rewrite: applied to RULER's task template and answer prefix only, not to the chat wrapper (RULER
  also rewrites the wrapper's text, e.g. a system prompt's "are" -> "is").
- vt: variable names are drawn without replacement and never "VAR"; the demo's names are swapped by whole-word
  replacement with fresh names distinct from the old ones (RULER's ``str.replace`` can, rarely, cross-rewrite).
- cwe: the word pool is wonderwords' 8,166 distinct nouns+adjectives+verbs; RULER's fallback
  ``english_words.json`` is not available offline, so the word count is capped at the pool size and cwe prompts
  underfill targets beyond roughly 110K tokens.
- Kept as RULER does it, though odd: cwe's demo is formatted with the whole model template (chat wrapper and
  answer prefix) followed by its answer and a newline, then the real, again wrapped, prompt; vt's demo sits
  inside the user message, before the task text, and counts towards the length.
- Sizes that cannot fit raise ``TaskTooShort`` with the minimum instead of RULER's endless retry loop; fwe also
  requires its three answers to be strictly more frequent than the fourth coded word.
- The binary search's lower bound is the task's smallest valid haystack (1 niah line, 5 vt noise lines, 10 cwe
  words) instead of RULER's first increment; where RULER's answer is at least one increment, the result is the
  same.
"""
from __future__ import annotations

import copy
import math
import random
import re
import string
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from importlib.resources import files
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from gdnviz.errors import TaskTooShort, UnknownTask

__all__ = ["TASKS", "TASK_NAMES", "METRICS", "Sample", "generate", "generate_many", "smallest_fit", "sizing_class",
           "string_match_all", "string_match_part", "postprocess", "score", "score_samples"]

# --- RULER's text, verbatim ---------------------------------------------------------------------------------------
NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?")
NIAH_ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NIAH_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above.")
VT_ANSWER_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
                    "are assigned the value {query}, they are: ")

CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
    "that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?")
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"

FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?")
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"

QA_TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other "
    "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
    "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}")
QA_ANSWER_PREFIX = " Answer:"

ZETA_2 = math.pi ** 2 / 6  # scipy.special.zeta(2.0), to the last bit
CWE_POOL_SEED = 42  # RULER shuffles the cwe pool once with its --random_seed (42)
VT_ICL_SEED = 42  # RULER builds its one vt demo once, from the global state seeded with 42
VT_ICL_MAX_LEN = 500


_NIAH = dict(family="niah", template=NIAH_TEMPLATE, answer_prefix=NIAH_ANSWER_PREFIX, tokens_to_generate=128,
             metric="string_match_all", num_needle_k=1, num_needle_v=1, num_needle_q=1)
# Each generated task's metadata: RULER's template and answer prefix (before the NIAH singular rewrite),
# tokens_to_generate, metric, and the generator's settings (RULER's scripts/synthetic.yaml).
TASKS: dict[str, dict[str, Any]] = {
    "niah_single_1": dict(**_NIAH, type_haystack="noise", type_needle_k="words", type_needle_v="numbers",
                          description="one needle (adjective-noun key, 7-digit value) in repeated noise"),
    "niah_multikey_2": dict(**_NIAH, type_haystack="needle", type_needle_k="words", type_needle_v="numbers",
                            description="one needle among distractor needles with word keys"),
    "niah_multikey_3": dict(**_NIAH, type_haystack="needle", type_needle_k="uuids", type_needle_v="uuids",
                            description="one needle among distractor needles, uuid keys and values"),
    "vt": dict(family="variable_tracking", template=VT_TEMPLATE, answer_prefix=VT_ANSWER_PREFIX,
               tokens_to_generate=30, metric="string_match_all", type_haystack="noise", num_chains=1, num_hops=4,
               description="one chain of 4 variable re-assignments in noise, one-shot demo"),
    "cwe": dict(family="common_words_extraction", template=CWE_TEMPLATE, answer_prefix=CWE_ANSWER_PREFIX,
                tokens_to_generate=120, metric="string_match_all", freq_cw=30, freq_ucw=3, num_cw=10,
                num_fewshot=1, description="the 10 most common words of a numbered list, one demo"),
    "fwe": dict(family="freq_words_extraction", template=FWE_TEMPLATE, answer_prefix=FWE_ANSWER_PREFIX,
                tokens_to_generate=50, metric="string_match_all", alpha=2.0, coded_wordlen=6,
                description="the 3 most frequent coded words of a Zipf(2) text"),
}
TASK_NAMES: tuple[str, ...] = tuple(TASKS)
# RULER's metric per task, including the qa tasks, which are scored here but not generated.
METRICS: dict[str, str] = {**{t: s["metric"] for t, s in TASKS.items()},
                           "qa_1": "string_match_part", "qa_2": "string_match_part"}
# What generation and scoring read: private copies, so editing TASKS / METRICS cannot change a sample.
_SPECS: dict[str, dict[str, Any]] = copy.deepcopy(TASKS)
_METRICS: dict[str, str] = dict(METRICS)


def _unknown(task: object, known: Sequence[str]) -> UnknownTask:
    return UnknownTask(f"Unknown RULER task {task!r}. Known tasks: {', '.join(known)}.")


def _spec(task: str) -> Mapping[str, Any]:
    if not isinstance(task, str) or task not in _SPECS:
        raise _unknown(task, TASK_NAMES)
    return _SPECS[task]


# --- word lists ---------------------------------------------------------------------------------------------------
def _wonderwords(name: str) -> list[str]:
    """One of wonderwords' bundled lists, read like its private ``_get_words_from_text_file`` (line, rstrip)."""
    text = files("wonderwords.assets").joinpath(name).read_text(encoding="utf-8")
    return [w.rstrip() for w in text.splitlines()]


@lru_cache(maxsize=None)
def _niah_key_parts() -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (tuple(sorted(set(_wonderwords("adjectivelist.txt")))),
            tuple(sorted(set(_wonderwords("nounlist.txt")))))


@lru_cache(maxsize=None)
def _cwe_pool() -> tuple[str, ...]:
    words = sorted(set(_wonderwords("nounlist.txt") + _wonderwords("adjectivelist.txt")
                       + _wonderwords("verblist.txt")))
    random.Random(CWE_POOL_SEED).shuffle(words)
    return tuple(words)


# --- the sample ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sample:
    """One generated prompt and its references.

    ``prompt`` is the full text the model sees (chat wrapper included) and ends with ``answer_prefix``;
    ``input_ids`` is its tokenization as fed to the model (``n_tokens == len(input_ids)``); ``answers`` are the
    references for ``score``. ``haystack_size`` counts the task's sizing unit (niah: haystack lines, vt: noise
    lines, cwe: distinct words, fwe: coded words before Zipf rounding). ``n_tokens + tokens_to_generate <=
    target_len``.
    """
    task: str
    seed: int
    target_len: int
    prompt: str
    input_ids: list[int] = field(repr=False)
    answers: list[str]
    n_tokens: int
    tokens_to_generate: int
    haystack_size: int
    answer_prefix: str = ""
    chat: bool = False

    @property
    def length(self) -> int:
        """RULER's ``length``: prompt tokens + tokens to generate."""
        return self.n_tokens + self.tokens_to_generate


# --- rendering ----------------------------------------------------------------------------------------------------
def _random_value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10 ** 6, 10 ** 7 - 1))
    if kind == "words":
        adjs, nouns = _niah_key_parts()
        i = rng.randrange(len(adjs) * len(nouns))
        return f"{adjs[i // len(nouns)]}-{nouns[i % len(nouns)]}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"needle type {kind!r}")


def _niah_singular(text: str) -> str:
    text = text.replace("Some", "A")
    text = text.replace("are all", "is")
    text = text.replace("are", "is")
    return text.replace("answers", "answer")


class _Job:
    """Everything one (task, tokenizer, target, chat) sizing needs; renders a prompt for a haystack size."""

    def __init__(self, task: str, tokenizer, target_len: int, seed: int, chat: bool,
                 chat_kwargs: Mapping[str, Any] | None):
        self.task, self.spec = task, _spec(task)
        self.family = self.spec["family"]
        self.tok, self.target, self.seed = tokenizer, target_len, seed
        self.chat, self.chat_kwargs = chat, dict(chat_kwargs or {})
        self.ttg = int(self.spec["tokens_to_generate"])
        self._icl: str | None = None

    # tokens and wrapping
    def encode(self, text: str) -> list[int]:
        """Token ids of the full prompt as the model receives it (the chat text already holds its specials)."""
        return list(self.tok(text, add_special_tokens=not self.chat, verbose=False)["input_ids"])

    def count_fragment(self, text: str) -> int:
        """RULER's ``text_to_tokens``: no special tokens (used for the vt demo, a piece of a prompt)."""
        return len(self.tok(text, add_special_tokens=False, verbose=False)["input_ids"])

    def wrap(self, text: str) -> str:
        if not self.chat:
            return text  # RULER's 'base' model template: "{task_template}"
        return self.tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=False, **self.chat_kwargs)

    # sizing constants (RULER's)
    @property
    def increment(self) -> int:
        if self.family == "freq_words_extraction":
            return max(1, (self.target - self.ttg) // 32)
        if self.family == "common_words_extraction":
            return 10
        if self.family == "niah":
            return 5 if self.target < 4096 else 25
        return 5 if self.target < 4096 else 10  # vt, noise haystack

    @property
    def min_units(self) -> int:
        if self.family == "niah":
            return self.spec["num_needle_k"] * self.spec["num_needle_v"]
        if self.family == "variable_tracking":
            return self.spec["num_chains"] * (self.spec["num_hops"] + 1)
        if self.family == "common_words_extraction":
            return self.spec["num_cw"]
        return 1

    # rendering: (prompt, answer_prefix, answers)
    def render(self, n: int, seed: int | None = None, *, vocab_size: int | None = None) -> tuple[str, str, list[str]]:
        seed = self.seed if seed is None else seed
        if self.family == "niah":
            return self._niah(n, seed)
        if self.family == "variable_tracking":
            return self._vt(n, seed)
        if self.family == "common_words_extraction":
            return self._cwe(n, seed)
        return self._fwe(n, seed, vocab_size)

    def _niah(self, n: int, seed: int) -> tuple[str, str, list[str]]:
        s, rng = self.spec, random.Random(seed)
        kt, vt = s["type_needle_k"], s["type_needle_v"]
        keys, values, needles = [], [], []
        for _ in range(s["num_needle_k"]):
            keys.append(_random_value(rng, kt))
            value = []
            for _ in range(s["num_needle_v"]):
                value.append(_random_value(rng, vt))
                needles.append(NIAH_NEEDLE.format(type_needle_v=vt, key=keys[-1], value=value[-1]))
            values.append(value)
        random.Random(seed).shuffle(needles)
        if s["type_haystack"] == "noise":
            sentences = [NOISE] * n
        else:  # 'needle': every line a distractor needle with a fresh key and value
            sentences, taken = [], set(keys)
            for _ in range(n):
                key = _random_value(rng, kt)
                while key in taken:
                    key = _random_value(rng, kt)
                sentences.append(NIAH_NEEDLE.format(type_needle_v=vt, key=key, value=_random_value(rng, vt)))
        for index, element in zip(sorted(rng.sample(range(n), len(needles)), reverse=True), needles):
            sentences.insert(index, element)
        context = "\n".join(sentences)
        indices = rng.sample(range(s["num_needle_k"]), s["num_needle_q"])
        queries = [keys[i] for i in indices]
        answers = [a for i in indices for a in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        template, prefix, type_v = s["template"], s["answer_prefix"], vt
        if s["num_needle_q"] * s["num_needle_v"] == 1:
            template, prefix, type_v = _niah_singular(template), _niah_singular(prefix), vt[:-1]
        text = template.format(type_needle_v=type_v, context=context, query=query)
        prefix = prefix.format(type_needle_v=type_v, query=query)
        return self.wrap(text) + prefix, prefix, answers

    # vt
    def _vt_text(self, rng: random.Random, n: int, is_icl: bool) -> tuple[str, str, list[str]]:
        s = self.spec
        k = 3 if is_icl else 5
        hops = min(10, s["num_hops"]) if is_icl else s["num_hops"]
        names: list[str] = []
        while len(names) < (hops + 1) * s["num_chains"]:
            name = "".join(rng.choices(string.ascii_uppercase, k=k))
            if name not in names and name != "VAR":
                names.append(name)
        chains, variables = [], []
        for i in range(s["num_chains"]):
            these = names[i * (hops + 1):(i + 1) * (hops + 1)]
            variables.append(these)
            value = "12345" if is_icl else str(rng.randint(10000, 99998))
            chains.append([f"VAR {these[0]} = {value}"]
                          + [f"VAR {these[j + 1]} = VAR {these[j]} " for j in range(hops)])
        value = chains[0][0].split("=")[-1].strip()
        sentences = [NOISE] * n
        for chain in chains:
            positions = sorted(rng.sample(range(len(sentences)), len(chain)))
            for j, pos in enumerate(positions):
                sentences.insert(pos + j, chain[j])
        context = "\n".join(sentences).replace(". \n", ".\n")
        text = VT_TEMPLATE.format(context=context, query=value, num_v=hops + 1)
        prefix = VT_ANSWER_PREFIX.format(query=value, num_v=hops + 1)
        return text, prefix, variables[0]

    def _vt_icl(self) -> str:
        """RULER's one-shot demo: 3-letter names, value 12345, no chat wrapper, sized to 500 tokens (binary search,
        increment 5, nothing to generate); ``input + " " + names + "\\n"``."""
        if self._icl is None:
            def build(n: int) -> str:
                text, prefix, names = self._vt_text(random.Random(VT_ICL_SEED), n, is_icl=True)
                return text + prefix + " " + " ".join(names) + "\n"

            inc = 5
            lo = self.min_units
            tph = self.count_fragment(build(inc)) / inc
            hi = max(int(VT_ICL_MAX_LEN / tph * 3), inc * 2)
            best = lo  # RULER falls back to the increment; a demo never has to fit the target on its own
            while lo <= hi:
                mid = (lo + hi) // 2
                if self.count_fragment(build(mid)) <= VT_ICL_MAX_LEN:
                    best, lo = mid, mid + 1
                else:
                    hi = mid - 1
            self._icl = build(best)
        return self._icl

    def _vt(self, n: int, seed: int) -> tuple[str, str, list[str]]:
        rng = random.Random(seed)
        text, prefix, answers = self._vt_text(rng, n, is_icl=False)
        demo = _randomize_icl(self._vt_icl(), rng, self.spec["num_hops"])
        # RULER inserts the demo + "\n" right before the task template, inside the model template
        return self.wrap(demo + "\n" + text) + prefix, prefix, answers

    # cwe
    def _cwe_example(self, rng: random.Random, seed: int, num_words: int, common_repeats: int,
                     uncommon_repeats: int, common_nums: int) -> tuple[str, list[str]]:
        word_list_full = rng.sample(_cwe_pool(), num_words)
        common, uncommon = word_list_full[:common_nums], word_list_full[common_nums:]
        word_list = common * common_repeats + uncommon * uncommon_repeats
        random.Random(seed).shuffle(word_list)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(word_list)), common

    def _cwe(self, n: int, seed: int) -> tuple[str, str, list[str]]:
        s, rng = self.spec, random.Random(seed)
        if self.target < 4096:
            demos = [self._cwe_example(rng, seed, 20, 3, 1, s["num_cw"]) for _ in range(s["num_fewshot"])]
            context, answer = self._cwe_example(rng, seed, n, 6, 1, s["num_cw"])
        else:
            demos = [self._cwe_example(rng, seed, 40, 10, 3, s["num_cw"]) for _ in range(s["num_fewshot"])]
            context, answer = self._cwe_example(rng, seed, n, s["freq_cw"], s["freq_ucw"], s["num_cw"])
        # RULER formats each demo with the whole template (model wrapper + answer prefix), then its answer
        shots = [self.wrap(CWE_TEMPLATE.format(context=c)) + CWE_ANSWER_PREFIX + " "
                 + " ".join(f"{i + 1}. {w}" for i, w in enumerate(a)) for c, a in demos]
        prompt = "\n".join(shots) + "\n" + self.wrap(CWE_TEMPLATE.format(context=context)) + CWE_ANSWER_PREFIX
        return prompt, CWE_ANSWER_PREFIX, answer

    # fwe
    @property
    def fwe_vocab_size(self) -> int:
        return (self.target - self.ttg) // 50

    def _fwe_counts(self, n: int, vocab_size: int) -> np.ndarray:
        k = np.arange(1, vocab_size + 1)
        return (n * (k ** -float(self.spec["alpha"])) / ZETA_2).astype(int)

    def _fwe(self, n: int, seed: int, vocab_size: int | None) -> tuple[str, str, list[str]]:
        size = self.fwe_vocab_size if vocab_size is None else vocab_size
        rng = random.Random(seed)
        wl = self.spec["coded_wordlen"]
        vocab = ["".join(rng.choices(string.ascii_lowercase, k=wl)) for _ in range(size)]
        while len(set(vocab)) < size:
            vocab.append("".join(rng.choices(string.ascii_lowercase, k=wl)))
        vocab = sorted(set(vocab))
        random.Random(seed).shuffle(vocab)
        vocab[0] = "..."  # the top-ranked word is noise
        words = [w for w, c in zip(vocab, self._fwe_counts(n, len(vocab))) for _ in range(int(c))]
        random.Random(seed).shuffle(words)
        return (self.wrap(FWE_TEMPLATE.format(context=" ".join(words))) + FWE_ANSWER_PREFIX, FWE_ANSWER_PREFIX,
                vocab[1:4])

    def fwe_valid(self, n: int, vocab_size: int | None = None) -> bool:
        size = self.fwe_vocab_size if vocab_size is None else vocab_size
        if size < 4:
            return False
        c = self._fwe_counts(n, size)
        return bool(c[3] >= 1 and (size == 4 or c[3] > c[4]))


def _randomize_icl(icl: str, rng: random.Random, num_hops: int) -> str:
    """RULER's ``randomize_icl``: fresh same-length names for the demo's answer names, a fresh value for 12345."""
    old = icl.strip().split()[-(num_hops + 1):]
    new: list[str] = []
    for item in old:
        name = "".join(rng.choices(string.ascii_uppercase, k=len(item)))
        while name in new or name in old or name == "VAR":
            name = "".join(rng.choices(string.ascii_uppercase, k=len(item)))
        new.append(name)
    mapping = dict(zip(old, new))
    icl = re.sub(r"\b(" + "|".join(map(re.escape, old)) + r")\b", lambda m: mapping[m.group(0)], icl)
    return icl.replace("12345", str(rng.randint(10000, 99998)))


# --- sizing -------------------------------------------------------------------------------------------------------
@dataclass
class _Fit:
    size: int
    prompt: str
    answer_prefix: str
    answers: list[str]
    ids: list[int]


def _too_short(job: _Job, minimum: int, detail: str) -> TaskTooShort:
    err = TaskTooShort(
        f"{job.task} needs a target length of at least {minimum} tokens with this tokenizer ({detail} and "
        f"{job.ttg} tokens to generate); got target_len={job.target}. Raise the target length.")
    err.task, err.minimum, err.target_len = job.task, minimum, job.target
    return err


def _try(job: _Job, n: int, seed: int | None = None, cache: dict | None = None) -> _Fit:
    if cache is not None and n in cache:
        return cache[n]
    prompt, prefix, answers = job.render(n, seed)
    fit = _Fit(n, prompt, prefix, answers, job.encode(prompt))
    if cache is not None:
        cache[n] = fit
    return fit


def _fits(job: _Job, fit: _Fit, max_len: int | None = None) -> bool:
    limit = job.target - job.ttg if max_len is None else max_len
    return len(fit.ids) <= limit


def _fit_binary(job: _Job) -> _Fit:
    """RULER's binary search (56ea4ef): upper bound from the tokens of one increment, ×3 (cwe: from 4096 words,
    ×2), keep the largest size whose prompt + tokens_to_generate fits."""
    cache: dict[int, _Fit] = {}
    inc, lo = job.increment, job.min_units
    cap = len(_cwe_pool()) if job.family == "common_words_extraction" else None
    if cap is None:
        tph = len(_try(job, inc, cache=cache).ids) / inc
        hi = max(int(job.target / tph * 3), inc * 2)
    else:
        tpw = len(_try(job, 4096).ids) / 4096
        hi = min(max(int(job.target // tpw) * 2, inc * 2), cap)
    best: _Fit | None = None
    while True:
        top = hi
        while lo <= hi:
            mid = (lo + hi) // 2
            fit = _try(job, mid, cache=cache)
            if _fits(job, fit):
                best, lo = fit, mid + 1
            else:
                hi = mid - 1
        if best is None or best.size < top or (cap is not None and top >= cap):
            break
        lo, hi = top + 1, top * 2 if cap is None else min(top * 2, cap)  # the estimate was short: widen
    if best is None:
        minimum = len(_try(job, job.min_units, cache=cache).ids) + job.ttg
        unit = {"niah": "haystack line", "variable_tracking": "noise lines",
                "common_words_extraction": "words"}[job.family]
        raise _too_short(job, minimum, f"the template, {job.min_units} {unit}"
                         + (", the one-shot demo" if job.family != "niah" else ""))
    return best


def _fit_fwe(job: _Job) -> _Fit | None:
    """RULER's fwe sizing: start at max_len // 6 words, add max_len // 32 while the prompt is shorter than
    max_len = target - tokens_to_generate, step back once, then step back while too long."""
    max_len = job.target - job.ttg
    if job.fwe_vocab_size < 4:
        return None
    inc = job.increment
    n = max(1, max_len // 6)
    cache: dict[int, _Fit] = {}
    while len(_try(job, n, cache=cache).ids) < max_len:
        n += inc
    n -= inc
    while n > 0 and len(_try(job, n, cache=cache).ids) > max_len:
        n -= inc
    if n <= 0 or not job.fwe_valid(n):
        return None
    return _try(job, n, cache=cache)


def _fwe_minimum(job: _Job) -> int:
    """Smallest target length at which fwe sizing succeeds (scan; only run to word an error)."""
    def ok(length: int) -> bool:
        return _fit_fwe(_Job(job.task, job.tok, length, job.seed, job.chat, job.chat_kwargs)) is not None

    length = max(job.target + 1, job.ttg + 4 * 50)
    step = 16
    while not ok(length):
        length += step
        step = min(step * 2, 4096)
    lo = max(job.target + 1, length - step)
    for cand in range(lo, length):  # refine (fwe's fill is not monotone in the target, so scan, not bisect)
        if ok(cand):
            return cand
    return length


def _use_chat(tokenizer, chat_template) -> bool:
    if chat_template is None or chat_template is False:
        return False
    if chat_template is True or chat_template == "auto":
        return bool(getattr(tokenizer, "chat_template", None))
    raise ValueError(f"chat_template must be 'auto', True or False, not {chat_template!r}")


def _check(task: str, target_len: int, seed: int) -> None:
    _spec(task)
    if isinstance(target_len, bool) or not isinstance(target_len, (int, np.integer)):
        raise TypeError(f"target_len must be an int, not {type(target_len).__name__}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int, not {type(seed).__name__}")


def _sample(job: _Job, fit: _Fit, seed: int) -> Sample:
    return Sample(task=job.task, seed=int(seed), target_len=job.target, prompt=fit.prompt, input_ids=fit.ids,
                  answers=list(fit.answers), n_tokens=len(fit.ids), tokens_to_generate=job.ttg,
                  haystack_size=fit.size, answer_prefix=fit.answer_prefix, chat=job.chat)


def _fit(job: _Job) -> _Fit:
    if job.family == "freq_words_extraction":
        fit = _fit_fwe(job)
        if fit is None:
            raise _too_short(job, _fwe_minimum(job), "the template, a Zipf text whose top 3 words are distinct")
        return fit
    return _fit_binary(job)


# --- public generation --------------------------------------------------------------------------------------------
def generate(task: str, tokenizer, target_len: int, seed: int, *, chat_template: bool | str = "auto",
             chat_template_kwargs: Mapping[str, Any] | None = None) -> Sample:
    """One RULER sample of ``task`` sized to ``target_len`` tokens of ``tokenizer``.

    The haystack grows until ``n_tokens + tokens_to_generate <= target_len`` no longer holds (RULER's search);
    ``n_tokens`` counts the prompt as the model receives it. ``chat_template``: "auto"/True wraps the task text
    as one user message with the tokenizer's chat template (generation prompt on) when it has one and appends
    the answer prefix; False gives RULER's plain ('base') prompt. ``chat_template_kwargs`` go to
    ``apply_chat_template`` (e.g. ``{"enable_thinking": False}``).

    Raises ``UnknownTask`` for a task not in ``TASKS`` and ``TaskTooShort`` (with ``.minimum``) when not even
    the smallest haystack fits.
    """
    _check(task, target_len, seed)
    job = _Job(task, tokenizer, int(target_len), int(seed), _use_chat(tokenizer, chat_template),
               chat_template_kwargs)
    return _sample(job, _fit(job), seed)


def smallest_fit(task: str, tokenizer, seed: int, target_len: int = 1, *, chat_template: bool | str = "auto",
                 chat_template_kwargs: Mapping[str, Any] | None = None) -> int:
    """The shortest target length (tokens) that sample ``seed`` of ``task`` fits in, among targets sized like
    ``target_len`` (cwe sizes its demos differently from 4,096 tokens on; no other task depends on it): its prompt
    with the task's smallest haystack plus the tokens to generate (one short prompt built). Not defined for fwe,
    whose smallest valid text depends on the target: ValueError."""
    _check(task, target_len, seed)
    job = _Job(task, tokenizer, int(target_len), int(seed), _use_chat(tokenizer, chat_template),
               chat_template_kwargs)
    if job.family == "freq_words_extraction":
        raise ValueError("fwe has no per-seed smallest fit: its smallest valid text depends on the target length")
    return len(_try(job, job.min_units, int(seed)).ids) + job.ttg


def sizing_class(task: str, target_len: int) -> int:
    """The smallest target sized like ``target_len`` (4,096 for cwe from 4,096 tokens on, else 1): ``smallest_fit``
    is the same for every target of one class."""
    return 4096 if _spec(task)["family"] == "common_words_extraction" and int(target_len) >= 4096 else 1


def generate_many(task: str, tokenizer, target_len: int, n: int, seed0: int = 0, *,
                  chat_template: bool | str = "auto",
                  chat_template_kwargs: Mapping[str, Any] | None = None,
                  each: Callable[[int], None] | None = None) -> list[Sample]:
    """``n`` samples with seeds ``seed0, seed0 + 1, ...``, sized like RULER's datasets.

    The haystack size is searched once (on ``seed0``, so the first sample equals ``generate(..., seed0)``); every
    other sample starts from that size and steps down by RULER's increment while it is too long, the smallest
    haystack last: a later sample fails (``TaskTooShort`` naming its seed) exactly when ``smallest_fit`` of its
    seed is over ``target_len``.
    ``each(k)`` is called after the k-th sample is built (k = 1..n); an exception it raises (a cancel) stops here.
    """
    _check(task, target_len, seed0)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be a non-negative int, not {n!r}")
    if n == 0:
        return []
    job = _Job(task, tokenizer, int(target_len), int(seed0), _use_chat(tokenizer, chat_template),
               chat_template_kwargs)
    first = _fit(job)
    out = [_sample(job, first, seed0)]
    if each is not None:
        each(1)
    floor = job.min_units
    for i in range(1, int(n)):
        seed = int(seed0) + i
        size = first.size
        while True:
            fit = _try(job, size, seed)
            ok = _fits(job, fit) and (job.family != "freq_words_extraction" or job.fwe_valid(size))
            if ok:
                break
            if size == floor:  # the seeds before this one fitted: say which sample does not
                which = f"sample seed {seed}; seeds {seed0}..{seed - 1} fit"
                if job.family == "freq_words_extraction":
                    raise _too_short(job, _fwe_minimum(job), "the template, a Zipf text whose top 3 words are "
                                     f"distinct, for {which}")
                raise _too_short(job, len(_try(job, floor, seed).ids) + job.ttg,
                                 f"the template and {floor} haystack unit(s), for {which}")
            size = max(floor, size - job.increment)  # the smallest haystack is tried last
        out.append(_sample(job, fit, seed))
        if each is not None:
            each(len(out))
    return out


# --- scoring (RULER scripts/eval/synthetic/constants.py and scripts/eval/evaluate.py) ------------------------------
_NP_PATTERN = re.compile(r"[\x00-\x1f]")


def postprocess(pred: str) -> str:
    """RULER's ``postprocess_pred``: strip, control characters -> newline, strip."""
    pred = pred.strip()
    return _NP_PATTERN.sub("\n", pred).strip()


def _check_refs(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> None:
    if isinstance(preds, str):
        raise TypeError("preds must be a list of predictions, not one string")
    if len(preds) == 0:
        raise ValueError("no predictions to score")
    if len(preds) != len(refs):
        raise ValueError(f"{len(preds)} predictions but {len(refs)} reference lists")
    for ref in refs:
        if isinstance(ref, str):
            raise TypeError("each entry of refs must be a list of reference strings, not a string")
        if len(ref) == 0:
            raise ValueError("a prediction has an empty reference list")


def string_match_all(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """Mean over predictions of the fraction of its references found in it (case-insensitive), ×100, 2 dp."""
    _check_refs(preds, refs)
    score = sum([sum([1.0 if r.lower() in pred.lower() else 0.0 for r in ref]) / len(ref)
                 for pred, ref in zip(preds, refs)]) / len(preds) * 100
    return round(score, 2)


def string_match_part(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """Mean over predictions of whether any of its references is found in it (case-insensitive), ×100, 2 dp."""
    _check_refs(preds, refs)
    score = sum([max([1.0 if r.lower() in pred.lower() else 0.0 for r in ref])
                 for pred, ref in zip(preds, refs)]) / len(preds) * 100
    return round(score, 2)


_METRIC_FNS: Mapping[str, Callable[[Sequence[str], Sequence[Sequence[str]]], float]] = {
    "string_match_all": string_match_all, "string_match_part": string_match_part}


def score(task: str, preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """RULER's score of ``preds`` (raw model continuations) against ``refs`` (one reference list per prediction):
    ``postprocess`` each prediction, then the task's metric (``METRICS``)."""
    if not isinstance(task, str) or task not in _METRICS:
        raise _unknown(task, tuple(_METRICS))
    if isinstance(preds, str):
        raise TypeError("preds must be a list of predictions, not one string")
    return _METRIC_FNS[_METRICS[task]]([postprocess(p) for p in preds], refs)


def score_samples(samples: Sequence[Sample], preds: Sequence[str]) -> float:
    """``score`` for generated samples (all of one task) and the model's continuations, in the same order."""
    if not samples:
        raise ValueError("no samples to score")
    tasks = {s.task for s in samples}
    if len(tasks) != 1:
        raise ValueError(f"samples mix tasks {sorted(tasks)}; score each task separately")
    return score(samples[0].task, preds, [s.answers for s in samples])
