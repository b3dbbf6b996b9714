"""The Sweeps page's logic (pure: no Streamlit): parse and check its inputs, build the ``SweepJob``, shape the
result into seed 000's table.

Every check here raises or returns the message the page shows with ``st.error``; the page submits nothing while
any is present. The head set reuses the Truncate & compare page's selections (``gdnviz.ui.truncation``).
"""
from __future__ import annotations

import math
import re
import time

import pandas as pd

from gdnviz.errors import RankOutOfRange, TaskTooShort
from gdnviz.probes import rates
from gdnviz.truncation.ranks import check_rank
from gdnviz.ui import truncation as T

#: The tasks ticked when the page opens (seed 000's retrieval pair: a needle and variable tracking).
DEFAULT_TASKS = ("niah_single_1", "vt")
#: Seed 000's ranks; the page offers those up to min(d_k, d_v).
DEFAULT_RANKS = (1, 4, 12, 32, 128)
#: Head sets offered (the Truncate & compare page's, one group, one rank per run of the sweep).
HEAD_MODES = {
    "all": "all GDN heads",
    "within": "heads forgetting within a segment (horizon < L)",
    "layers": "whole layers",
    "picked": "heads picked on the heatmap",
}


def default_ranks_text(rmax: int) -> str:
    return ", ".join(str(r) for r in DEFAULT_RANKS if r <= rmax)


def parse_ints(text: str, what: str) -> list[int]:
    """Comma- (or space-) separated whole numbers; ValueError naming the first that is not one."""
    out = []
    for tok in re.split(r"[,\s]+", str(text or "").strip()):
        if not tok:
            continue
        try:
            out.append(int(tok.replace("_", "")))
        except ValueError:
            raise ValueError(f"{what} must be whole numbers separated by commas: {tok!r} is not one.") from None
    return out


def parse_ranks(text: str, rmax: int) -> list[int]:
    """The ranks to run (sorted, the untouched ``rmax`` added); RankOutOfRange / ValueError with the message."""
    from gdnviz.probes.sweep import resolve_ranks

    ranks = parse_ints(text, "Ranks")
    if not ranks:
        raise RankOutOfRange(f"No ranks given: enter at least one r in 1..{rmax}, e.g. "
                             f"{default_ranks_text(rmax)} (r = {rmax}, the untouched model, always runs).")
    return resolve_ranks(ranks, rmax)


def parse_lengths(text: str) -> list[int]:
    """Target lengths in tokens (sorted, unique); ValueError with the message."""
    lengths = parse_ints(text, "Lengths")
    if not lengths:
        raise ValueError("No lengths given: enter at least one target length in tokens, e.g. 1024, 4096.")
    bad = [L for L in lengths if L < 1]
    if bad:
        raise ValueError(f"Lengths are numbers of tokens, at least 1: {bad[0]} is not.")
    return sorted(set(lengths))


def token_limit_error(lengths, limit: int) -> str | None:
    """The message for the longest of ``lengths`` over the per-document token limit (set on the Model & documents
    page), None when all fit: checked before any prompt of those lengths is built."""
    over = [int(L) for L in lengths if int(L) > int(limit)]
    if not over:
        return None
    return (f"Length {max(over):,} is over the token limit of {int(limit):,} tokens (set on the Model & documents "
            "page): lower it, or raise the limit there if the GPU has the memory.")


def task_minimum(task: str, tokenizer, seed0: int = 0, chat_template="auto") -> int:
    """The shortest target length (tokens) at which ``task`` fits with this tokenizer: what ``TaskTooShort``
    reports for an impossible target (the template, the smallest haystack and the tokens to generate)."""
    from gdnviz.probes import ruler

    try:
        ruler.generate(task, tokenizer, 1, int(seed0), chat_template=chat_template)
    except TaskTooShort as e:
        return int(e.minimum)
    return 1


def seed_minima(task: str, tokenizer, seed0: int, n: int, target_len: int = 1, chat_template="auto",
                budget: int | None = None) -> dict | None:
    """dict(minimum, seed, checked): the largest ``ruler.smallest_fit`` (tokens) over the sweep's seeds
    ``seed0 .. seed0 + n - 1`` at targets sized like ``target_len``, the first seed that needs it, and how many
    seeds were checked: all n, or fewer once the prompts built reach ``budget`` tokens. None for fwe (its need
    depends on the target; the job checks every sample before any model call)."""
    from gdnviz.probes import ruler

    best, at, built, checked = -1, int(seed0), 0, 0
    for seed in range(int(seed0), int(seed0) + int(n)):
        try:
            m = ruler.smallest_fit(task, tokenizer, seed, target_len, chat_template=chat_template)
        except ValueError:
            return None
        checked += 1
        if m > best:
            best, at = m, seed
        built += m
        if budget is not None and built >= budget:
            break
    return dict(minimum=best, seed=at, checked=checked)


def length_errors(tasks, lengths, tokenizer, seed0: int = 0, chat_template="auto", minimum=task_minimum,
                  minima=None) -> list:
    """One message per (task, length) that cannot hold a sample. ``minimum(task)``-checks first (cheap), then
    confirms each suspect by generating the sample (fwe's fill is not monotone in the target). ``minima(task,
    target class)`` (``seed_minima`` of the sweep's seeds) then names a later seed that does not fit a length
    the first seed fits."""
    from gdnviz.probes import ruler

    out = []
    for task in tasks:
        m = minimum(task, tokenizer, seed0, chat_template)
        for L in lengths:
            if L < m:
                try:
                    ruler.generate(task, tokenizer, int(L), int(seed0), chat_template=chat_template)
                except TaskTooShort as e:
                    out.append(f"Length {L:,} is too short for {task}: it needs at least {e.minimum:,} tokens with "
                               f"this model's tokenizer (its template, the smallest haystack and "
                               f"{ruler.TASKS[task]['tokens_to_generate']} tokens to generate). Raise or remove it.")
                    continue
            seeds = minima(task, ruler.sizing_class(task, L)) if minima is not None else None
            if seeds is not None and L < seeds["minimum"]:
                last = int(seed0) + seeds["checked"] - 1
                out.append(f"Length {L:,} is too short for {task} at sample seed {seeds['seed']}: that sample needs "
                           f"at least {seeds['minimum']:,} tokens with this model's tokenizer, the largest need among "
                           f"seeds {seed0}..{last} (seed {seed0} fits). Raise it to {seeds['minimum']:,} or remove "
                           "it.")
    return out


def seed_check_note(tasks, lengths, seed0: int, n: int, minima) -> str | None:
    """What the page did not check of the sweep's later seeds (the job checks them before any model call), or
    None when every sample's smallest prompt was checked."""
    from gdnviz.probes import ruler

    if n <= 1:
        return None
    parts, partial = [], False
    for task in tasks:
        checked = [minima(task, c) for c in sorted({ruler.sizing_class(task, L) for L in lengths})]
        if any(c is None for c in checked):
            parts.append(f"{task} seed {seed0} only")
            partial = True
        elif min(c["checked"] for c in checked) < n:
            parts.append(f"{task} seeds {seed0}..{seed0 + min(c['checked'] for c in checked) - 1}")
            partial = True
        else:
            parts.append(f"{task} all")
    if not partial:
        return None
    return ("Lengths checked against each sample's smallest prompt on this page: " + ", ".join(parts)
            + f" of seeds {seed0}..{seed0 + n - 1}; the job checks the other seeds before any model call.")


def head_group(mode: str, *, layers=(), picked=()) -> dict:
    """The truncation-page group of a head-set choice."""
    if mode == "within":
        return dict(mode="horizon", filter="within")
    if mode == "layers":
        return dict(mode="layers", layers=list(layers))
    if mode == "picked":
        return dict(mode="picked", heads=[list(p) for p in picked])
    return dict(mode="all")


def head_set(mode: str, info: dict, table=None, segment_len: int | None = None, *, layers=(), picked=()) -> list:
    """The (layer, head) pairs cut to each r; ValueError (e.g. a horizon filter without a capture)."""
    return sorted(set(T.group_heads(head_group(mode, layers=layers, picked=picked), info, table, segment_len)))


def unread_cells(cells) -> str:
    """The (task, length) cells of a plan whose prompts the page did not build (cached None), as "vt at 1,024
    tokens; niah_single_1, vt at 4,096 tokens"."""
    by_len: dict = {}
    for c in cells:
        if c["cached"] is None and c["task"] not in by_len.setdefault(int(c["length"]), []):
            by_len[int(c["length"])].append(c["task"])
    return "; ".join(f"{', '.join(ts)} at {L:,} tokens" for L, ts in sorted(by_len.items()))


def done_text(cells) -> str:
    """How many of a plan's answers the memo holds, from its cells (``sweep.plan_from_keys`` /
    ``sweep.plan_unbuilt``): "12 of 40 already done (in the memo)", "none in the memo yet", or, for cells whose
    prompts were not built (cached None), that the job reads the memo for them (named when others were counted)."""
    counted = [c for c in cells if c["cached"] is not None]
    answers, cached = sum(c["answers"] for c in counted), sum(c["cached"] for c in counted)
    if not counted:
        return ("the memo is read when the job starts (too many prompts to build on this page; the job skips what "
                "it holds)")
    done = f"{cached:,} of {answers:,} already done (in the memo)" if cached else "none in the memo yet"
    if len(counted) == len(cells):
        return done
    rest = sum(c["answers"] for c in cells) - answers
    return (f"{done}; the other {rest:,} are too many prompts to build on this page: the job reads the memo for "
            f"{unread_cells(cells)}")


def prompt_length_note(rows) -> str | None:
    """Lengths are targets: per target length, the real prompt token counts (``n_tokens``) over its distinct
    samples (task, seed), as "873–901 tokens (3 prompts)"; None when the rows carry no counts. ``rows``: a sweep's
    rows frame, or records with task, length, seed and n_tokens (a scan job's ``prompt_tokens``)."""
    if rows is not None and not isinstance(rows, pd.DataFrame):
        rows = pd.DataFrame(list(rows))
    if rows is None or "n_tokens" not in rows or not len(rows):
        return None
    per = rows.drop_duplicates(["task", "length", "seed"]).groupby("length")["n_tokens"]
    parts = []
    for i, (L, g) in enumerate(per):
        lo, hi, k = int(g.min()), int(g.max()), len(g)
        span = f"{lo:,}" if lo == hi else f"{lo:,}–{hi:,}"
        what = f"{span} tokens ({k} prompt{'' if k == 1 else 's'})"
        parts.append(f"at length {int(L):,} the prompts have {what}" if i == 0 else f"at {int(L):,}: {what}")
    return ("Lengths are targets: each sample is the largest whose prompt plus the task's answer budget fits in "
            "the length, so its prompt is shorter; " + "; ".join(parts) + ".")


def _budgets() -> dict:
    """RULER's answer budget (tokens_to_generate) per (family, budget): the tasks that have it, in RULER's order."""
    from gdnviz.probes import ruler

    out: dict = {}
    for t, spec in ruler.TASKS.items():
        out.setdefault((spec["family"], int(spec["tokens_to_generate"])), []).append(t)
    return out


#: The help of a target-length field (RULER's sizing; ``target_note`` says it for one task and length).
TARGET_LENGTH_HELP = ("a target, as RULER sizes its samples: the largest sample whose prompt plus the task's answer "
                      "budget fits in it")
#: The same for a field of several lengths.
TARGET_LENGTHS_HELP = ("targets, as RULER sizes its samples: each sample is the largest whose prompt plus the task's "
                       "answer budget (" + ", ".join(f"{b} tokens for {'niah' if f == 'niah' else ', '.join(ts)}"
                                                     for (f, b), ts in _budgets().items())
                       + ") fits in the target, so its prompt is shorter than the target")


def target_note(task: str, target: int, shown_after: bool = True) -> str:
    """That a length is a target: the most tokens RULER's ``task`` sample sized to ``target`` can have (the target
    less the task's answer budget); ``shown_after``: the page shows the real count with the result."""
    from gdnviz.probes import ruler

    ttg = int(ruler.TASKS[task]["tokens_to_generate"])
    return (f"The length is a target: RULER builds the largest {task} sample whose prompt plus the task's {ttg} "
            f"answer tokens fit in {int(target):,} tokens, so the prompt has at most {max(int(target) - ttg, 0):,} "
            "tokens (the haystack grows in whole pieces, so usually a little fewer)."
            + (" The real count is shown with the result." if shown_after else ""))


def noise_note(n: int) -> str | None:
    """Seed 000's warning for small n (None from n = 50 on): what one changed answer does to a 0/100 score."""
    if n >= 50:
        return None
    return (f"With n = {n}, one changed answer moves a 0/100 score by {100 / n:.0f} points: read differences within "
            "about two paired SEs (and under ~5 points even at n = 50) as noise.")


def plan_text(plan: dict, spec, rmax: int) -> str:
    """The Run section's preview of a sweep (``spec``: its ``SweepSpec``; ``plan``: ``sweep.plan_from_keys``):
    what multiplies to the answers (the ranks the job runs, the untouched one included), how many the memo
    holds, the time estimate."""
    from gdnviz.probes.sweep import resolve_ranks

    rs = resolve_ranks(spec.ranks, rmax)
    maps = len(spec.rank_maps)
    settings = f"{len(rs)} rank{'s' if len(rs) != 1 else ''} ({', '.join(map(str, rs))} = untouched)" + (
        f" + {maps} rank map(s)" if maps else "")
    return (f"{len(spec.tasks)} task(s) × {len(spec.lengths)} length(s) × ({settings}) × {spec.n} samples = "
            f"**{plan['answers']:,} answers**: {done_text(plan['cells'])}, " + to_run_text(plan))


def to_run_text(plan: dict) -> str:
    """"**28 to run**, about 2 min" of a plan, or, when the memo was not read for all of it (cached None), the
    time of every answer as an upper bound ("up to 3 min")."""
    eta = rates.eta_text(plan, plan["to_run"])
    if plan["cached"] is not None:
        return f"**{plan['to_run']:,} to run**, {eta}"
    return ("up to " + eta.removeprefix("about ")) if plan["seconds"] is not None else eta


# --- results ----------------------------------------------------------------------------------------------------
def _pm(delta: float, se: float) -> str:
    d = f"{delta:+.1f}".replace("-", "−")
    if se is None or (isinstance(se, float) and math.isnan(se)):
        return f"{d} (n = 1: no SE)"
    return f"{d} ± {se:.1f}"


def seed000_table(table: pd.DataFrame, rmax: int) -> pd.DataFrame:
    """Seed 000's layout: one row per (task, length), one column per r, each cell "score (Δ ± paired SE)"; the
    untouched column holds the plain score."""
    df = table[table["setting"] == "uniform"] if "setting" in table else table
    out = []
    for (task, length), g in df.groupby(["task", "length"], sort=True):
        row = {"task": task, "length (tokens)": int(length), "n": int(g["n"].max())}
        for _, x in g.sort_values("r").iterrows():
            r = int(x["r"])
            if r == rmax:
                row[f"r = {r} (untouched)"] = f"{x['score']:.1f}"
            else:
                row[f"r = {r}"] = f"{x['score']:.1f} ({_pm(x['delta'], x['se'])})"
        out.append(row)
    res = pd.DataFrame(out)
    cols = ["task", "length (tokens)"] + [c for c in res.columns if c.startswith("r = ")] + ["n"]
    return res[cols]


def untouched_at_zero(table: pd.DataFrame) -> list[str]:
    """"task at L tokens" for every (task, length) where the untouched model scored 0 on every sample."""
    df = table.drop_duplicates(["task", "length"]).sort_values(["task", "length"])
    return [f"{t} at {int(L):,} tokens" for t, L, u in zip(df["task"], df["length"], df["untouched"]) if u == 0]


def long_table(table: pd.DataFrame) -> pd.DataFrame:
    """The table with readable column names for the page (same numbers as the CSV)."""
    return table.rename(columns={"length": "length (tokens)", "score": "score (%)",
                                 "untouched": "untouched score (%)", "delta": "Δ vs untouched (points)",
                                 "se": "paired SE (points)"})


# --- per-head rank maps ------------------------------------------------------------------------------------------
_MAP_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,40}$")


def parse_rank_maps(text: str, info: dict) -> tuple:
    """Named per-head rank maps, one per line: ``NAME: layer:head:r, layer:head:r, …`` (``NAME = …`` works too;
    blank lines and lines starting with ``#`` are skipped). Returns ``((name, ((layer, head, r), …)), …)`` as
    ``SweepJob.rank_maps`` takes it; ValueError / RankOutOfRange naming the line for anything wrong (unknown layer
    or head, r outside 1..min(d_k, d_v), a repeated head or name, the reserved name ``uniform``)."""
    from gdnviz.probes.sweep import UNIFORM

    gl, H = [int(x) for x in info["gdn_layers"]], int(info["num_heads"])
    rmax = min(int(info["d_k"]), int(info["d_v"]))
    out, names = [], set()
    for i, raw in enumerate(str(text or "").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([^:=]+?)\s*[:=]\s*(.*)$", line)
        if not m or not m.group(2).strip():
            raise ValueError(f"Rank maps, line {i}: expected NAME: layer:head:r, layer:head:r, … — got {line!r}.")
        name, body = m.group(1).strip(), m.group(2)
        if not _MAP_NAME.match(name):
            raise ValueError(f"Rank maps, line {i}: the name {name!r} must be 1–40 letters, digits, '_', '-' or '.'.")
        if name == UNIFORM:
            raise ValueError(f"Rank maps, line {i}: {UNIFORM!r} is the name of the uniform-rank rows; pick another.")
        if name in names:
            raise ValueError(f"Rank maps, line {i}: the name {name!r} is used twice.")
        names.add(name)
        entries, seen = [], set()
        for tok in [t for t in re.split(r"[,;\s]+", body.strip()) if t]:
            parts = tok.split(":")
            try:
                l, h, r = (int(x) for x in parts)
            except ValueError:
                raise ValueError(f"Rank maps, line {i} ({name}): {tok!r} is not layer:head:r.") from None
            if l not in gl:
                raise ValueError(f"Rank maps, line {i} ({name}): layer {l} is not a GDN layer (GDN layers: "
                                 f"{', '.join(map(str, gl))}).")
            if not 0 <= h < H:
                raise ValueError(f"Rank maps, line {i} ({name}): head {h} does not exist (heads 0..{H - 1}).")
            check_rank(r, f" for layer {l} head {h} (rank maps, line {i}, {name})", upper=rmax)
            if (l, h) in seen:
                raise ValueError(f"Rank maps, line {i} ({name}): head {l}:{h} appears twice.")
            seen.add((l, h))
            entries.append((l, h, r))
        out.append((name, tuple(sorted(entries))))
    return tuple(out)


def rank_map_line(name: str, ranks: dict) -> str:
    """One text-area line for a {"layer:head" or (layer, head): r} map (the Truncate & compare page's heads)."""
    items = []
    for k, r in ranks.items():
        l, h = (int(x) for x in (k.split(":") if isinstance(k, str) else k))
        items.append((l, h, int(r)))
    return f"{name}: " + ", ".join(f"{l}:{h}:{r}" for l, h, r in sorted(items))


def rank_map_table(table: pd.DataFrame) -> pd.DataFrame | None:
    """The rank-map settings in seed 000's layout: one row per (task, length), one column per map, each cell
    "score (Δ ± paired SE)" against the untouched model on the same samples; None when the sweep had no map."""
    if "setting" not in table:
        return None
    df = table[table["setting"] != "uniform"]
    if df.empty:
        return None
    out = []
    for (task, length), g in df.groupby(["task", "length"], sort=True):
        row = {"task": task, "length (tokens)": int(length), "untouched": f"{g['untouched'].iloc[0]:.1f}"}
        for _, x in g.iterrows():
            row[str(x["setting"])] = f"{x['score']:.1f} ({_pm(x['delta'], x['se'])})"
        row["n"] = int(g["n"].max())
        out.append(row)
    return pd.DataFrame(out)


# --- previous sweeps ---------------------------------------------------------------------------------------------
def previous_sweeps(store, limit: int = 30) -> list[dict]:
    """Finished sweep jobs in the store, newest first: ``[{id, label, finished}]`` with a one-line label (model,
    tasks, lengths, ranks, n, rank maps). Their results live in the job records, so reopening one is instant."""
    recs = [r for r in store.read_jobs()[0]
            if r.get("kind") == "sweep" and r.get("status") == "done" and r.get("result")]
    recs.sort(key=lambda r: r.get("finished") or 0, reverse=True)
    out = []
    for rec in recs[:limit]:
        sp = rec.get("spec") or {}
        res = rec["result"]
        name = str(res.get("model_name") or sp.get("model") or "?").replace("\\", "/").rstrip("/").split("/")[-1]
        ranks = [str(r) for r in (sp.get("ranks") or [])] + [f"{res.get('rmax', '')} (untouched)"]
        maps = sp.get("rank_maps") or ()
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(rec.get("finished") or 0))
        label = (f"{when} · {name} · {', '.join(sp.get('tasks') or [])} · "
                 f"{', '.join(f'{int(x):,}' for x in (sp.get('lengths') or []))} tokens · r = {', '.join(ranks)} · "
                 f"n = {sp.get('n')}" + (f" · {len(maps)} rank map(s)" if maps else ""))
        out.append(dict(id=rec["id"], label=label, finished=rec.get("finished")))
    return out
