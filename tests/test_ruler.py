"""gdnviz.probes.ruler: RULER-style generators sized with a real (local) tokenizer, and RULER's scoring.

The tokenizers are a byte-level BPE trained here on the generators' own text (tests/tokenizers_for_tests.py):
``plain`` adds a BOS like Llama's tokenizers, ``chat`` has the same vocabulary plus a ChatML-like template.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from gdnviz.errors import TaskTooShort, UnknownTask
from gdnviz.probes import ruler
from gdnviz.probes.ruler import (TASKS, generate, generate_many, postprocess, score, score_samples,
                                 string_match_all, string_match_part)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tokenizers_for_tests  # noqa: E402

# Target lengths per task. vt's one-shot demo alone is ~500 tokens and cwe's demo + 10 words x 6 ~700, so both
# start at 1024 (512 raises TaskTooShort, tested below); cwe also runs at 4096, RULER's >= 4K regime (30/3, 40-word
# demo).
LENGTHS = {"niah_single_1": (512, 1024, 2048), "niah_multikey_2": (512, 1024, 2048),
           "niah_multikey_3": (512, 1024, 2048), "vt": (1024, 2048), "cwe": (1024, 2048, 4096),
           "fwe": (512, 1024, 2048)}
CASES = [(t, n) for t in ruler.TASK_NAMES for n in LENGTHS[t]]
FILL = 0.85  # see test_fits_target


@pytest.fixture(scope="session")
def tok_dirs(tmp_path_factory):
    return tokenizers_for_tests.build(tmp_path_factory.mktemp("ruler_tok"))


@pytest.fixture(scope="session")
def plain(tok_dirs):
    return tokenizers_for_tests.load(tok_dirs[0])


@pytest.fixture(scope="session")
def chat(tok_dirs):
    return tokenizers_for_tests.load(tok_dirs[1])


@pytest.fixture(scope="session", params=["plain", "chat"])
def tok(request, plain, chat):
    return {"plain": plain, "chat": chat}[request.param]


_CACHE: dict = {}


def gen(task, tokenizer, n, seed=0, **kw):
    """generate() memoised per test session (each sample is checked by several tests)."""
    key = (task, id(tokenizer), n, seed, tuple(sorted(kw.items())))
    if key not in _CACHE:
        _CACHE[key] = generate(task, tokenizer, n, seed, **kw)
    return _CACHE[key]


def context_of(s):
    """The text between the task's instruction and its question (the last one, after any demo)."""
    p = s.prompt
    if s.task.startswith("niah"):
        return p[p.rindex("afterwards.\n") + len("afterwards.\n"):p.rindex("\nWhat is the special magic")]
    if s.task == "vt":
        return p[p.rindex("following text.\n\n") + len("following text.\n\n"):p.rindex("\nQuestion: Find all")]
    if s.task == "cwe":
        return p[p.rindex("most often.\n") + len("most often.\n"):p.rindex("\nQuestion: What are the 10")]
    return p[p.rindex("coded words. ") + len("coded words. "):p.rindex("\nQuestion: Do not provide")]


# --- sizing ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("task,n", CASES)
def test_fits_target(task, n, tok):
    """Within the target, and full: >= 85% of it and no room for one more haystack unit.

    85% holds because the search works at the granularity of one unit (one niah line, <= ~50 tokens for a uuid
    needle; one vt noise line, ~20; one cwe word, <= ~15 with its repeats), and fwe's linear step is
    (target-50)//32 words, ~6% of the target at ~2 tokens per coded word. The exact check is the second one:
    one more unit (fwe: one more step) would not fit.
    """
    s = gen(task, tok, n)
    assert s.n_tokens == len(s.input_ids)
    assert s.input_ids == tok(s.prompt, add_special_tokens=not s.chat)["input_ids"]
    assert s.tokens_to_generate == TASKS[task]["tokens_to_generate"]
    assert s.length == s.n_tokens + s.tokens_to_generate <= n
    assert s.length >= FILL * n, (s.length, n)
    job = ruler._Job(task, tok, n, 0, s.chat, None)
    if task == "fwe":
        bigger = job.encode(job.render(s.haystack_size + job.increment)[0])
        assert len(bigger) >= n - s.tokens_to_generate
    else:
        bigger = job.encode(job.render(s.haystack_size + 1)[0])
        assert len(bigger) + s.tokens_to_generate > n
    assert s.prompt.endswith(s.answer_prefix)
    assert s.target_len == n and s.seed == 0 and s.task == task


@pytest.mark.parametrize("task,n", CASES)
def test_answers_in_context(task, n, plain):
    """RULER requires every reference to occur in the prompt; here, in the task's own context."""
    s = gen(task, plain, n)
    ctx = context_of(s)
    assert s.answers and all(a in ctx for a in s.answers)


# --- task content ---------------------------------------------------------------------------------------------------
def test_niah_single_rendering_is_rulers_singular(plain):
    s = gen("niah_single_1", plain, 1024)
    (value,) = s.answers
    m = re.search(r"One of the special magic numbers for (\S+) is: (\d{7})\.", s.prompt)
    key = m.group(1)
    assert m.group(2) == value and re.fullmatch(r"[a-z]+(-[a-z]+)+", key)
    ctx = context_of(s)
    expected = ("A special magic number is hidden within the following text. Make sure to memorize it. I will "
                f"quiz you about the number afterwards.\n{ctx}\nWhat is the special magic number for {key} "
                f"mentioned in the provided text? The special magic number for {key} mentioned in the provided "
                "text is")
    assert s.prompt == expected  # plain path: RULER's 'base' template, nothing before or after
    lines = ctx.split("\n")
    assert len(lines) == s.haystack_size + 1
    assert sum(line == ruler.NOISE for line in lines) == s.haystack_size


@pytest.mark.parametrize("task,pattern", [
    ("niah_multikey_2", r"One of the special magic numbers for ([a-z]+(?:-[a-z]+)+) is: (\d{7})\."),
    ("niah_multikey_3", r"One of the special magic uuids for ([0-9a-f-]{36}) is: ([0-9a-f-]{36})\.")])
def test_niah_needle_haystack(task, pattern, plain):
    s = gen(task, plain, 2048)
    lines = context_of(s).split("\n")
    assert len(lines) == s.haystack_size + 1
    parsed = [re.fullmatch(pattern, line) for line in lines]
    assert all(parsed), "every haystack line is a needle"
    query = re.search(r"What is the special magic \w+ for (\S+) mentioned", s.prompt).group(1)
    hits = [m.group(2) for m in parsed if m.group(1) == query]
    assert hits == s.answers  # the queried key occurs exactly once
    assert len({m.group(1) for m in parsed}) == len(parsed)


def test_vt_chain_and_demo(chat):
    s = gen("vt", chat, 2048)
    demo, main = s.prompt.split("\n\nMemorize and track", 1)[0], context_of(s)
    # follow the chain from the queried value
    value = re.findall(r"assigned the value (\d{5}) in the text above", s.prompt)[-1]  # [0] is the demo's
    assign = {}
    for line in main.split("\n"):
        m = re.fullmatch(r"VAR ([A-Z]{5}) = (?:VAR ([A-Z]{5}) |(\d{5}))", line)
        if m:
            assign[m.group(1)] = m.group(2) or m.group(3)
    chain, cur = [], value
    while True:
        nxt = [k for k, v in assign.items() if v == cur]
        if not nxt:
            break
        chain += nxt
        cur = nxt[0]
    assert chain == s.answers and len(chain) == 5
    assert sum(line == ruler.NOISE for line in main.split("\n")) == s.haystack_size
    assert s.prompt.endswith(f"5 variables are assigned the value {value}, they are: ")
    # RULER's one-shot demo: 3-letter names, its 12345 randomised, answered after its own answer prefix
    assert "12345" not in s.prompt
    m = re.search(r"they are:  ([A-Z]{3}) ([A-Z]{3}) ([A-Z]{3}) ([A-Z]{3}) ([A-Z]{3})$", demo)
    assert m, demo[-300:]
    assert s.prompt.count("Memorize and track the chain(s)") == 2
    # the demo's own chain is consistent after randomisation
    demo_assign = dict(re.findall(r"VAR ([A-Z]{3}) = (?:VAR )?([A-Z]{3}|\d{5})", demo))
    names = list(m.groups())
    assert demo_assign[names[0]].isdigit() and all(demo_assign[b] == a for a, b in zip(names, names[1:]))
    # other seeds get other demo names (RULER's randomize_icl)
    other = gen("vt", chat, 2048, seed=1)
    assert re.search(r"they are:  ((?:[A-Z]{3} ?){5})\n", other.prompt).group(1) != " ".join(names)


@pytest.mark.parametrize("n,common,uncommon,demo_words", [(2048, 6, 1, 20), (4096, 30, 3, 40)])
def test_cwe_frequencies(n, common, uncommon, demo_words, plain):
    s = gen("cwe", plain, n)
    entries = re.findall(r"(\d+)\. (\S+)", context_of(s))
    assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
    counts = Counter(w for _, w in entries)
    assert len(counts) == s.haystack_size
    assert {w for w, c in counts.items() if c == common} == set(s.answers) and len(s.answers) == 10
    assert all(c == uncommon for w, c in counts.items() if w not in s.answers)
    # one demo before the question, answered with its 10 common words
    demo = s.prompt[:s.prompt.index("\nBelow is a numbered list")]
    demo_ctx = demo[demo.index("most often.\n") + 12:demo.index("\nQuestion:")]
    assert len(Counter(re.findall(r"\d+\. (\S+)", demo_ctx))) == demo_words
    assert re.search(r"are: 1\. \S+ 2\. .* 10\. \S+$", demo)


def test_fwe_zipf(plain):
    s = gen("fwe", plain, 2048)
    counts = Counter(context_of(s).split(" "))
    ranked = [w for w, _ in counts.most_common()]
    assert ranked[0] == "..." and counts["..."] == int(s.haystack_size / ruler.ZETA_2)
    assert set(ranked[1:4]) == set(s.answers) and counts[ranked[3]] > counts[ranked[4]]
    assert all(re.fullmatch(r"[a-z]{6}", w) for w in ranked[1:])
    assert len(counts) <= (2048 - 50) // 50  # vocab_size = max_len // 50


# --- determinism ----------------------------------------------------------------------------------------------------
def test_same_seed_same_sample_different_seed_differs(plain):
    for task in ruler.TASK_NAMES:
        n = LENGTHS[task][0]
        a, b = generate(task, plain, n, 7), generate(task, plain, n, 7)
        assert a == b
        c = generate(task, plain, n, 8)
        assert c.prompt != a.prompt and c.answers != a.answers


def test_same_sample_in_another_process(tok_dirs, chat):
    """Fresh interpreter, another hash seed, tokenizer loaded from disk: byte-identical prompts and ids."""
    code = (
        "import hashlib, json, sys\n"
        f"sys.path.insert(0, {str(HERE)!r})\n"
        "import tokenizers_for_tests as T\n"
        "from gdnviz.probes import ruler\n"
        f"tok = T.load({str(tok_dirs[1])!r})\n"
        "out = {}\n"
        "for task in ruler.TASK_NAMES:\n"
        "    s = ruler.generate(task, tok, 1024, 11)\n"
        "    out[task] = [hashlib.sha256(s.prompt.encode()).hexdigest(), s.input_ids, s.answers, s.haystack_size]\n"
        "print(json.dumps(out))\n")
    env = {**os.environ, "PYTHONHASHSEED": "4242"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          cwd=str(HERE.parent))
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    for task in ruler.TASK_NAMES:
        s = gen(task, chat, 1024, seed=11)
        assert theirs[task] == [hashlib.sha256(s.prompt.encode()).hexdigest(), s.input_ids, s.answers,
                                s.haystack_size], task


def test_no_global_random_state(plain):
    import random

    import numpy as np
    random.seed(1)
    np.random.seed(1)
    before = (random.getstate(), np.random.get_state()[1].tolist())
    generate("vt", plain, 1024, 3)
    generate("fwe", plain, 512, 3)
    assert (random.getstate(), np.random.get_state()[1].tolist()) == before


@pytest.mark.parametrize("task", ["niah_multikey_2", "vt", "fwe"])
def test_generate_many(task, plain):
    n = LENGTHS[task][0]
    many = generate_many(task, plain, n, 3, seed0=5)
    assert [s.seed for s in many] == [5, 6, 7]
    assert many[0] == generate(task, plain, n, 5)
    assert len({s.prompt for s in many}) == 3
    assert all(s.length <= n and s.length >= FILL * n for s in many)
    assert generate_many(task, plain, n, 0) == []


# --- chat and plain paths -------------------------------------------------------------------------------------------
def test_chat_path(chat):
    s = gen("niah_single_1", chat, 1024)
    assert s.chat
    assert s.prompt.startswith("<s><|im_start|>user\nA special magic number is hidden")
    assert s.prompt.endswith("?<|im_end|>\n<|im_start|>assistant\n" + s.answer_prefix)
    bos = chat.convert_tokens_to_ids("<s>")
    assert s.input_ids[0] == bos and s.input_ids.count(bos) == 1  # the template's BOS, not a second one
    for special in ("<|im_start|>", "<|im_end|>"):
        assert chat.convert_tokens_to_ids(special) in s.input_ids
    # the same task text as the plain prompt, inside the wrapper
    p = generate("niah_single_1", chat, 1024, 0, chat_template=False)
    assert not p.chat and "<|im_start|>" not in p.prompt and p.input_ids[0] == bos
    assert p.prompt.startswith("A special magic number")


def test_plain_path(plain, chat):
    s = gen("vt", plain, 1024)
    assert not s.chat and "<|im_start|>" not in s.prompt
    assert s.input_ids[0] == plain.convert_tokens_to_ids("<s>")  # counted as the model receives it
    assert generate("vt", plain, 1024, 0, chat_template=True) == s  # no template to apply: plain
    with pytest.raises(ValueError):
        generate("vt", chat, 1024, 0, chat_template="yes")


def test_cwe_chat_demo_keeps_rulers_layout(chat):
    """RULER formats cwe's demo with the whole model template, answer prefix and answer, then a newline."""
    s = gen("cwe", chat, 2048)
    assert s.prompt.count("<|im_start|>assistant\n Answer: The top 10 words") == 2
    assert re.search(r"10\. \S+\n<s><|im_start|>user\nBelow is a numbered list", s.prompt)


# --- errors ---------------------------------------------------------------------------------------------------------
def test_unknown_task(plain):
    for call in (lambda: generate("niah_single_9", plain, 1024, 0),
                 lambda: generate_many("qa_1", plain, 1024, 2),
                 lambda: score("nope", ["x"], [["x"]])):
        with pytest.raises(UnknownTask) as e:
            call()
        assert "niah_single_1" in str(e.value) and "fwe" in str(e.value)


@pytest.mark.parametrize("task,n", [("niah_single_1", 150), ("niah_multikey_3", 100), ("vt", 512),
                                    ("cwe", 512), ("fwe", 200), ("fwe", 40)])
def test_too_short(task, n, plain):
    with pytest.raises(TaskTooShort) as e:
        generate(task, plain, n, 0)
    err = e.value
    assert err.minimum > n and str(err.minimum) in str(err) and task in str(err)
    s = generate(task, plain, err.minimum, 0)  # the minimum is enough
    assert s.length <= err.minimum
    if task != "fwe":  # exact for the searched tasks: one token less and nothing fits
        with pytest.raises(TaskTooShort):
            generate(task, plain, err.minimum - 1, 0)


# --- scoring --------------------------------------------------------------------------------------------------------
def test_string_match_all():
    refs = [["Alpha", "beta", "gamma", "delta"], ["7"]]
    assert string_match_all(["alpha and BETA", "the number is 7."], refs) == 75.0  # (2/4 + 1) / 2
    assert string_match_all(["ALPHA beta Gamma delta and much more text"], [refs[0]]) == 100.0
    assert string_match_all(["nothing"], [refs[0]]) == 0.0
    assert string_match_all(["a", "b", "c"], [["a"], ["a"], ["a"]]) == 33.33
    assert string_match_all(["art"], [["art", "smart"]]) == 50.0


def test_string_match_part():
    refs = [["Paris", "the capital of France"], ["x", "y"], ["q"]]
    assert string_match_part(["It is paris, I think.", "none", "Q"], refs) == 66.67
    assert string_match_part(["x and y"], [["x", "y"]]) == 100.0


def test_postprocess_and_score():
    assert postprocess("  \t Answer:\x00KUL\x1fYWC  \n") == "Answer:\nKUL\nYWC"
    assert postprocess("a\x7fb") == "a\x7fb"  # only \x00-\x1f
    # control characters become separators, so split words are still found
    assert score("vt", ["KUL\x00YWC DFZ"], [["kul", "ywc", "dfz", "lqh"]]) == 75.0
    assert score("cwe", [" 1. Apple 2. pear"], [["apple", "pear", "plum", "fig"]]) == 50.0
    assert score("qa_1", ["The answer is Paris."], [["paris", "London"]]) == 100.0
    assert score("qa_2", ["no idea"], [["paris"]]) == 0.0
    with pytest.raises(TypeError):
        string_match_all(["abc"], ["abc"])  # refs must be lists of strings
    with pytest.raises(ValueError):
        string_match_all([], [])
    with pytest.raises(ValueError):
        string_match_all(["a", "b"], [["a"]])


def test_score_samples(plain):
    s = gen("niah_single_1", plain, 512)
    assert score_samples([s], [f" {s.answers[0]}.\n"]) == 100.0
    assert score_samples([s], ["I do not know"]) == 0.0


# --- metadata -------------------------------------------------------------------------------------------------------
def test_tasks_metadata():
    assert set(TASKS) == {"niah_single_1", "niah_multikey_2", "niah_multikey_3", "vt", "cwe", "fwe"}
    assert {t: TASKS[t]["tokens_to_generate"] for t in TASKS} == {
        "niah_single_1": 128, "niah_multikey_2": 128, "niah_multikey_3": 128, "vt": 30, "cwe": 120, "fwe": 50}
    assert all(TASKS[t]["metric"] == "string_match_all" for t in TASKS)
    assert ruler.METRICS["qa_1"] == ruler.METRICS["qa_2"] == "string_match_part"
    for t in TASKS:
        assert "{context}" in TASKS[t]["template"] and TASKS[t]["answer_prefix"].startswith(" ")
    json.dumps(TASKS)  # plain data


def test_editing_tasks_does_not_change_generation(plain, monkeypatch):
    before = gen("niah_single_1", plain, 512)
    monkeypatch.setitem(TASKS["niah_single_1"], "tokens_to_generate", 1)
    monkeypatch.setitem(TASKS["niah_single_1"], "template", "{context}")
    assert generate("niah_single_1", plain, 512, 0) == before


def test_word_lists():
    adjs, nouns = ruler._niah_key_parts()
    assert len(adjs) * len(nouns) == 910 * 6782 == 6_171_620  # RULER's key space (wonderwords 3.0.x)
    pool = ruler._cwe_pool()
    assert len(pool) == len(set(pool)) == 8166  # RULER's cwe pool
