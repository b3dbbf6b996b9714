"""Head sensitivity scans: which layers / heads a RULER task needs (seed 000's open question), built on sweeps.

A scan runs one task at one length on ``n`` samples (seeds ``seed0 ..``) under one setting per *unit*:

- ``by="layer"``, cut: every head of one GDN layer cut to rank r at every boundary, all other heads untouched;
- ``by="head"``, cut: one head cut to r, all others untouched;
- ``keep=True`` (either ``by``): every GDN head cut to r except the unit (one layer / one head), kept whole.

``layers`` narrows the units to those layers (a layer scan first, then a head scan inside the layers that
matter); in keep mode the other heads are still cut, the narrowing only chooses which units are kept whole.

Each setting is a per-head rank map of a ``gdnviz.probes.sweep`` sweep, so every answer is memoised per sample
under ``sweep.cell_key`` and shared with sweeps of the same truncation (the untouched answers with every sweep
of the task, length and seeds; keep mode's baseline, every head at r, with a sweep of "all" heads at r).

The result (``scan_table``), one row per unit, columns ``TABLE_COLUMNS``: layer, head (NA for a layer row), r, n,
score (mean RULER score with the unit's setting, %), baseline (mean score of the reference on the same samples:
the untouched model for a cut scan, every head cut to r for keep mode), delta = mean(score - baseline) and se =
std(per-sample differences, ddof=1) / sqrt(n), the paired standard error of ``sweep.sweep_table`` (NaN at n = 1).
A cut scan's delta < 0 is what the unit carries; a keep scan's delta > 0 is what keeping it whole restores.

Before running, ``plan_scan`` says how many answers the scan needs, how many the memo holds, and how long the rest
should take from the last measured rate on this model, device, task and length (``gdnviz.probes.rates``).
``run_scan`` refuses (``TooManyPrompts``) a scan that would generate more than ``max_prompts`` answers.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from gdnviz import runner
from gdnviz.errors import EmptyHeadSet, RankOutOfRange, TooManyPrompts, UnknownTask
from gdnviz.probes import rates, ruler, sweep
from gdnviz.truncation import check_rank

__all__ = ["ScanSpec", "ScanResult", "TABLE_COLUMNS", "DEFAULT_MAX_PROMPTS", "units", "unit_maps", "sweep_spec",
           "check_prompt_memory", "plan_scan", "run_scan", "scan_table", "ranked", "Counting"]

TABLE_COLUMNS = ["layer", "head", "r", "n", "score", "baseline", "delta", "se"]
#: The default ceiling on answers a scan or budget may generate in one go (memo hits do not count).
DEFAULT_MAX_PROMPTS = 2000
BY = ("layer", "head")


@dataclass(frozen=True)
class ScanSpec:
    """What to scan (hashable, JSON-friendly through ``asdict``).

    task: a RULER task; length: target tokens; r: the rank a cut head keeps (1..min(d_k, d_v) - 1); by: "layer" |
    "head"; keep: keep-one mode; layers: None (every GDN layer) or the layers whose units are scanned; n, seed0:
    samples (seeds seed0 .. seed0 + n - 1); max_prompts: refuse to generate more answers than this. The rest as
    ``sweep.SweepSpec``.
    """

    model: str
    task: str
    length: int
    r: int = 1
    by: str = "layer"
    keep: bool = False
    layers: tuple | None = None
    n: int = 20
    seed0: int = 0
    segment_len: int = runner.DEFAULT_SEGMENT_LEN
    batch_size: int | None = None
    max_new_tokens: int | None = None
    chat_template: Any = "auto"
    chat_template_kwargs: tuple = ()
    fingerprint: str | None = None
    max_prompts: int = DEFAULT_MAX_PROMPTS

    def __post_init__(self):
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(self.layers))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layers"] = None if self.layers is None else list(self.layers)
        d["chat_template_kwargs"] = dict(self.chat_template_kwargs)
        return d


@dataclass
class ScanResult:
    """table: ``scan_table``; rows: the sweep's per-sample rows; untouched / all_cut: mean scores of the untouched
    model and (keep mode) of every head cut to r; computed: answers generated now (the rest came from the memo);
    seconds: wall time of the run."""

    spec: ScanSpec
    table: pd.DataFrame
    rows: pd.DataFrame
    untouched: float
    all_cut: float | None
    computed: int
    seconds: float
    extra: dict = field(default_factory=dict)


# --- units and settings -------------------------------------------------------------------------------------------
def _rmax(info) -> int:
    return min(int(info.d_k), int(info.d_v))


def check_scan(spec: ScanSpec, info) -> None:
    """Everything about ``spec`` that can be checked without running: UnknownTask, RankOutOfRange, EmptyHeadSet,
    ValueError (a bad ``by``, a layer that is not GDN, a bad n / length)."""
    if spec.task not in ruler.TASKS:
        raise UnknownTask(f"Unknown RULER task {spec.task!r}. Known tasks: {', '.join(ruler.TASK_NAMES)}.")
    if spec.by not in BY:
        raise ValueError(f"a scan goes by 'layer' or by 'head', not {spec.by!r}")
    rmax = _rmax(info)
    r = check_rank(spec.r, " of the scan", upper=rmax)
    if r == rmax:
        raise RankOutOfRange(f"r = {rmax} keeps every state untouched, so the scan would compare the model with "
                             f"itself: choose r in 1..{rmax - 1}")
    if spec.layers is not None:
        if not spec.layers:
            raise EmptyHeadSet("the scan has no layers to scan: give at least one GDN layer (or none, for all)")
        for l in spec.layers:
            if isinstance(l, bool) or not isinstance(l, int) or l not in info.gdn_layers:
                raise ValueError(f"layer {l!r} is not a Gated DeltaNet layer (GDN layers: {list(info.gdn_layers)})")
    if not info.gdn_layers or int(info.num_heads) < 1:
        raise EmptyHeadSet("the model has no GDN heads to scan")
    if isinstance(spec.max_prompts, bool) or not isinstance(spec.max_prompts, int) or spec.max_prompts < 1:
        raise ValueError(f"the prompt limit must be a positive integer, got {spec.max_prompts!r}")


def units(spec: ScanSpec, info) -> list[tuple[int, int | None]]:
    """The scan's units in order: (layer, None) per layer, or (layer, head) per head, in the chosen layers."""
    layers = sorted(set(spec.layers)) if spec.layers is not None else list(info.gdn_layers)
    if spec.by == "layer":
        return [(l, None) for l in layers]
    return [(l, h) for l in layers for h in range(int(info.num_heads))]


def _name(unit) -> str:
    l, h = unit
    return f"L{l}" if h is None else f"L{l}H{h}"


def unit_maps(spec: ScanSpec, info) -> list[tuple[str, dict]]:
    """(setting name, {(layer, head): r}) per unit. Untouched heads are left out of a map (never listed at r_max),
    so equal truncations get equal memo keys whoever built them."""
    all_heads = [(l, h) for l in info.gdn_layers for h in range(int(info.num_heads))]
    out = []
    for unit in units(spec, info):
        l, h = unit
        inside = [(l, x) for x in range(int(info.num_heads))] if h is None else [(l, h)]
        heads = [p for p in all_heads if p not in inside] if spec.keep else inside
        out.append((_name(unit), {p: int(spec.r) for p in heads}))
    return out


def sweep_spec(spec: ScanSpec, info) -> sweep.SweepSpec:
    """The sweep that runs the scan: the untouched model (and for keep mode every head at r) plus one rank map per
    unit, on one task and length."""
    check_scan(spec, info)
    rmax = _rmax(info)
    return sweep.SweepSpec(
        model=spec.model, tasks=(spec.task,), lengths=(int(spec.length),), ranks=(int(spec.r),) if spec.keep
        else (rmax,), n=spec.n, seed0=spec.seed0, heads="all", rank_maps=tuple(unit_maps(spec, info)),
        segment_len=spec.segment_len, batch_size=spec.batch_size, max_new_tokens=spec.max_new_tokens,
        chat_template=spec.chat_template, chat_template_kwargs=spec.chat_template_kwargs,
        fingerprint=spec.fingerprint)


# --- the memo ----------------------------------------------------------------------------------------------------
class Counting:
    """A mapping-like store (``get`` / item assignment) that counts the answers written through it (not the rate
    records, ``rates.is_record``)."""

    def __init__(self, store):
        self.store, self.puts = store, 0

    def get(self, key):
        return self.store.get(key)

    def __setitem__(self, key, value):
        self.store[key] = value
        self.puts += not rates.is_record(key)


def open_store(store):
    """(mapping, closer) for a directory (a diskcache.Cache), a mapping, or None (a dict)."""
    if store is None:
        return {}, lambda: None
    if isinstance(store, (str, Path)):
        import diskcache

        c = diskcache.Cache(str(store))
        return c, c.close
    return store, lambda: None


# --- plan and run -------------------------------------------------------------------------------------------------
def check_prompt_memory(spec: ScanSpec, available: int | None = None) -> None:
    """``sweep.check_prompt_memory`` of the scan's prompts (n samples of one task at one length; every setting
    answers the same prompts): TooManyPrompts before any is built."""
    sweep.check_prompt_memory(sweep.SweepSpec(model=spec.model, tasks=(spec.task,), lengths=(int(spec.length),),
                                              n=spec.n), available, what="scan")


def plan_scan(info, tokenizer, spec: ScanSpec, store=None, plan=None) -> dict:
    """What the scan will do before it runs: ``sweep.plan_from_keys``'s dict (answers, cached, to_run, cells,
    seconds, answers_per_second, missing; seconds None when this model, device, task and length were never
    measured) and settings, units. ``plan``: a callable of the scan's ``sweep.SweepSpec`` returning that dict
    instead (the app's, which may leave the prompts unbuilt: ``sweep.plan_unbuilt``, cached None). Raises what
    ``run_scan`` raises for bad input (not the prompt limit), TooManyPrompts (``check_prompt_memory``) before any
    prompt is built."""
    sspec = sweep_spec(spec, info)
    check_prompt_memory(spec)
    if plan is None:
        st, close = open_store(store)
        try:
            p = sweep.plan_from_keys(info, sweep.cell_keys(info, tokenizer, sspec), spec.segment_len, st,
                                     batch_size=spec.batch_size)
        finally:
            close()
    else:
        p = plan(sspec)
    return dict(p, settings=p["answers"] // max(1, spec.n), units=len(units(spec, info)))


def check_limit(to_run: int, limit: int, what: str, total: int) -> None:
    """TooManyPrompts when ``to_run`` answers exceed ``limit``."""
    if to_run > limit:
        raise TooManyPrompts(
            f"this {what} would generate {to_run:,} answers ({total - to_run:,} of {total:,} are in the memo), over "
            f"the limit of {limit:,}: lower n, narrow it to fewer layers, or raise the limit to run it")


def run_scan(lm, spec: ScanSpec, store=None, progress: Callable[[int, int], None] | None = None,
             describe: Callable[[str], None] | None = None, executor=None) -> ScanResult:
    """Run (or resume) a scan. store: a directory, a mapping-like memo, or None. progress / describe / executor:
    as ``sweep.run_sweep`` (``lm`` needs only ``info`` and ``tokenizer`` when another executor answers). Raises
    UnknownTask, RankOutOfRange, EmptyHeadSet, TaskTooShort, ValueError, and TooManyPrompts (more than
    ``spec.max_prompts`` answers to generate, or prompts that would not fit in memory) before running anything."""
    info = lm.info
    sspec = sweep_spec(spec, info)
    st, close = open_store(store)
    check_prompt_memory(spec)
    try:
        total, cached = sweep.count_cached(info, lm.tokenizer, sspec, st)
        check_limit(total - cached, spec.max_prompts, "scan", total)
        memo = Counting(st)
        t0 = time.time()
        rows = sweep.run_sweep(lm, sspec, store=memo, progress=progress, describe=describe, executor=executor)
        seconds = time.time() - t0
    finally:
        close()
    table = scan_table(rows, spec, _rmax(info))
    uni = rows[rows["setting"] == sweep.UNIFORM]
    all_cut = float(uni[uni["r"] == spec.r]["score"].mean()) if spec.keep else None
    return ScanResult(spec=spec, table=table, rows=rows, untouched=float(uni[uni["r"] == _rmax(info)]["score"].mean()),
                      all_cut=all_cut, computed=memo.puts, seconds=seconds)


# --- tables -------------------------------------------------------------------------------------------------------
def _unit_of(name: str) -> tuple[int, int | None]:
    body = name[1:]
    if "H" in body:
        l, h = body.split("H")
        return int(l), int(h)
    return int(body), None


def scan_table(rows: pd.DataFrame, spec: ScanSpec, rmax: int) -> pd.DataFrame:
    """One row per unit (``TABLE_COLUMNS``) from a scan's sweep rows, paired with the baseline over the same samples
    by ``sweep.sweep_table`` (the untouched r = rmax for a cut scan, the uniform r for keep mode)."""
    t = sweep.sweep_table(rows, rmax=int(spec.r) if spec.keep else int(rmax))
    t = t[t["setting"] != sweep.UNIFORM]
    out = []
    for _, x in t.iterrows():
        layer, head = _unit_of(str(x["setting"]))
        out.append(dict(layer=layer, head=head, r=int(spec.r), n=int(x["n"]), score=float(x["score"]),
                        baseline=float(x["untouched"]), delta=float(x["delta"]), se=float(x["se"])))
    df = pd.DataFrame(out, columns=TABLE_COLUMNS)
    df["head"] = pd.array([None if h is None or (isinstance(h, float) and math.isnan(h)) else int(h)
                           for h in df["head"]], dtype="Int64")
    return df.sort_values(["layer", "head"], na_position="first").reset_index(drop=True)


def ranked(table: pd.DataFrame, keep: bool) -> pd.DataFrame:
    """The units by importance: a cut scan's largest drops first (delta ascending), a keep scan's largest gains
    first (delta descending); ties by layer, head."""
    t = table.copy()
    t["_k"] = -t["delta"] if keep else t["delta"]
    return t.sort_values(["_k", "layer", "head"], na_position="first").drop(columns="_k").reset_index(drop=True)


def table_records(table: pd.DataFrame) -> list[dict]:
    return sweep.records(table)


def table_frame(recs) -> pd.DataFrame:
    """``table_records(scan_table(...))`` back into the table frame."""
    df = pd.DataFrame(list(recs), columns=TABLE_COLUMNS)
    df["head"] = pd.array([None if v is None or (isinstance(v, float) and math.isnan(v)) else int(v)
                           for v in df["head"]], dtype="Int64")
    for c in ("layer", "r", "n"):
        df[c] = df[c].astype(int)
    for c in ("score", "baseline", "delta", "se"):
        df[c] = pd.to_numeric(df[c], errors="coerce").astype(float)
    return df


def spec_from_dict(d: dict) -> ScanSpec:
    d = dict(d)
    d["chat_template_kwargs"] = tuple(sorted((d.get("chat_template_kwargs") or {}).items()))
    return replace(ScanSpec(model=d.pop("model"), task=d.pop("task"), length=int(d.pop("length"))), **d)
