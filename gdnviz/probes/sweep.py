"""Retrieval under truncation: tasks x lengths x r x samples, memoised, with paired standard errors (seed 000 §3).

``run_sweep(lm, SweepSpec(...), store=DIR)`` generates ``n`` RULER samples per (task, length)
(``gdnviz.probes.ruler.generate_many``, seeds ``seed0 ...``), answers each greedily with the chosen heads cut to
rank r at every boundary (``gdnviz.probes.batch.batched_greedy``, several samples per forward) and scores it
with RULER's metric. Every (task, length, setting, sample) result is stored under its memo key (:func:`cell_key`,
the one place a sweep's memo key is built: model fingerprint, dtype, task, length, truncation, sample seed and
prompt, segment length, max new tokens, ``VERSION``) as soon as its batch finishes, so an interrupted sweep resumes
where it stopped and a second run of the same sweep recomputes nothing. The app's worker and the CLI use the same
keys.

``r = min(d_k, d_v)`` is the untouched model; it is always run, as the baseline of the paired differences.
``sweep_table`` gives seed 000's table: per (task, length, r) the mean score, n, the difference to the untouched
model and the paired standard error of (score_r - score_untouched) over the same samples (standard deviation of
the per-sample differences / sqrt(n)). ``sweep_figure`` draws score vs r (log x), one line per task, one panel per
length, error bars +- the paired standard error.

Settings: uniform ranks on a head set (``heads``: "all", "layers:0,1", "0:3,1:0" or a tuple of (layer, head)), and
optionally named per-head rank maps (``rank_maps``), each one extra setting (``setting`` column = its name, ``r``
empty).
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import pandas as pd
import torch

from gdnviz import runner
from gdnviz.errors import EmptyDocumentSet, TooManyPrompts, UnknownTask
from gdnviz.truncation import TruncationSpec, check_rank
from gdnviz.probes import rates, ruler
from gdnviz.probes.batch import batched_greedy
from gdnviz.probes.batch_size import CPU_ROWS, auto_batch_size
from gdnviz.probes.memo import MemoStore
from gdnviz.store import content_hash

__all__ = ["SweepSpec", "Batch", "answer_batch", "local_executor", "DEFAULT_RANKS", "resolve_ranks", "resolve_heads",
           "parse_heads",
           "run_sweep", "sweep_table", "sweep_figure", "to_csv", "csv_frame", "cell_key", "cell_keys", "samples_for",
           "check_spec", "check_prompt_memory", "prompt_bytes", "keys_of", "plan_from_keys", "plan_unbuilt",
           "count_cached", "records",
           "rows_frame", "table_frame", "VERSION"]

VERSION = 1  # of a sweep cell's computation: bump it to invalidate every stored cell
DEFAULT_RANKS = (1, 4, 12, 32, 128)
UNIFORM = "uniform"
#: Memory (bytes) a built prompt holds per token of its target length: its text, its token-id list and the ids'
#: int objects. tracemalloc over ``ruler.generate_many`` on the demo tokenizer (2026-12-06, 5102c19): 19–36 bytes
#: per target token held for niah_single_1, vt and cwe at 4K (up to 90 while a prompt is built).
PROMPT_BYTES_PER_TOKEN = 40
ROW_COLUMNS = ["task", "length", "setting", "r", "seed", "score", "pred", "answers", "n_tokens", "n_generated"]


@dataclass(frozen=True)
class SweepSpec:
    """What to sweep. Hashable and JSON-friendly (``to_dict``).

    model: the model's name (for the record); fingerprint: ``lm.info.fingerprint`` (checked against the model
    when given); tasks: RULER task names; lengths: target lengths in tokens; ranks: r values (None: 1, 4, 12, 32,
    128 clipped to min(d_k, d_v)); the untouched r = min(d_k, d_v) is always added. n: samples per (task, length),
    seeds ``seed0 .. seed0 + n - 1``. heads: "all", "layers:0,1", "L:H,L:H,..." or a tuple of (layer, head).
    rank_maps: ((name, (((layer, head), r), ...)), ...) extra settings. batch_size: samples per batched forward (None:
    ``gdnviz.probes.batch_size.auto_batch_size`` per (task, length) on the device that answers; on a cluster the
    smallest its workers choose).
    max_new_tokens: None = RULER's per task.
    chat_template / chat_template_kwargs: as ``ruler.generate`` (kwargs as ((key, value), ...)).
    """

    model: str
    tasks: tuple
    lengths: tuple
    ranks: tuple | None = None
    n: int = 20
    seed0: int = 0
    heads: Any = "all"
    rank_maps: tuple = ()
    segment_len: int = runner.DEFAULT_SEGMENT_LEN
    batch_size: int | None = None
    max_new_tokens: int | None = None
    chat_template: Any = "auto"
    chat_template_kwargs: tuple = ()
    fingerprint: str | None = None

    def __post_init__(self):
        # accept lists / scalars from callers, store tuples (frozen: object.__setattr__)
        for name in ("tasks", "lengths"):
            v = getattr(self, name)
            object.__setattr__(self, name, (v,) if isinstance(v, (str, int)) else tuple(v))
        if self.ranks is not None:
            object.__setattr__(self, "ranks", tuple(self.ranks))
        if not isinstance(self.heads, str):
            object.__setattr__(self, "heads", tuple(tuple(int(x) for x in lh) for lh in self.heads))
        object.__setattr__(self, "rank_maps", tuple(
            (str(name), tuple(sorted(((int(l), int(h)), int(r)) for (l, h), r in
                                     (m.items() if isinstance(m, Mapping) else m))))
            for name, m in (self.rank_maps.items() if isinstance(self.rank_maps, Mapping) else self.rank_maps)))
        if isinstance(self.chat_template_kwargs, Mapping):
            object.__setattr__(self, "chat_template_kwargs", tuple(sorted(self.chat_template_kwargs.items())))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tasks"], d["lengths"] = list(self.tasks), list(self.lengths)
        d["ranks"] = None if self.ranks is None else list(self.ranks)
        d["heads"] = self.heads if isinstance(self.heads, str) else [list(x) for x in self.heads]
        d["rank_maps"] = {name: [[l, h, r] for (l, h), r in m] for name, m in self.rank_maps}
        d["chat_template_kwargs"] = dict(self.chat_template_kwargs)
        return d


# --- validation ---------------------------------------------------------------------------------------------------
def _rmax(info) -> int:
    return min(info.d_k, info.d_v)


def resolve_ranks(ranks: Iterable[int] | None, rmax: int) -> list[int]:
    """Sorted ranks with the untouched ``rmax`` added. None: DEFAULT_RANKS clipped to below rmax. Explicit ranks
    outside 1..rmax raise RankOutOfRange."""
    if ranks is None:
        return sorted({r for r in DEFAULT_RANKS if r < rmax} | {rmax})
    return sorted({check_rank(r, upper=rmax) for r in ranks} | {rmax})


def parse_heads(heads: Any, num_heads: int) -> list[tuple[int, int]]:
    """The head-set forms "layers:0,1" | "L:H,L:H" | iterable of (layer, head) -> sorted distinct (layer, head)
    pairs, not checked against a model ("all" is :func:`resolve_heads`'); ValueError for a malformed form."""
    if isinstance(heads, str):
        text = heads.strip()
        try:
            if text.lower().startswith("layers:"):
                layers = [int(x) for x in text[7:].split(",") if x.strip()]
                pairs = [(l, h) for l in layers for h in range(num_heads)]
            else:
                pairs = [tuple(int(y) for y in x.split(":")) for x in text.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"heads {heads!r}: expected 'all', 'layers:0,1' or 'layer:head,layer:head'") from None
    else:
        pairs = [tuple(int(y) for y in x) for x in heads]
    if not pairs or any(len(p) != 2 for p in pairs):
        raise ValueError(f"heads {heads!r}: expected 'all', 'layers:0,1' or 'layer:head,layer:head'")
    return sorted(set(pairs))


def resolve_heads(heads: Any, info) -> list[tuple[int, int]]:
    """"all" | "layers:0,1" | "L:H,L:H" | iterable of (layer, head) -> sorted (layer, head) pairs (validated)."""
    if heads is None or (isinstance(heads, str) and heads.strip().lower() == "all"):
        return [(l, h) for l in info.gdn_layers for h in range(info.num_heads)]
    pairs = parse_heads(heads, info.num_heads)
    TruncationSpec.uniform(pairs, 1).validate(info)  # names the first bad layer / head
    return pairs


def check_spec(spec: SweepSpec, info) -> None:
    """Raise what ``run_sweep`` raises for the spec's settings on the model ``info`` (EmptyDocumentSet,
    UnknownTask, RankOutOfRange, ValueError...), before any prompt is built; ``keys_of`` takes a spec that passed."""
    if not spec.tasks:
        raise EmptyDocumentSet("the sweep has no tasks: give at least one RULER task")
    for t in spec.tasks:
        if t not in ruler.TASKS:
            raise UnknownTask(f"Unknown RULER task {t!r}. Known tasks: {', '.join(ruler.TASK_NAMES)}.")
    if not spec.lengths:
        raise EmptyDocumentSet("the sweep has no lengths: give at least one target length")
    for L in spec.lengths:
        if isinstance(L, bool) or not isinstance(L, (int, np.integer)) or L < 1:
            raise ValueError(f"length {L!r} must be a positive integer number of tokens")
    if isinstance(spec.n, bool) or not isinstance(spec.n, (int, np.integer)) or spec.n < 1:
        raise EmptyDocumentSet(f"the sweep needs at least one sample per cell (n = {spec.n!r})")
    runner.check_segment_len(spec.segment_len)
    if spec.batch_size is not None and (isinstance(spec.batch_size, bool) or not isinstance(spec.batch_size, int)
                                        or spec.batch_size < 1):
        raise ValueError(f"batch size must be a positive integer (or None: chosen from free memory), got "
                         f"{spec.batch_size!r}")
    if spec.max_new_tokens is not None and (not isinstance(spec.max_new_tokens, int) or spec.max_new_tokens < 1):
        raise ValueError(f"max_new_tokens must be a positive integer or None, got {spec.max_new_tokens!r}")
    if spec.fingerprint is not None and spec.fingerprint != info.fingerprint:
        raise ValueError(f"the sweep was set up for model fingerprint {spec.fingerprint}, but the loaded model's "
                         f"is {info.fingerprint}")
    resolve_ranks(spec.ranks, _rmax(info))
    resolve_heads(spec.heads, info)
    for name, m in spec.rank_maps:
        TruncationSpec(m).validate(info)
        if name == UNIFORM:
            raise ValueError(f"a rank map cannot be called {UNIFORM!r}")


def prompt_bytes(spec: SweepSpec) -> int:
    """An upper bound of the memory the sweep's RULER prompts hold once built (they are all built before the first
    model call): n × tasks × the summed target lengths × ``PROMPT_BYTES_PER_TOKEN`` (a prompt is at most its
    target long)."""
    return int(spec.n) * len(spec.tasks) * sum(int(L) for L in spec.lengths) * PROMPT_BYTES_PER_TOKEN


def check_prompt_memory(spec: SweepSpec, available: int | None = None, what: str = "sweep") -> None:
    """TooManyPrompts when the sweep's prompts (``prompt_bytes``) would take more than half of ``available`` bytes
    (None: the memory available on this machine now, ``psutil``), the other half being the model's and the run's;
    nothing is built. ``what``: the job the message names ("the prompts of this <what>")."""
    if available is None:
        import psutil

        available = int(psutil.virtual_memory().available)
    need = prompt_bytes(spec)
    if need > available // 2:
        gib = 1 << 30
        raise TooManyPrompts(
            f"the prompts of this {what} would not fit in memory: n = {int(spec.n):,} samples × {len(spec.tasks)} "
            f"task(s) × {len(spec.lengths)} length(s) summing to {sum(int(L) for L in spec.lengths):,} tokens is up to "
            f"{need // PROMPT_BYTES_PER_TOKEN:,} prompt tokens, about {need / gib:,.1f} GiB while they are held, "
            f"over half of the {available / gib:,.1f} GiB available on this machine: lower n, or run fewer tasks "
            "or lengths at a time")


# --- settings and keys --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Setting:
    name: str
    r: int | None
    spec: TruncationSpec | None  # None: untouched


def _settings(spec: SweepSpec, info) -> list[_Setting]:
    rmax, heads = _rmax(info), resolve_heads(spec.heads, info)
    out = [_Setting(UNIFORM, r, None if r == rmax else TruncationSpec.uniform(heads, r))
           for r in resolve_ranks(spec.ranks, rmax)]
    return out + [_Setting(name, None, TruncationSpec(m)) for name, m in spec.rank_maps]


def _max_new(spec: SweepSpec, task: str) -> int:
    return int(spec.max_new_tokens) if spec.max_new_tokens is not None else int(ruler.TASKS[task]["tokens_to_generate"])


def cell_key(info, task: str, length: int, setting: _Setting, sample: ruler.Sample, spec: SweepSpec) -> str:
    """Memo key of one sample's result (``"sweep:<hash>"``): everything the answer depends on and ``VERSION``
    (the untouched model's results are shared by every head set). Format: the hash of the cell's fields, hashed
    again with ``"sweep-cells-v<VERSION>"`` (the format the app's store holds; tests/test_sweep.py pins it)."""
    trunc = None if setting.spec is None else setting.spec.to_list()
    prompt = hashlib.sha256(np.asarray(sample.input_ids, dtype=np.int64).tobytes()).hexdigest()[:16]
    d = dict(v=VERSION, fp=info.fingerprint, dtype=info.dtype, task=task, length=int(length), trunc=trunc,
             seed=int(sample.seed), prompt=prompt, L=int(spec.segment_len), new=_max_new(spec, task))
    inner = "sweep:" + hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()
    return "sweep:" + content_hash(dict(version=f"sweep-cells-v{VERSION}", cell=inner))


# --- running ------------------------------------------------------------------------------------------------------
def _samples(lm, spec: SweepSpec, preparing: Callable[[int, int], None] | None = None) -> dict:
    return _samples_for(lm.tokenizer, spec, preparing)


def _samples_for(tokenizer, spec: SweepSpec, preparing: Callable[[int, int], None] | None = None) -> dict:
    """The RULER samples of every (task, length); ``preparing(built, total)`` after each prompt."""
    out = {}
    kw = dict(chat_template=spec.chat_template, chat_template_kwargs=dict(spec.chat_template_kwargs) or None)
    total, built = len(spec.tasks) * len(spec.lengths) * int(spec.n), 0
    for task in spec.tasks:
        for length in spec.lengths:
            each = None if preparing is None else (lambda k, b=built: preparing(b + k, total))
            out[(task, int(length))] = ruler.generate_many(task, tokenizer, int(length), int(spec.n),
                                                           int(spec.seed0), each=each, **kw)
            built += int(spec.n)
    return out


def _cells(info, samples: dict, settings: list, spec: SweepSpec) -> list[tuple]:
    """(task, length, setting, samples, memo keys) of every (task, length, setting), in the order ``run_sweep``
    works through them: the one list both the run and the counts before it are made of."""
    return [(task, length, setting, smp, [cell_key(info, task, length, setting, s, spec) for s in smp])
            for (task, length), smp in samples.items() for setting in settings]


def samples_for(tokenizer, spec: SweepSpec) -> dict:
    """{(task, length): the RULER samples the sweep answers there} (seeds ``seed0 ..``); they depend only on the
    tokenizer and the spec's tasks, lengths, n, seed0 and chat template. Raises TaskTooShort."""
    return _samples_for(tokenizer, spec)


def keys_of(info, samples: dict, spec: SweepSpec) -> dict:
    """{(task, length): the memo keys of every answer the sweep needs there (all settings × ``samples``, as
    ``samples_for`` builds them)}, without a model: ``info`` needs fingerprint, dtype, d_k, d_v, gdn_layers and
    num_heads (a ``ModelInfo`` or a namespace of the inspected model's). ``spec`` has passed ``check_spec``."""
    out: dict = {}
    for task, length, _, _, keys in _cells(info, samples, _settings(spec, info), spec):
        out.setdefault((task, int(length)), []).extend(keys)
    return out


def cell_keys(info, tokenizer, spec: SweepSpec, samples: Callable[[SweepSpec], dict] | None = None) -> dict:
    """``keys_of(info, samples_for(tokenizer, spec), spec)``: the memo keys of every answer the sweep needs.
    ``samples``: where the prompts come from instead (a callable of the spec returning ``samples_for``'s dict;
    the app passes its cache of them)."""
    check_spec(spec, info)  # bad settings before the prompts are built
    return keys_of(info, samples_for(tokenizer, spec) if samples is None else samples(spec), spec)


def plan_from_keys(info, keys: dict, segment_len: int, store=None, *, batch_size: int | None) -> dict:
    """What a job of these ``cell_keys`` (merged over its sweeps) will do: dict(answers, cached (in the memo now),
    to_run, cells [dict(task, length, answers, cached)], and the time ``gdnviz.probes.rates.estimate`` gives for
    the answers to run at the job's ``batch_size`` (None: chosen from free memory): seconds (None: some (task,
    length) never measured at it), answers_per_second, missing, batch_size, rows); JSON-ready."""
    st = MemoStore(store)
    try:
        cells = [dict(task=t, length=int(l), answers=len(ks), cached=sum(st.get(k) is not None for k in ks))
                 for (t, l), ks in keys.items()]
        est = rates.estimate(st, info, {(c["task"], c["length"]): c["answers"] - c["cached"] for c in cells},
                             segment_len, batch_size)
    finally:
        st.close()
    answers, cached = sum(c["answers"] for c in cells), sum(c["cached"] for c in cells)
    return dict(answers=answers, cached=cached, to_run=answers - cached, cells=cells, **est)


def plan_unbuilt(info, spec: SweepSpec, store=None) -> dict:
    """``plan_from_keys``'s dict for a sweep whose prompts are not built yet (too many to build before the job):
    each (task, length) needs the job's settings (``_settings``, the list ``run_sweep`` works through) × ``n``
    answers; ``cached`` is None (the memo keys hash the prompts, so the memo cannot be read without them) and the
    time is that of all the answers at the measured rates (an upper bound: the job skips what the memo holds)."""
    check_spec(spec, info)
    k = len(_settings(spec, info)) * int(spec.n)
    cells = [dict(task=t, length=int(l), answers=k, cached=None) for t in spec.tasks for l in spec.lengths]
    st = MemoStore(store)
    try:
        est = rates.estimate(st, info, {(c["task"], c["length"]): k for c in cells}, spec.segment_len,
                             spec.batch_size)
    finally:
        st.close()
    answers = k * len(cells)
    return dict(answers=answers, cached=None, to_run=answers, cells=cells, **est)


def count_cached(info, tokenizer, spec: SweepSpec, store=None) -> tuple[int, int]:
    """(answers the sweep needs, answers its memo already holds), from ``cell_keys``."""
    p = plan_from_keys(info, cell_keys(info, tokenizer, spec), spec.segment_len, store, batch_size=spec.batch_size)
    return p["answers"], p["cached"]


def _setting_label(setting: _Setting, rmax: int) -> str:
    if setting.name != UNIFORM:
        return f"rank map {setting.name!r}"
    return f"r = {setting.r}" + (" (untouched)" if setting.r == rmax else "")


@dataclass(frozen=True)
class Batch:
    """One unit of work: samples ``idx`` of one (task, length, setting), answered in one batched forward.
    ``prompts``: their token ids; ``n_tokens``: their RULER sizes; ``answers``: their reference answers."""

    task: str
    length: int
    setting: _Setting
    idx: tuple
    prompts: tuple
    answers: tuple
    n_tokens: tuple
    new_tokens: int
    segment_len: int

    @property
    def size(self) -> int:
        """Answers in the unit (its samples): what an executor counts per worker."""
        return len(self.idx)

    def answer(self, lm) -> list[dict]:
        """``answer_batch(lm, self)``: how every executor answers a unit, on a model that holds the weights."""
        return answer_batch(lm, self)


def answer_batch(lm, b: Batch) -> list[dict]:
    """The results of one batch on ``lm`` (one dict per sample: score, pred, n_tokens, n_generated). A batch of
    several samples that runs out of device memory is answered in two halves (recursively)."""
    try:
        gens = batched_greedy(lm, [list(p) for p in b.prompts], b.new_tokens, segment_len=b.segment_len,
                              spec=b.setting.spec)
    except torch.OutOfMemoryError:
        if len(b.idx) < 2:
            raise
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        h = len(b.idx) // 2
        return [r for part in (slice(0, h), slice(h, None))
                for r in answer_batch(lm, replace(b, idx=b.idx[part], prompts=b.prompts[part],
                                                  answers=b.answers[part], n_tokens=b.n_tokens[part]))]
    return [dict(score=float(ruler.score(b.task, [g.text], [list(a)])), pred=g.text, n_tokens=int(n),
                 n_generated=len(g.tokens)) for g, a, n in zip(gens, b.answers, b.n_tokens)]


def local_executor(lm):
    """The default executor: each unit answered on ``lm`` in this process, in order, one after another.
    An executor maps an iterable of units (``Batch``, ``gdnviz.probes.loss_sweep.LossUnit``: anything with
    ``answer(lm)`` and ``size``) to an iterable of ``(unit, unit.answer(lm))`` as they finish (any order);
    ``gdnviz.cluster`` has the Dask one."""
    def execute(units):
        for u in units:
            yield u, u.answer(lm)
    return execute


def _auto_size(lm, n_tokens: list, new_tokens: int, executor) -> int:
    """Rows per batch when the spec leaves it open. The most rows for the longest prompt come from this device's
    free memory (no executor), the executor's ``batch_size(n_tokens, new_tokens)`` where it has one
    (``gdnviz.cluster``: the smallest its workers choose from their own free memory), else ``CPU_ROWS`` (8); the
    samples are then spread evenly over as few batches as that allows (64 samples at most 61 rows: 2 × 32, not
    61 + 3: a batch's decode costs nearly the same at 3 rows as at 61)."""
    if not n_tokens:
        return CPU_ROWS
    if executor is None:
        most = auto_batch_size(lm, max(n_tokens), new_tokens)
    else:
        rows = getattr(executor, "batch_size", None)
        most = int(rows(max(n_tokens), new_tokens)) if rows is not None else CPU_ROWS
    most = max(1, int(most))
    return -(-len(n_tokens) // -(-len(n_tokens) // most))


def run_sweep(lm, spec: SweepSpec, store=None, progress: Callable[[int, int], None] | None = None,
              describe: Callable[[str], None] | None = None, executor=None,
              preparing: Callable[[int, int], None] | None = None) -> pd.DataFrame:
    """Run (or resume) a sweep; returns one row per (task, length, setting, r, sample).

    store: a directory (a ``diskcache.Cache`` is opened there), any mapping-like cache (``get`` and item
    assignment), or None (no memo).
    progress(done, total): called after every sample (cached ones included), once its batch is stored, so a
    progress callback that raises (a cancel) stops between batches without losing finished samples.
    describe(text): called before each (task, length, setting)'s batches are handed to the executor, e.g.
    "vt · 1,024 tokens · r = 4: 3 of 20 samples to generate".
    executor: None (``local_executor(lm)``) or a callable as ``local_executor`` returns (``gdnviz.cluster``); only
    this process writes the store, so results come back here first. ``lm`` needs only ``info`` and ``tokenizer``
    when another executor answers.
    preparing(built, total): called after each RULER prompt is built (before any model call); like progress, it
    may raise to cancel, so a cancel is honoured while thousands of prompts are built.
    Raises UnknownTask, TaskTooShort, RankOutOfRange, EmptyDocumentSet, BadSegmentLength, TooManyPrompts (the prompts
    would not fit in memory: ``check_prompt_memory``) before running anything.
    """
    if lm.tokenizer is None:
        raise ValueError("the sweep needs the model's tokenizer to build RULER prompts")
    check_spec(spec, lm.info)
    check_prompt_memory(spec)  # before any prompt is built
    samples = _samples(lm, spec, preparing)  # raises TaskTooShort before any model call
    settings = _settings(spec, lm.info)
    total = sum(len(s) for s in samples.values()) * len(settings)
    execute = executor if executor is not None else local_executor(lm)
    st = MemoStore(store)
    groups = []  # (task, length, setting, samples, keys)
    results: dict = {}
    done = 0
    spent: dict = {}  # (task, length) -> [wall seconds of its batches, answers generated, most rows in a batch]
    try:
        for task, length, setting, smp, keys in _cells(lm.info, samples, settings, spec):
            for k in keys:
                results[k] = st.get(k)
            groups.append((task, length, setting, smp, keys))
            done += sum(results[k] is not None for k in keys)
        if progress is not None and done:
            progress(done, total)

        def batches():
            for task, length, setting, smp, keys in groups:
                todo = sorted((i for i, k in enumerate(keys) if results[k] is None),
                              key=lambda i: -smp[i].n_tokens)  # similar lengths together: less padding
                if describe is not None:
                    describe(f"{task} · {int(length):,} tokens · {_setting_label(setting, _rmax(lm.info))}: "
                             + (f"{len(todo)} of {len(smp)} samples to generate" if todo else
                                f"all {len(smp)} samples from the memo"))
                size = spec.batch_size or _auto_size(lm, [smp[i].n_tokens for i in todo], _max_new(spec, task),
                                                     executor)
                for b in range(0, len(todo), size):
                    idx = tuple(todo[b:b + size])
                    yield Batch(task, int(length), setting, idx, tuple(tuple(smp[i].input_ids) for i in idx),
                                tuple(tuple(smp[i].answers) for i in idx), tuple(int(smp[i].n_tokens) for i in idx),
                                _max_new(spec, task), int(spec.segment_len)), keys

        key_of = {}

        def handed():
            for b, keys in batches():
                key_of[id(b)] = keys
                yield b

        t_last = time.perf_counter()
        for b, res in execute(handed()):
            now = time.perf_counter()
            acc = spent.setdefault((b.task, int(b.length)), [0.0, 0, 0])
            acc[0], acc[1], acc[2], t_last = acc[0] + now - t_last, acc[1] + len(b.idx), max(acc[2], len(b.idx)), now
            keys = key_of.pop(id(b))
            for i, r in zip(b.idx, res):  # store the whole batch first, then report
                st.set(keys[i], r)
                results[keys[i]] = r
            for _ in b.idx:
                done += 1
                if progress is not None:
                    progress(done, total)
            t_last = time.perf_counter()  # the time spent in progress (a UI, a cancel) is not the model's
    finally:
        for (task, length), (secs, k, rows) in spent.items():  # a cancelled sweep's batches were measured too
            rates.record(st, lm.info, task, length, spec.segment_len, spec.batch_size, secs, k, rows)
        st.close()
    rows = []
    for task, length, setting, smp, keys in groups:
        for s, k in zip(smp, keys):
            res = results[k]
            rows.append(dict(task=task, length=int(length), setting=setting.name, r=setting.r, seed=int(s.seed),
                             score=res["score"], pred=res["pred"], answers=list(s.answers), n_tokens=res["n_tokens"],
                             n_generated=res["n_generated"]))
    df = pd.DataFrame(rows, columns=ROW_COLUMNS)
    df["r"] = df["r"].astype("Int64")
    return df


# --- the table and the figure -------------------------------------------------------------------------------------
TABLE_COLUMNS = ["task", "length", "setting", "r", "score", "n", "untouched", "delta", "se"]


def sweep_table(rows: pd.DataFrame, rmax: int | None = None) -> pd.DataFrame:
    """Seed 000's table: per (task, length, setting, r) mean score, n, the untouched mean over the same samples,
    delta = mean(score_r - score_untouched) and the paired standard error std(differences, ddof=1) / sqrt(n)
    (NaN for n = 1). The untouched rows are the uniform setting at ``rmax`` (default: the largest uniform r)."""
    if rows is None or len(rows) == 0:
        raise EmptyDocumentSet("no sweep rows to tabulate")
    df = rows.copy()
    if "setting" not in df:
        df["setting"] = UNIFORM
    uni = df[df["setting"] == UNIFORM]
    if uni.empty:
        raise ValueError("the rows hold no uniform-rank setting, so there is no untouched baseline")
    rmax = int(uni["r"].max()) if rmax is None else int(rmax)
    base = uni[uni["r"] == rmax][["task", "length", "seed", "score"]].rename(columns={"score": "base"})
    m = df.merge(base, on=["task", "length", "seed"], how="left")
    if m["base"].isna().any():
        missing = m[m["base"].isna()][["task", "length", "seed"]].drop_duplicates().head(3).to_dict("records")
        raise ValueError(f"no untouched (r = {rmax}) result for {missing}: paired differences need it")
    m["diff"] = m["score"] - m["base"]
    out = []
    for (task, length, setting, r), g in m.groupby(["task", "length", "setting", "r"], dropna=False, sort=False):
        n = len(g)
        d = g["diff"].to_numpy(float)
        se = float(np.std(d, ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
        out.append(dict(task=task, length=int(length), setting=setting, r=r, score=float(g["score"].mean()), n=n,
                        untouched=float(g["base"].mean()), delta=float(d.mean()), se=se))
    t = pd.DataFrame(out, columns=TABLE_COLUMNS)
    t["r"] = t["r"].astype("Int64")
    t["_u"] = t["setting"] != UNIFORM
    t = t.sort_values(["task", "length", "_u", "r", "setting"], na_position="last").drop(columns="_u")
    return t.reset_index(drop=True)


def sweep_figure(table: pd.DataFrame, title: str | None = None):
    """Altair chart: score vs r (log x), one line per task, one panel per length, error bars +- paired SE (the
    standard error of score_r - score_untouched over the same samples, drawn around score_r). The tasks are
    dodged a little around each r (``r_plot``; the axis ticks and tooltips give the true r)."""
    import altair as alt

    from gdnviz.figures import configure

    df = table[table["setting"] == UNIFORM].copy() if "setting" in table else table.copy()
    df["r"] = df["r"].astype(int)
    se = df["se"].fillna(0.0)
    df["lo"], df["hi"] = df["score"] - se, df["score"] + se
    df["length"] = df["length"].astype(int)
    rmax, n_lo, n_hi = int(df["r"].max()), int(df["n"].min()), int(df["n"].max())
    n_txt = f"n = {n_lo}" if n_lo == n_hi else f"n = {n_lo} to {n_hi}"
    if df["se"].isna().all():
        bars_txt = f"{n_txt} sample per point: no standard errors (run n ≥ 2)"
    else:
        bars_txt = (f"error bars: ± paired standard error of (score at r − untouched score) over the same samples, "
                    f"{n_txt} per point")
    # tasks side by side around each r (a small dodge on the log axis), so equal scores do not hide a task
    tasks = sorted(df["task"].unique().tolist())
    off = {t: (i - (len(tasks) - 1) / 2) * min(0.08, 0.3 / max(1, len(tasks))) for i, t in enumerate(tasks)}
    df["r_plot"] = df["r"] * np.power(2.0, df["task"].map(off).astype(float))
    x = alt.X("r_plot:Q", scale=alt.Scale(type="log", base=2), title="rank r kept per head (log scale)",
              axis=alt.Axis(values=sorted(df["r"].unique().tolist()), format="d", labelAngle=0, grid=True))
    y_title = "RULER score (string match, %)"
    color = alt.Color("task:N", title="task", legend=alt.Legend(orient="right"))
    tip = [alt.Tooltip("task:N"), alt.Tooltip("length:Q", title="length (tokens)", format=","),
           alt.Tooltip("r:Q"), alt.Tooltip("score:Q", format=".1f", title="score (%)"),
           alt.Tooltip("delta:Q", format="+.1f", title="Δ vs untouched (points)"),
           alt.Tooltip("se:Q", format=".1f", title="paired SE (points)"), alt.Tooltip("n:Q", title="samples")]
    base = alt.Chart(df)
    # a little room below 0 and above 100, so points on the floor or the ceiling stay visible off the axis line
    y = alt.Y("score:Q", title=y_title, scale=alt.Scale(domain=[-3, 103], nice=False),
              axis=alt.Axis(values=[0, 20, 40, 60, 80, 100]))
    line = base.mark_line().encode(x=x, y=y, color=color)
    pts = base.mark_point(filled=True, size=55).encode(x=x, y="score:Q", color=color, tooltip=tip)
    bars = base.mark_errorbar(ticks=True).encode(x=x, y=alt.Y("lo:Q", title=y_title), y2="hi:Q", color=color)
    chart = alt.layer(line, bars, pts, data=df).properties(width=300, height=240).facet(
        column=alt.Column("length:O", title="target length (tokens)", header=alt.Header(
            labelFontSize=12, titleFontSize=13, labelExpr="format(datum.value, ',')")),
        spacing=28)
    chart = chart.properties(title=alt.Title(title or "RULER score vs rank",
                                             subtitle=[bars_txt, f"r = {rmax} is the untouched model"]))
    return configure(chart, autosize="pad")


def csv_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """A rows or table frame ready for CSV: list columns (the answers) as JSON text."""
    df = frame.copy()
    for c in df.columns:
        if df[c].dtype == object and df[c].map(lambda v: isinstance(v, (list, tuple))).any():
            df[c] = df[c].map(lambda v: json.dumps(list(v)) if isinstance(v, (list, tuple)) else v)
    return df


def to_csv(frame: pd.DataFrame, path) -> Path:
    """Write a rows or table frame as CSV (list columns as JSON)."""
    path = Path(path)
    csv_frame(frame).to_csv(path, index=False)
    return path


# --- JSON round trip (worker results) -----------------------------------------------------------------------------
def _plain(v):
    if v is None or v is pd.NA:
        return None
    if isinstance(v, (list, tuple, np.ndarray)):
        return [_plain(x) for x in v]
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return None if math.isnan(float(v)) else float(v)
    return v


def records(frame: pd.DataFrame) -> list[dict]:
    """A rows or table frame as JSON-able records (NaN / NA -> None, numpy scalars -> Python)."""
    return [{k: _plain(v) for k, v in rec.items()} for rec in frame.to_dict(orient="records")]


def _frame(recs, columns) -> pd.DataFrame:
    df = pd.DataFrame(list(recs), columns=columns)
    df["r"] = pd.array([None if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)) else int(v)
                        for v in df["r"]], dtype="Int64")
    df["length"] = df["length"].astype(int)
    return df


def rows_frame(recs) -> pd.DataFrame:
    """``records(run_sweep(...))`` back into the rows frame (same columns and dtypes)."""
    return _frame(recs, ROW_COLUMNS)


def table_frame(recs) -> pd.DataFrame:
    """``records(sweep_table(...))`` back into the table frame (None -> NaN in the float columns)."""
    df = _frame(recs, TABLE_COLUMNS)
    for c in ("score", "untouched", "delta", "se"):
        df[c] = pd.to_numeric(df[c], errors="coerce").astype(float)
    df["n"] = df["n"].astype(int)
    return df
