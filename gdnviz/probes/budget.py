"""Per-head rank budgets: ranks as small as possible with every task's RULER score within δ points of untouched.

``find_budget(lm, BudgetSpec(tasks, lengths, n, tolerance=δ), store=...)``:

1. **Sensitivities.** A per-head cut scan (``gdnviz.probes.scan``, ``by="head"``) at the ladder's smallest rung for
   every (task, length): a head's sensitivity is its largest drop, max over (task, length) of -delta. Heads are
   ordered least sensitive first (ties: layer, head).
2. **Search down the ladder** (default 32, 12, 4, 1; r = min(d_k, d_v) is the start). At each rung r the candidates
   are the heads that reached the previous rung, in sensitivity order; the search finds the longest prefix of them
   that can go to r with every (task, length) passing the test below, by bisection on the prefix length (first the
   whole list, then halves). The heads in that prefix move to r and stay candidates for the next rung; the others
   keep their rung. This is the greedy "shrink the least sensitive heads first" with O(log H) evaluations per
   rung instead of H, and the same answer when cutting one more head never turns a failing prefix into a passing
   one (monotonicity, which the noise of finite n can break either way).
3. **Held-out check.** The final budget and the untouched model on ``n_heldout`` samples of other seeds
   (``heldout_seed0``, default seed0 + n, disjoint from the search's), reported separately; the search never sees
   them.

**The test** (one-sided paired non-inferiority): per (task, length), with d_i = score_budget,i - score_untouched,i
over the same n samples, mean d̄ and SE = std(d, ddof=1) / sqrt(n), the budget passes when the lower
(1 - α) confidence bound of the mean difference is above -δ:

    d̄ - t_{1-α, n-1} · SE  ≥  -δ          (α = 0.05 by default; Student's t with n - 1 degrees of freedom)

so a budget is accepted only when the data show its drop is smaller than δ, not merely when a drop was not
significant (at small n that would accept anything). With RULER's 0/100 scores and δ = 1, one answer worse (the
rest unchanged) fails below n = 266 (``acceptance_text`` says what can pass at any n and δ, per task, partial credit
included); with no changed answer SE = 0 and the bound is d̄ = 0, which at n samples bounds the rate of
changed answers only by about 300/n % (rule of three). n < 2 has no SE: ``TooFewSamples``.

**State memory** per sequence: a head at full rank keeps d_k·d_v numbers; at rank r its state is kept as its
factors, r·(d_k + d_v) numbers, when that is smaller (else d_k·d_v), times the bytes of the state dtype (the GDN
kernels keep states in float32). ``state_memory`` gives it per layer; ``gdnviz.figures.cache_budget_frame`` (the
Cache budget page's accounting) gives the full-rank total and the attention KV bytes beside it.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

import pandas as pd

from gdnviz import runner
from gdnviz.errors import EmptyDocumentSet, GDNVizError, TooFewSamples, UnknownTask
from gdnviz.probes import rates, ruler, scan, sweep
from gdnviz.probes.memo import MemoStore
from gdnviz.store import content_hash
from gdnviz.truncation import TruncationSpec, check_rank

__all__ = ["BudgetSpec", "BudgetResult", "DEFAULT_LADDER", "find_budget", "check_prompt_memory", "plan_budget", "noninferiority",
           "state_memory", "head_numbers", "budget_table", "summary", "rank_map_json", "rank_map_from_json",
           "curve_frame", "curve_figure", "STATE_BYTES", "score_step", "losses_allowed", "one_loss_n",
           "acceptance_text"]

DEFAULT_LADDER = (32, 12, 4, 1)
STATE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
VERSION = 1  # of a stored budget result


@dataclass(frozen=True)
class BudgetSpec:
    """What to budget. tasks, lengths: the task set (every (task, length) must pass); n: search samples per (task,
    length), seeds seed0 ..; tolerance: δ in points (> 0); alpha: the test's level; ladder: ranks tried, any
    order (sorted descending; min(d_k, d_v) dropped; None: 32, 12, 4, 1 below min(d_k, d_v)); heldout_seed0 / n_heldout: the held-out samples
    (None: seed0 + n and n; n_heldout = 0 skips the check); state_dtype: of the memory accounting; max_prompts:
    refuse more answers than this. The rest as ``sweep.SweepSpec``."""

    model: str
    tasks: tuple
    lengths: tuple
    n: int = 20
    tolerance: float = 1.0
    alpha: float = 0.05
    ladder: tuple | None = None
    seed0: int = 0
    heldout_seed0: int | None = None
    n_heldout: int | None = None
    state_dtype: str = "float32"
    segment_len: int = runner.DEFAULT_SEGMENT_LEN
    batch_size: int | None = None
    max_new_tokens: int | None = None
    chat_template: Any = "auto"
    chat_template_kwargs: tuple = ()
    fingerprint: str | None = None
    max_prompts: int = scan.DEFAULT_MAX_PROMPTS

    def __post_init__(self):
        for name in ("tasks", "lengths", "ladder"):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, (v,) if isinstance(v, (str, int)) else tuple(v))

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("tasks", "lengths", "ladder"):
            d[k] = None if d[k] is None else list(d[k])
        d["chat_template_kwargs"] = dict(self.chat_template_kwargs)
        return d

    @property
    def heldout_seed(self) -> int:
        return int(self.seed0) + int(self.n) if self.heldout_seed0 is None else int(self.heldout_seed0)

    @property
    def heldout_n(self) -> int:
        return int(self.n) if self.n_heldout is None else int(self.n_heldout)


@dataclass
class BudgetResult:
    """ranks: {(layer, head): r} of the heads below full rank; search / heldout: per (task, length) test records
    (``noninferiority`` fields + task, length, untouched, score); evaluations: every rank map the search tried,
    in order; sensitivity: per head and (task, length) the scan's delta and se; memory: ``state_memory``."""

    spec: BudgetSpec
    ranks: dict
    search: list
    heldout: list
    evaluations: list
    sensitivity: pd.DataFrame
    memory: pd.DataFrame
    rmax: int
    computed: int = 0
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def state_bytes_full(self) -> int:
        return int(self.memory["full_bytes"].sum())

    @property
    def state_bytes_budget(self) -> int:
        return int(self.memory["budget_bytes"].sum())


# --- the test ------------------------------------------------------------------------------------------------------
def noninferiority(diffs, tolerance: float, alpha: float) -> dict:
    """The one-sided paired test of the module docstring on per-sample differences (points): dict(n, delta = mean,
    se, t = t_{1-α, n-1}, bound = delta - t·se, passed = bound >= -tolerance). TooFewSamples for n < 2."""
    import numpy as np
    from scipy import stats

    d = np.asarray(list(diffs), dtype=float)
    n = len(d)
    if n < 2:
        raise TooFewSamples(f"the one-sided paired t test needs n ≥ 2 samples per task and length (its standard "
                            f"error uses n − 1); got n = {n}")
    se = float(np.std(d, ddof=1) / math.sqrt(n))
    t = float(stats.t.ppf(1.0 - alpha, n - 1))
    bound = float(d.mean()) - t * se
    return dict(n=n, delta=float(d.mean()), se=se, t=t, bound=bound, passed=bool(bound >= -float(tolerance)))


# --- what the test can accept at n and δ -----------------------------------------------------------------------------
def _n_references(task: str) -> int:
    """The answers one sample of ``task`` is scored against (``ruler``'s generators: niah the queried values, vt
    the first chain's names, cwe the common words, fwe the 3 words after the noise word)."""
    s = ruler.TASKS[task]
    fam = s["family"]
    if fam == "niah":
        return int(s["num_needle_q"]) * int(s["num_needle_v"])
    if fam == "variable_tracking":
        return int(s["num_hops"]) + 1
    if fam == "common_words_extraction":
        return int(s["num_cw"])
    return 3


def score_step(task: str) -> float:
    """The smallest nonzero change of one sample's RULER score on ``task`` (points): 100 for a task scored 0/100,
    about 100/k (as RULER's scorer rounds it) for string_match_all over k references (partial credit).
    UnknownTask for a task RULER does not score."""
    if task not in ruler.METRICS:
        raise UnknownTask(f"Unknown RULER task {task!r}. Known tasks: {', '.join(ruler.METRICS)}.")
    k = 1 if ruler.METRICS[task] == "string_match_part" else _n_references(task)
    refs = [f"<answer {i}>" for i in range(k)]
    vals = sorted({ruler.string_match_all([" ".join(refs[:j])], [refs]) for j in range(k + 1)})
    return min(b - a for a, b in zip(vals, vals[1:]))


def losses_allowed(n: int, tolerance: float, alpha: float, step: float) -> int:
    """The largest k such that every j ≤ k answers each ``step`` points worse, the other n − j unchanged, pass
    ``noninferiority``: (step/n)·(j + t_{1-α,n-1}·√(j(n−j)/(n−1))) ≤ δ. With no answer better, a budget with more
    answers worse than this fails (for step > δ; tests/test_job_page_notes.py checks it against every outcome at
    small n)."""
    import numpy as np
    from scipy import stats

    n = int(n)
    if n < 2:
        raise TooFewSamples(f"the one-sided paired t test needs n ≥ 2 samples, got n = {n}")
    t = float(stats.t.ppf(1.0 - alpha, n - 1))
    j = np.arange(1, n + 1, dtype=float)
    drop = step / n * (j + t * np.sqrt(j * (n - j) / (n - 1)))
    fails = np.nonzero(drop > float(tolerance))[0]
    return n if not len(fails) else int(fails[0])


def one_loss_n(tolerance: float, alpha: float, step: float) -> int:
    """The smallest n at which one answer ``step`` points worse, the others unchanged, passes: the least n ≥ 2
    with (step/n)·(1 + t_{1-α,n-1}) ≤ δ (that quantity falls with n)."""
    from scipy import stats

    def ok(n: int) -> bool:
        return step / n * (1.0 + float(stats.t.ppf(1.0 - alpha, n - 1))) <= float(tolerance)

    lo, hi = 2, 2
    while not ok(hi):
        lo, hi = hi + 1, hi * 2
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
    return lo


def acceptance_text(tasks, n: int, tolerance: float, alpha: float = 0.05) -> str:
    """What ``noninferiority`` can accept at n samples and tolerance δ, in words: per task (its ``score_step``), how
    many answers may get worse with none better (``losses_allowed``), and, where none may, from which n one answer a
    step worse passes (``one_loss_n``)."""
    def name(t):
        s = score_step(t)
        return f"{t} (0/100)" if s == 100 else f"{t} (steps of {s:g} points)"

    none, some, coarse = [], [], []
    for t in tasks:
        s = score_step(t)
        if s <= tolerance:
            coarse.append(name(t))
        elif (k := losses_allowed(n, tolerance, alpha, s)) == 0:
            none.append((t, name(t), one_loss_n(tolerance, alpha, s)))
        else:
            some.append(f"{k} of {name(t)}" if some else f"{k} of the {n} answers of {name(t)}")
    parts = []
    if none:
        parts.append("no answer of " + ", ".join(x[1] for x in none) + " may get worse unless others get better to "
                     "make up for it (one answer a step worse, the rest unchanged, first passes at n = "
                     + ", ".join(f"{m:,} for {t}" for t, _, m in none) + ")")
    if some:
        parts.append("with none better, at most " + ", ".join(some) + " may get worse")
    if coarse:
        parts.append("δ is at least one score step of " + ", ".join(coarse) + ": a budget can pass with every "
                     "answer a step worse")
    return (f"At n = {n} and δ = {tolerance:g} point{'' if float(tolerance) == 1 else 's'}, for a budget to pass: "
            + "; ".join(parts) + ".")


def _check(spec: BudgetSpec, info) -> list[int]:
    if not spec.tasks:
        raise EmptyDocumentSet("the budget has no tasks: give at least one RULER task")
    for t in spec.tasks:
        if t not in ruler.TASKS:
            raise UnknownTask(f"Unknown RULER task {t!r}. Known tasks: {', '.join(ruler.TASK_NAMES)}.")
    try:
        tol = float(spec.tolerance)
    except (TypeError, ValueError):
        raise ValueError(f"the tolerance must be a number of points > 0, got {spec.tolerance!r}") from None
    if not math.isfinite(tol) or tol <= 0:
        raise ValueError(f"the tolerance must be a number of points > 0, got {spec.tolerance!r}: δ = 0 would ask for "
                         "a budget that provably changes nothing, which no finite n can show")
    if not 0 < float(spec.alpha) < 0.5:
        raise ValueError(f"alpha must be in (0, 0.5), got {spec.alpha!r}")
    for n, what in ((spec.n, "n"), (spec.heldout_n, "the held-out n")):
        if isinstance(n, bool) or not isinstance(n, int):
            raise ValueError(f"{what} must be an integer, got {n!r}")
    if spec.n < 2:
        raise TooFewSamples(f"n = {spec.n} is too small for the one-sided paired t test (it needs n ≥ 2 samples per "
                            "task and length for a standard error)")
    if spec.heldout_n == 1:
        raise TooFewSamples("the held-out check needs n_heldout ≥ 2 (or 0 to skip it)")
    if spec.state_dtype not in STATE_BYTES:
        raise ValueError(f"state dtype {spec.state_dtype!r}: one of {', '.join(STATE_BYTES)}")
    rmax = min(int(info.d_k), int(info.d_v))
    given = [r for r in DEFAULT_LADDER if r < rmax] if spec.ladder is None else spec.ladder
    ladder = sorted({check_rank(r, " of the ladder", upper=rmax) for r in given} - {rmax}, reverse=True)
    if not ladder:
        raise ValueError(f"the ladder {list(given)} has no rank below {rmax}: give ranks like 32, 12, 4, 1")
    return ladder


# --- state memory ----------------------------------------------------------------------------------------------------
def head_numbers(r: int, d_k: int, d_v: int) -> int:
    """Numbers kept for one head's state at rank r: r·(d_k + d_v) (its factors) when smaller than d_k·d_v."""
    return min(int(r) * (d_k + d_v), d_k * d_v) if r < min(d_k, d_v) else d_k * d_v


def state_memory(info, ranks: dict, state_dtype: str = "float32") -> pd.DataFrame:
    """Per GDN layer: layer, heads, full_bytes (heads·d_k·d_v·b), budget_bytes (Σ head_numbers·b), ranks (text),
    for one sequence. Its full_bytes total equals the Cache budget page's recurrent state at batch 1."""
    b = STATE_BYTES[state_dtype]
    dk, dv, H = int(info.d_k), int(info.d_v), int(info.num_heads)
    out = []
    for l in info.gdn_layers:
        rs = [int(ranks.get((l, h), min(dk, dv))) for h in range(H)]
        out.append(dict(layer=int(l), heads=H, full_bytes=H * dk * dv * b,
                        budget_bytes=sum(head_numbers(r, dk, dv) for r in rs) * b,
                        ranks=", ".join(str(r) for r in rs)))
    return pd.DataFrame(out)


def kv_bytes(info, contexts=(4096, 32768, 131072), kv_dtype: str = "bfloat16") -> dict:
    """Full-attention KV bytes per sequence at each context (``gdnviz.figures.cache_budget_frame``)."""
    from gdnviz.figures import cache_budget_frame

    d = info if isinstance(info, dict) else info.to_dict() if hasattr(info, "to_dict") else vars(info)
    df = cache_budget_frame(n_gdn=len(d["gdn_layers"]), h_v=int(d["num_heads"]), h_k=int(d.get("num_key_heads", 0)),
                            d_k=int(d["d_k"]), d_v=int(d["d_v"]), n_attn=len(d.get("attn_layers", ())),
                            h_kv=int(d.get("attn_kv_heads") or 0), d_h=int(d.get("attn_head_dim") or 0),
                            conv_kernel=int(d.get("conv_kernel", 4)), batch=1, b_state=4,
                            b_kv=STATE_BYTES[kv_dtype], b_conv=STATE_BYTES[kv_dtype], contexts=contexts)
    kv = df[df["cache"] == "full-attention KV"]
    return {int(c): int(b) for c, b in zip(kv["context"], kv["bytes"])}


# --- evaluation ------------------------------------------------------------------------------------------------------
def _sweep(spec: BudgetSpec, ranks: dict, seed0: int, n: int, rmax: int) -> sweep.SweepSpec:
    maps = (("budget", {lh: r for lh, r in ranks.items() if r < rmax}),) if any(r < rmax for r in ranks.values()) \
        else ()
    return sweep.SweepSpec(model=spec.model, tasks=spec.tasks, lengths=spec.lengths, ranks=(rmax,), n=n, seed0=seed0,
                           heads="all", rank_maps=maps, segment_len=spec.segment_len, batch_size=spec.batch_size,
                           max_new_tokens=spec.max_new_tokens, chat_template=spec.chat_template,
                           chat_template_kwargs=spec.chat_template_kwargs, fingerprint=spec.fingerprint)


def _evaluate(lm, spec: BudgetSpec, ranks: dict, seed0: int, n: int, memo, progress=None, describe=None,
              executor=None) -> list:
    """Per (task, length): the test of ``ranks`` against untouched on seeds seed0 .. seed0 + n - 1."""
    rmax = min(lm.info.d_k, lm.info.d_v)
    sspec = _sweep(spec, ranks, seed0, n, rmax)
    rows = sweep.run_sweep(lm, sspec, store=memo, progress=progress, describe=describe, executor=executor)
    setting = "budget" if sspec.rank_maps else sweep.UNIFORM
    base = rows[(rows["setting"] == sweep.UNIFORM) & (rows["r"] == rmax)]
    got = rows[rows["setting"] == setting] if setting != sweep.UNIFORM else base
    out = []
    for (task, length), g in got.groupby(["task", "length"], sort=False):
        b = base[(base["task"] == task) & (base["length"] == length)].set_index("seed")["score"]
        s = g.set_index("seed")["score"]
        res = noninferiority((s - b.loc[s.index]).to_numpy(), spec.tolerance, spec.alpha)
        out.append(dict(task=task, length=int(length), untouched=float(b.mean()), score=float(s.mean()), **res))
    return out


def _order(sens: pd.DataFrame) -> list[tuple[int, int]]:
    worst = sens.assign(drop=-sens["delta"]).groupby(["layer", "head"])["drop"].max().reset_index()
    worst = worst.sort_values(["drop", "layer", "head"])
    return [(int(l), int(h)) for l, h in zip(worst["layer"], worst["head"])]


def sensitivities(lm, spec: BudgetSpec, r: int, memo, progress=None, describe=None, executor=None) -> pd.DataFrame:
    """Per-head cut scans at rank r for every (task, length): layer, head, task, length, delta, se."""
    parts = []
    for task in spec.tasks:
        for length in spec.lengths:
            ss = scan.ScanSpec(model=spec.model, task=task, length=int(length), r=int(r), by="head", n=spec.n,
                               seed0=spec.seed0, segment_len=spec.segment_len, batch_size=spec.batch_size,
                               max_new_tokens=spec.max_new_tokens, chat_template=spec.chat_template,
                               chat_template_kwargs=spec.chat_template_kwargs, fingerprint=spec.fingerprint,
                               max_prompts=1 << 62)
            res = scan.run_scan(lm, ss, store=memo, progress=progress, describe=describe, executor=executor)
            parts.append(res.table.assign(task=task, length=int(length))[["layer", "head", "task", "length", "delta",
                                                                          "se"]])
    df = pd.concat(parts, ignore_index=True)
    df["head"] = df["head"].astype(int)
    return df


def check_prompt_memory(spec: BudgetSpec, available: int | None = None) -> None:
    """``sweep.check_prompt_memory`` of the budget's prompts (every task and length on the search's n samples and
    the held-out ones): TooManyPrompts before any is built."""
    sweep.check_prompt_memory(
        sweep.SweepSpec(model=spec.model, tasks=spec.tasks, lengths=spec.lengths, n=spec.n + spec.heldout_n),
        available, what=f"budget ({spec.n:,} search and {spec.heldout_n:,} held-out samples per task and length)")


def plan_budget(info, tokenizer, spec: BudgetSpec, store=None, plan=None) -> dict:
    """Before running: dict(scan_answers, scan_cached, search_max (an upper bound on the search's answers),
    heldout_answers, heldout_cached, max_to_run, scan_cells / heldout_cells (``sweep.plan_from_keys``'s cells of
    the scans and of the held-out check's untouched answers), and ``gdnviz.probes.rates.estimate``'s seconds (None
    when a (task, length) was never measured), answers_per_second, missing for the ``max_to_run`` answers,
    ladder). ``plan``: a callable of a ``sweep.SweepSpec`` returning ``plan_from_keys``'s dict (the app's, which may
    leave a sweep's prompts unbuilt: its cells' cached None; ``scan_cached`` / ``heldout_cached`` are then None,
    and ``max_to_run`` and the time count those answers as not in the memo). TooManyPrompts
    (``check_prompt_memory``) before any prompt is built."""
    ladder = _check(spec, info)
    check_prompt_memory(spec)
    rmax = min(int(info.d_k), int(info.d_v))
    st, close = scan.open_store(store)
    try:
        if plan is None:
            def plan(ss):
                return sweep.plan_from_keys(info, sweep.cell_keys(info, tokenizer, ss), ss.segment_len, st,
                                            batch_size=ss.batch_size)
        cells = []
        for task in spec.tasks:
            for length in spec.lengths:
                ss = scan.ScanSpec(model=spec.model, task=task, length=int(length), r=ladder[-1], by="head",
                                   n=spec.n, seed0=spec.seed0, segment_len=spec.segment_len,
                                   batch_size=spec.batch_size, max_new_tokens=spec.max_new_tokens,
                                   chat_template=spec.chat_template, chat_template_kwargs=spec.chat_template_kwargs,
                                   fingerprint=spec.fingerprint)
                cells += plan(scan.sweep_spec(ss, info))["cells"]
        ho_cells = plan(_sweep(spec, {}, spec.heldout_seed, spec.heldout_n, rmax))["cells"] if spec.heldout_n else []
        H = len(info.gdn_layers) * int(info.num_heads)
        per_cell = len(ladder) * (1 + math.ceil(math.log2(max(2, H)))) * spec.n  # the search's bound per cell
        search_max = per_cell * len(spec.tasks) * len(spec.lengths)
        # held-out: the untouched answers (ho's keys) and as many of the budget's, none of them in the memo yet
        ho_todo = {(c["task"], c["length"]): 2 * c["answers"] - (c["cached"] or 0) for c in ho_cells}
        to_run = {(c["task"], c["length"]): c["answers"] - (c["cached"] or 0) + per_cell
                  + ho_todo.get((c["task"], c["length"]), 0) for c in cells}
        est = rates.estimate(MemoStore(st), info, to_run, spec.segment_len, spec.batch_size)
    finally:
        close()

    def cached(cs):
        return None if any(c["cached"] is None for c in cs) else sum(c["cached"] for c in cs)

    return dict(scan_answers=sum(c["answers"] for c in cells), scan_cached=cached(cells), search_max=search_max,
                heldout_answers=2 * sum(c["answers"] for c in ho_cells), heldout_cached=cached(ho_cells),
                max_to_run=sum(to_run.values()), scan_cells=cells, heldout_cells=ho_cells, ladder=ladder, **est)


def _result_key(info, spec: BudgetSpec) -> str:
    d = spec.to_dict()
    d.pop("max_prompts")
    d.pop("model")
    d["ladder"] = _check(spec, info)  # None and the default it stands for are the same search
    return "budget:" + content_hash(dict(v=VERSION, sweep=sweep.VERSION, fp=info.fingerprint, dtype=info.dtype,
                                         spec=d))


def find_budget(lm, spec: BudgetSpec, store=None, progress: Callable[[int, int, str], None] | None = None,
                executor=None) -> BudgetResult:
    """Run (or read back) a budget search; see the module docstring. store: a directory, a mapping-like memo or
    None. progress(done, total, text): after every answer (total is per step). executor: as ``sweep.run_sweep``'s,
    for every sweep of the search (``lm`` needs only ``info`` and ``tokenizer`` when another executor answers).
    Raises UnknownTask, TaskTooShort, RankOutOfRange, ValueError (tolerance ≤ 0, a bad ladder), TooFewSamples
    (n < 2) and TooManyPrompts (an upper bound of the answers to generate over ``spec.max_prompts``, or prompts that
    would not fit in memory) before running anything. A stored result of the same spec on the same model is returned at once."""
    info = lm.info
    ladder = _check(spec, info)
    rmax = min(int(info.d_k), int(info.d_v))
    st, close = scan.open_store(store)
    try:
        key = _result_key(info, spec)
        hit = st.get(key)
        if hit is not None:
            return result_from_dict(hit, info)
        plan = plan_budget(info, lm.tokenizer, spec, st)
        scan.check_limit(plan["max_to_run"], spec.max_prompts, "budget (at most)",
                         plan["max_to_run"] + plan["scan_cached"] + plan["heldout_cached"])
        memo = scan.Counting(st)
        t0 = time.time()
        step = {"text": ""}

        def prog(done, total):
            if progress is not None:
                progress(done, total, step["text"])

        def say(text):
            step["text"] = text

        step["text"] = f"sensitivity scans at r = {ladder[-1]}"
        sens = sensitivities(lm, spec, ladder[-1], memo, prog, lambda t: say(f"sensitivity scan · {t}"), executor)
        order = _order(sens)
        current = {lh: rmax for lh in order}
        evaluations = []

        def passes(cand: dict, label: str) -> bool:
            say(label)
            res = _evaluate(lm, spec, cand, spec.seed0, spec.n, memo, prog, lambda t: say(f"{label} · {t}"),
                            executor)
            ok = all(x["passed"] for x in res)
            evaluations.append(dict(label=label, ranks=[[l, h, r] for (l, h), r in sorted(cand.items()) if r < rmax],
                                    passed=ok, tests=res))
            return ok

        cands = list(order)
        for r in ladder:
            def trial(k, _r=r):
                cand = dict(current)
                cand.update({lh: _r for lh in cands[:k]})
                return passes(cand, f"r = {_r} for the {k} least sensitive of {len(cands)} heads")

            if trial(len(cands)):
                k = len(cands)
            else:
                lo, hi = 0, len(cands)  # lo passes (the current budget), hi fails
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    lo, hi = (mid, hi) if trial(mid) else (lo, mid)
                k = lo
            for lh in cands[:k]:
                current[lh] = r
            cands = cands[:k]
            if not cands:
                break
        ranks = {lh: r for lh, r in current.items() if r < rmax}
        say("final budget on the search samples")
        search = _evaluate(lm, spec, ranks, spec.seed0, spec.n, memo, prog, say, executor)
        heldout = []
        if spec.heldout_n:
            say(f"held-out check (seeds {spec.heldout_seed}..)")
            heldout = _evaluate(lm, spec, ranks, spec.heldout_seed, spec.heldout_n, memo, prog,
                                lambda t: say(f"held-out check · {t}"), executor)
        res = BudgetResult(spec=spec, ranks=ranks, search=search, heldout=heldout, evaluations=evaluations,
                           sensitivity=sens, memory=state_memory(info, ranks, spec.state_dtype), rmax=rmax,
                           computed=memo.puts, seconds=time.time() - t0)
        st[key] = result_to_dict(res)
        return res
    finally:
        close()


# --- outputs ---------------------------------------------------------------------------------------------------------
def budget_table(result: BudgetResult, info) -> pd.DataFrame:
    """layer, head, r for every GDN head (r = min(d_k, d_v): untouched)."""
    return pd.DataFrame([dict(layer=int(l), head=h, r=int(result.ranks.get((l, h), result.rmax)))
                         for l in info.gdn_layers for h in range(int(info.num_heads))], columns=["layer", "head", "r"])


def result_to_dict(res: BudgetResult) -> dict:
    return dict(version=VERSION, spec=res.spec.to_dict(), ranks=[[l, h, r] for (l, h), r in sorted(res.ranks.items())],
                search=res.search, heldout=res.heldout, evaluations=res.evaluations,
                sensitivity=sweep.records(res.sensitivity), rmax=res.rmax, computed=res.computed,
                seconds=round(res.seconds, 3))


def result_from_dict(d: dict, info) -> BudgetResult:
    sd = dict(d["spec"])
    sd["chat_template_kwargs"] = tuple(sorted((sd.get("chat_template_kwargs") or {}).items()))
    spec = replace(BudgetSpec(model=sd.pop("model"), tasks=sd.pop("tasks"), lengths=sd.pop("lengths")), **sd)
    ranks = {(int(l), int(h)): int(r) for l, h, r in d["ranks"]}
    return BudgetResult(spec=spec, ranks=ranks, search=d["search"], heldout=d["heldout"],
                        evaluations=d["evaluations"], sensitivity=pd.DataFrame(d["sensitivity"]),
                        memory=state_memory(info, ranks, spec.state_dtype), rmax=int(d["rmax"]), computed=0,
                        seconds=0.0, extra=dict(memo_hit=True))


def summary(res: BudgetResult, info) -> dict:
    """What ``summary.json`` holds: state bytes (full, budget, per layer, the KV bytes beside them), untouched and
    budget scores per task with the test, the held-out check, the settings and the search's evaluations."""
    s = res.spec
    return dict(
        state_bytes_full=res.state_bytes_full, state_bytes_budget=res.state_bytes_budget,
        state_saved_fraction=1 - res.state_bytes_budget / res.state_bytes_full, state_dtype=s.state_dtype,
        per_layer=sweep.records(res.memory), kv_bytes_bfloat16=kv_bytes(info),
        tasks={f"{x['task']}@{x['length']}": x for x in res.search},
        heldout={f"{x['task']}@{x['length']}": x for x in res.heldout},
        heldout_seeds=[s.heldout_seed, s.heldout_seed + s.heldout_n - 1] if s.heldout_n else None,
        search_seeds=[s.seed0, s.seed0 + s.n - 1],
        test=(f"one-sided paired t bound: mean(budget − untouched) − t(1−α, n−1)·SE ≥ −δ, δ = {s.tolerance} points, "
              f"α = {s.alpha}, SE = std(differences, ddof=1)/√n"),
        tolerance=s.tolerance, alpha=s.alpha, n=s.n, ladder=_check(s, info),
        rank_map=[[l, h, r] for (l, h), r in sorted(res.ranks.items())], rmax=res.rmax,
        evaluations=res.evaluations, settings=s.to_dict(), computed=res.computed, seconds=round(res.seconds, 3))


def rank_map_json(ranks: dict, info, **meta) -> str:
    """A rank map as JSON: {"format": "gdnviz-rank-map-v1", "model", "fingerprint", "d_k", "d_v", "ranks":
    [[layer, head, r], ...] (heads not listed stay untouched), ...meta}."""
    d = dict(format="gdnviz-rank-map-v1", model=str(getattr(info, "name", "")),
             fingerprint=str(getattr(info, "fingerprint", "")), d_k=int(info.d_k), d_v=int(info.d_v),
             ranks=[[int(l), int(h), int(r)] for (l, h), r in sorted(ranks.items())])
    d.update(meta)
    return json.dumps(d, indent=2)


def rank_map_from_json(text: str, info) -> dict:
    """{(layer, head): r} from ``rank_map_json`` text (or a bare [[layer, head, r], ...] list), validated against
    the model (GDNVizError: not JSON, no list, an entry that is not [layer, head, r]; ValueError: a layer that is not
    GDN, a head out of range; RankOutOfRange: a bad rank; each naming the bad entry). An empty list gives {}."""
    try:
        d = json.loads(text)
    except ValueError as e:
        raise GDNVizError(f"the rank map is not JSON: {e}") from None
    items = d.get("ranks") if isinstance(d, dict) else d
    if not isinstance(items, list):
        raise GDNVizError("the rank map JSON needs a list \"ranks\": [[layer, head, r], ...]")
    for i, e in enumerate(items):
        if not (isinstance(e, list) and len(e) == 3):
            raise GDNVizError(f"entry {i} of the rank map's \"ranks\" is {json.dumps(e)[:80]}, not [layer, head, r]")
    ts = TruncationSpec(items)
    ts.validate(info)
    return ts.as_dict()


# --- several tolerances: score vs state memory ---------------------------------------------------------------------
def curve_frame(results, info) -> pd.DataFrame:
    """One row per (tolerance, task, length, samples): tolerance, state_kib (budget, per sequence), samples
    ("search" | "held-out"), task, length, score, untouched; plus rows with tolerance 0 at full memory for the
    untouched model."""
    rows = []
    for res in results:
        kib = res.state_bytes_budget / 1024
        for which, recs in (("search", res.search), ("held-out", res.heldout)):
            for x in recs:
                rows.append(dict(tolerance=float(res.spec.tolerance), state_kib=kib, samples=which, task=x["task"],
                                 length=int(x["length"]), score=float(x["score"]), untouched=float(x["untouched"]),
                                 delta=float(x["delta"]), se=float(x["se"]), n=int(x["n"])))
                if res is results[0]:
                    rows.append(dict(tolerance=0.0, state_kib=res.state_bytes_full / 1024, samples=which,
                                     task=x["task"], length=int(x["length"]), score=float(x["untouched"]),
                                     untouched=float(x["untouched"]), delta=0.0, se=0.0, n=int(x["n"])))
    return pd.DataFrame(rows)


def curve_frame_from_records(recs) -> pd.DataFrame:
    """``sweep.records(curve_frame(...))`` back into the frame."""
    return pd.DataFrame(list(recs), columns=["tolerance", "state_kib", "samples", "task", "length", "score",
                                             "untouched", "delta", "se", "n"])


def _memory_unit(max_bytes: float) -> tuple[str, float]:
    """The binary unit a memory axis reads in: the largest of KiB, MiB, GiB not above ``max_bytes``, and its size."""
    from gdnviz.plotstyle import GIB, KIB, MIB

    for unit, size in (("GiB", GIB), ("MiB", MIB)):
        if max_bytes >= size:
            return unit, size
    return "KiB", KIB


def curve_figure(df: pd.DataFrame, title: str | None = None):
    """Score vs state memory per sequence: one line per (task, length), filled points on the search samples,
    hollow on the held-out ones; each point a budget at tolerance δ (δ = 0: untouched, full memory)."""
    import altair as alt

    from gdnviz.figures import configure

    from gdnviz.plotstyle import human_bytes

    d = df.copy()
    d["task_len"] = d["task"] + " @ " + d["length"].map(lambda x: f"{int(x):,}")
    d["δ"] = d["tolerance"].map(lambda t: "untouched" if t == 0 else f"δ = {t:g}")
    unit, size = _memory_unit(float(d["state_kib"].max()) * 1024 if len(d) else 0.0)
    d["state"] = d["state_kib"] * 1024 / size
    d["state_text"] = [human_bytes(k * 1024) for k in d["state_kib"]]
    x = alt.X("state:Q", title=f"recurrent state per sequence ({unit}, all GDN heads)", scale=alt.Scale(zero=True),
              axis=alt.Axis(format=",.3~g"))
    y = alt.Y("score:Q", title="RULER score (string match, %)", scale=alt.Scale(domain=[-3, 103], nice=False))
    color = alt.Color("task_len:N", title="task @ length (tokens)")
    shape = alt.Shape("samples:N", title="samples", scale=alt.Scale(domain=["search", "held-out"],
                                                                     range=["circle", "diamond"]))
    tip = [alt.Tooltip("task_len:N", title="task @ length"), alt.Tooltip("δ:N", title="tolerance"),
           alt.Tooltip("samples:N"), alt.Tooltip("state_text:N", title="state per sequence"),
           alt.Tooltip("score:Q", format=".1f", title="score (%)"),
           alt.Tooltip("delta:Q", format="+.1f", title="Δ vs untouched (points)"),
           alt.Tooltip("se:Q", format=".1f", title="paired SE (points)"), alt.Tooltip("n:Q", title="samples n")]
    base = alt.Chart(d)
    line = base.transform_filter(alt.datum.samples == "search").mark_line(opacity=0.6).encode(
        x=x, y="score:Q", color=color, order="state:Q")
    pts = base.mark_point(size=70, filled=True).encode(x=x, y=y, color=color, shape=shape, tooltip=tip,
                                                      fillOpacity=alt.condition(alt.datum.samples == "search",
                                                                                alt.value(1.0), alt.value(0.15)))
    chart = alt.layer(line, pts).properties(width=460, height=300, title=alt.Title(
        title or "Score vs recurrent-state memory of per-head rank budgets",
        subtitle=["each point: the smallest budget found at tolerance δ (its δ in the tooltip); the rightmost "
                  "point is the untouched model", "filled: the search's samples · hollow: held-out seeds"]))
    return configure(chart, autosize="pad")
