"""Fast RULER-format sample builders for training the demo model (no tokenizer in the loop except for sizing).

``render(task, n, seed, target)`` reproduces ``gdnviz.probes.ruler``'s rendering of a haystack of size ``n`` with
``random.Random(seed)`` call for call (templates, needles, noise, vt demo, cwe/fwe regimes are imported from
ruler.py), so a training prompt is a prompt that ruler.py could have generated; ``check_against_ruler`` verifies
that byte for byte. What ruler.py adds and training does without is the per-sample binary search over ``n``:
``Sampler.sample`` sizes a sample to a token budget from a linear fit of tokens per haystack unit instead.

Answers (the training target after the answer prefix, followed by EOS):
  niah  " 1234567."            (the value, a period)
  vt    " ABCDE FGHIJ ..."     (the chain's names in order, as in the one-shot demo)
  cwe   " 1. w 2. w ... 10. w" (as in cwe's demo)
  fwe   " w1 w2 w3"
"""
from __future__ import annotations

import random
import re
import string
import uuid
from importlib.resources import files
from typing import Callable

from gdnviz.probes import ruler as R

TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "vt", "cwe", "fwe")
MIN_UNITS = {"niah_single_1": 1, "niah_multikey_2": 1, "niah_multikey_3": 1, "vt": 5, "cwe": 10, "fwe": 30}


def _niah_singular(text: str) -> str:
    """RULER's singular rewrite (one value asked for), as in ruler.py."""
    text = text.replace("Some", "A")
    text = text.replace("are all", "is")
    text = text.replace("are", "is")
    return text.replace("answers", "answer")


def _randomize_icl(icl: str, rng: random.Random, num_hops: int) -> str:
    """RULER's ``randomize_icl`` as in ruler.py: fresh same-length names for the demo's answers, fresh value."""
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


def _ww(name: str) -> list[str]:
    text = files("wonderwords.assets").joinpath(name).read_text(encoding="utf-8")
    return [w.rstrip() for w in text.splitlines()]


class Renderer:
    """ruler.py's text for (task, haystack size n, seed, target_len), without tokenizing (except vt's demo)."""

    def __init__(self, count_tokens: Callable[[str], int]):
        self.count = count_tokens  # tokens of a text fragment, no special tokens (RULER's text_to_tokens)
        self.adjs = tuple(sorted(set(_ww("adjectivelist.txt"))))
        self.nouns = tuple(sorted(set(_ww("nounlist.txt"))))
        pool = sorted(set(_ww("nounlist.txt") + _ww("adjectivelist.txt") + _ww("verblist.txt")))
        random.Random(R.CWE_POOL_SEED).shuffle(pool)
        self.cwe_pool = tuple(pool)
        self._icl: str | None = None

    # --- niah ---------------------------------------------------------------------------------------------------
    def _value(self, rng: random.Random, kind: str) -> str:
        if kind == "numbers":
            return str(rng.randint(10 ** 6, 10 ** 7 - 1))
        if kind == "words":
            i = rng.randrange(len(self.adjs) * len(self.nouns))
            return f"{self.adjs[i // len(self.nouns)]}-{self.nouns[i % len(self.nouns)]}"
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))

    def niah(self, task: str, n: int, seed: int):
        s = R.TASKS[task]
        assert s["num_needle_k"] == s["num_needle_v"] == s["num_needle_q"] == 1, task
        rng = random.Random(seed)
        kt, vt = s["type_needle_k"], s["type_needle_v"]
        key = self._value(rng, kt)
        value = self._value(rng, vt)
        needles = [R.NIAH_NEEDLE.format(type_needle_v=vt, key=key, value=value)]
        random.Random(seed).shuffle(needles)
        if s["type_haystack"] == "noise":
            sentences = [R.NOISE] * n
        else:
            sentences = []
            for _ in range(n):
                k = self._value(rng, kt)
                while k == key:
                    k = self._value(rng, kt)
                sentences.append(R.NIAH_NEEDLE.format(type_needle_v=vt, key=k, value=self._value(rng, vt)))
        for index, element in zip(sorted(rng.sample(range(n), 1), reverse=True), needles):
            sentences.insert(index, element)
        context = "\n".join(sentences)
        rng.sample(range(1), 1)  # ruler draws the queried key index
        template, prefix = _niah_singular(s["template"]), _niah_singular(s["answer_prefix"])
        text = template.format(type_needle_v=vt[:-1], context=context, query=key)
        prefix = prefix.format(type_needle_v=vt[:-1], query=key)
        return text + prefix, prefix, [value]

    # --- vt -----------------------------------------------------------------------------------------------------
    def _vt_text(self, rng: random.Random, n: int, is_icl: bool):
        s = R.TASKS["vt"]
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
        sentences = [R.NOISE] * n
        for chain in chains:
            positions = sorted(rng.sample(range(len(sentences)), len(chain)))
            for j, pos in enumerate(positions):
                sentences.insert(pos + j, chain[j])
        context = "\n".join(sentences).replace(". \n", ".\n")
        text = R.VT_TEMPLATE.format(context=context, query=value, num_v=hops + 1)
        prefix = R.VT_ANSWER_PREFIX.format(query=value, num_v=hops + 1)
        return text, prefix, variables[0]

    def vt_icl(self) -> str:
        if self._icl is None:
            s = R.TASKS["vt"]

            def build(n: int) -> str:
                text, prefix, names = self._vt_text(random.Random(R.VT_ICL_SEED), n, is_icl=True)
                return text + prefix + " " + " ".join(names) + "\n"

            inc, lo = 5, s["num_chains"] * (s["num_hops"] + 1)
            tph = self.count(build(inc)) / inc
            hi = max(int(R.VT_ICL_MAX_LEN / tph * 3), inc * 2)
            best = lo
            while lo <= hi:
                mid = (lo + hi) // 2
                if self.count(build(mid)) <= R.VT_ICL_MAX_LEN:
                    best, lo = mid, mid + 1
                else:
                    hi = mid - 1
            self._icl = build(best)
        return self._icl

    def vt(self, n: int, seed: int):
        rng = random.Random(seed)
        text, prefix, answers = self._vt_text(rng, n, is_icl=False)
        demo = _randomize_icl(self.vt_icl(), rng, R.TASKS["vt"]["num_hops"])
        return demo + "\n" + text + prefix, prefix, answers

    # --- cwe ----------------------------------------------------------------------------------------------------
    def _cwe_example(self, rng, seed, num_words, common_repeats, uncommon_repeats, common_nums):
        word_list_full = rng.sample(self.cwe_pool, num_words)
        common, uncommon = word_list_full[:common_nums], word_list_full[common_nums:]
        word_list = common * common_repeats + uncommon * uncommon_repeats
        random.Random(seed).shuffle(word_list)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(word_list)), common

    def cwe(self, n: int, seed: int, target: int):
        s, rng = R.TASKS["cwe"], random.Random(seed)
        if target < 4096:
            demos = [self._cwe_example(rng, seed, 20, 3, 1, s["num_cw"]) for _ in range(s["num_fewshot"])]
            context, answer = self._cwe_example(rng, seed, n, 6, 1, s["num_cw"])
        else:
            demos = [self._cwe_example(rng, seed, 40, 10, 3, s["num_cw"]) for _ in range(s["num_fewshot"])]
            context, answer = self._cwe_example(rng, seed, n, s["freq_cw"], s["freq_ucw"], s["num_cw"])
        shots = [R.CWE_TEMPLATE.format(context=c) + R.CWE_ANSWER_PREFIX + " "
                 + " ".join(f"{i + 1}. {w}" for i, w in enumerate(a)) for c, a in demos]
        prompt = "\n".join(shots) + "\n" + R.CWE_TEMPLATE.format(context=context) + R.CWE_ANSWER_PREFIX
        return prompt, R.CWE_ANSWER_PREFIX, answer

    # --- fwe ----------------------------------------------------------------------------------------------------
    @staticmethod
    def fwe_vocab_size(target: int) -> int:
        return (target - int(R.TASKS["fwe"]["tokens_to_generate"])) // 50

    @staticmethod
    def fwe_counts(n: int, size: int) -> list[int]:
        return [int(n * (k ** -2.0) / R.ZETA_2) for k in range(1, size + 1)]

    def fwe_valid(self, n: int, target: int) -> bool:
        size = self.fwe_vocab_size(target)
        if size < 4:
            return False
        c = self.fwe_counts(n, size)
        return bool(c[3] >= 1 and (size == 4 or c[3] > c[4]))

    def fwe(self, n: int, seed: int, target: int):
        size = self.fwe_vocab_size(target)
        rng = random.Random(seed)
        wl = int(R.TASKS["fwe"]["coded_wordlen"])
        vocab = ["".join(rng.choices(string.ascii_lowercase, k=wl)) for _ in range(size)]
        while len(set(vocab)) < size:
            vocab.append("".join(rng.choices(string.ascii_lowercase, k=wl)))
        vocab = sorted(set(vocab))
        random.Random(seed).shuffle(vocab)
        vocab[0] = "..."
        # ruler uses numpy: (n * k**-alpha / zeta).astype(int); identical for these magnitudes (checked in tests)
        words = [w for w, c in zip(vocab, self.fwe_counts(n, len(vocab))) for _ in range(int(c))]
        random.Random(seed).shuffle(words)
        return R.FWE_TEMPLATE.format(context=" ".join(words)) + R.FWE_ANSWER_PREFIX, R.FWE_ANSWER_PREFIX, vocab[1:4]

    # --- any ----------------------------------------------------------------------------------------------------
    def render(self, task: str, n: int, seed: int, target: int):
        if task.startswith("niah"):
            return self.niah(task, n, seed)
        if task == "vt":
            return self.vt(n, seed)
        if task == "cwe":
            return self.cwe(n, seed, target)
        if task == "fwe":
            return self.fwe(n, seed, target)
        raise ValueError(task)


def answer_text(task: str, answers: list[str]) -> str:
    if task.startswith("niah"):
        return " " + answers[0] + "."
    if task == "cwe":
        return " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(answers))
    return " " + " ".join(answers)  # vt, fwe


class Sampler:
    """Token-id samples sized to a budget: ``sample(task, budget, rng)`` -> (prompt_ids, answer_ids, answers) with
    ``len(prompt_ids) + len(answer_ids) + 2 <= budget`` (BOS and EOS are the caller's), or None if it cannot fit."""

    def __init__(self, encode: Callable[[str], list[int]]):
        self.encode = encode
        self.r = Renderer(lambda t: len(encode(t)))
        self.fit: dict[tuple, tuple[float, float]] = {}

    @staticmethod
    def regime_target(task: str, budget: int) -> int:
        # cwe switches format at 4096 (ruler's 4K prompts use the >=4096 regime); fwe's vocabulary follows target
        if task == "cwe":
            return 4096 if budget > 3072 else budget
        return budget

    def _coef(self, task: str, target: int) -> tuple[float, float]:
        key = (task, target >= 4096) if task == "cwe" else (task,)
        if key not in self.fit:
            lo, hi = (MIN_UNITS[task], 60) if task != "fwe" else (200, 1200)
            t = max(target, 4096) if task == "fwe" else target
            a_ids = len(self.encode(self.r.render(task, lo, 12345, t)[0]))
            b_ids = len(self.encode(self.r.render(task, hi, 12345, t)[0]))
            slope = (b_ids - a_ids) / (hi - lo)
            self.fit[key] = (slope, a_ids - slope * lo)
        return self.fit[key]

    def min_tokens(self, task: str, target: int = 1024) -> int:
        slope, icpt = self._coef(task, target)
        floor = 330 if task == "fwe" else 0  # fwe needs >= 4 coded words ((target - 50) // 50) and a clear top 3
        return max(floor, int(icpt + slope * MIN_UNITS[task]) + 48)

    def sample(self, task: str, budget: int, rng: random.Random):
        target = self.regime_target(task, budget)
        slope, icpt = self._coef(task, target)
        seed = rng.getrandbits(62)
        n = int((budget - 40 - icpt) / slope)
        for _ in range(6):
            if n < MIN_UNITS[task]:
                return None
            if task == "fwe" and not self.r.fwe_valid(n, target):
                return None
            prompt, _, answers = self.r.render(task, n, seed, target)
            p_ids = self.encode(prompt)
            a_ids = self.encode(answer_text(task, answers))
            extra = len(p_ids) + len(a_ids) + 2 - budget
            if extra <= 0:
                return p_ids, a_ids, answers
            n = min(n - 1, int(n - extra / slope * 1.1) - 1)
        return None


def check_against_ruler(tokenizer, cases=None) -> list[str]:
    """Compare ``Renderer.render`` with ruler.py's own rendering (private ``_Job.render``) on a few cases.
    Returns a list of mismatch descriptions (empty when all agree, or when ruler's internals are not there)."""
    job_cls = getattr(R, "_Job", None)
    if job_cls is None:
        return []
    enc = lambda t: tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    r = Renderer(lambda t: len(enc(t)))
    cases = cases or [(t, n, s, tgt) for t in TASKS for (n, tgt) in ((7, 1024), (40, 2048), (60, 4096))
                      for s in (0, 17)]
    bad = []
    for task, n, seed, target in cases:
        if task == "fwe" and not r.fwe_valid(n * 20, target):
            continue
        nn = n * 20 if task == "fwe" else n
        mine = r.render(task, nn, seed, target)
        theirs = job_cls(task, tokenizer, target, seed, False, None).render(nn, seed)
        if mine != tuple(theirs):
            bad.append(f"{task} n={nn} seed={seed} target={target}")
    return bad
