"""The Loss vs rank page's logic (pure: no Streamlit): check the run's documents, shape the result into seed 000's
table, list the finished loss sweeps of the store.

The ranks, head sets and rank maps are parsed by ``gdnviz.ui.sweeps`` (the Retrieval sweeps page's parsers), so
both pages accept the same text.
"""
from __future__ import annotations

import math
import time

import pandas as pd

#: Seed 000's ranks for the loss probe (the untouched r = min(d_k, d_v) always runs as well).
DEFAULT_RANKS = (1, 4, 12, 32)
#: Column heads of the subsets (``gdnviz.probes.loss_sweep.SUBSETS``, in that order).
SUBSET_HEADS = {"all": "all", "copy_any": "copy (any)", "copy_recent": "copy (recent)"}


def default_ranks_text(rmax: int) -> str:
    return ", ".join(str(r) for r in DEFAULT_RANKS if r < rmax)


def short_documents(documents: list[dict], segment_len: int) -> list[str]:
    """One message per run document (``{"name", "n_tokens"}``) too short for the probe (fewer than L + 2 tokens)."""
    from gdnviz.probes.loss_sweep import min_tokens

    need = min_tokens(segment_len)
    return [f"Document '{d['name']}' has {int(d['n_tokens']):,} tokens; loss vs rank needs at least {need:,} "
            f"(segment length L = {segment_len} + 2), so that some prediction reads a state truncated at the first "
            "boundary. Capture the document set without it, or with a shorter segment length."
            for d in documents if int(d["n_tokens"]) < need]


def n_runs(n_documents: int, n_settings: int) -> int:
    return n_documents * n_settings


def pass_tokens(documents: list[dict], n_truncated: int) -> dict:
    """Tokens the job runs through the model, as ``gdnviz.probes.rates.estimate_job`` takes them for "loss": every
    run document (``{"n_tokens"}``) once untouched and once per truncated setting (ranks below the untouched one,
    rank maps), before the memo's share is known."""
    n = sum(int(d["n_tokens"]) for d in documents)
    return {"untouched": n, "truncated": n * int(n_truncated)}


def few_documents_note(n_documents: int) -> str | None:
    """How far the paired SE over ``n_documents`` can be trusted (None from 10 documents on): its degrees of freedom
    and the two-sided 95% Student-t factor an interval needs (12.7 at 2 documents), or that 1 document has no SE."""
    n = int(n_documents)
    if n >= 10:
        return None
    if n < 2:
        return "One document: the change has no standard error; add documents to the run for one."
    from scipy import stats

    t = float(stats.t.ppf(0.975, n - 1))
    return (f"Over {n} documents the paired standard error has {n - 1} degree{'s' if n > 2 else ''} of freedom: a "
            f"95% interval is Δ ± {t:.1f}·SE, not ± 2·SE. More documents make the differences readable.")


def _pm(delta: float, se: float) -> str:
    d = f"{delta:+.4f}".replace("-", "−")
    if se is None or (isinstance(se, float) and math.isnan(se)):
        return f"{d} (1 document: no SE)"
    return f"{d} ± {se:.4f}"


def seed000_table(table: pd.DataFrame, rmax: int) -> pd.DataFrame:
    """Seed 000's layout: one row per setting (each r, then each rank map), for each subset (``SUBSET_HEADS``) the
    mean loss (nats / token) and "Δ ± paired SE (Δ %)" (nats) against the untouched model; "—" where a subset is
    empty. (How many documents and predictions each subset holds: ``subset_sizes``.)"""
    out = []
    for (setting, r), g in table.groupby(["setting", "r"], sort=False, dropna=False):
        name = (f"{int(r)} (untouched)" if int(r) == rmax else str(int(r))) if setting == "uniform" \
            else f"map {setting}"
        row = {"r": name}
        for sub, head in SUBSET_HEADS.items():
            x = g[g["subset"] == sub].iloc[0]
            empty = int(x["n_docs"]) == 0
            row[f"{head}: loss"] = "—" if empty else f"{x['loss']:.4f}"
            if empty or (setting == "uniform" and int(r) == rmax):
                row[f"{head}: Δ ± SE (Δ %)"] = "—" if empty else "0"
            else:
                row[f"{head}: Δ ± SE (Δ %)"] = (_pm(x["delta"], x["se"]) + " ("
                                                 + f"{x['delta_pct']:+.2f}%)".replace("-", "−"))
        out.append(row)
    return pd.DataFrame(out)


def subset_sizes(table: pd.DataFrame) -> dict:
    """{subset: (documents, predictions)} of the untouched rows (the same for every setting)."""
    u = table[table["setting"] == "uniform"]
    u = u[u["r"] == u["r"].max()]
    return {s: (int(x["n_docs"]), int(x["n_predictions"])) for s, x in u.set_index("subset").iterrows()}


def long_table(table: pd.DataFrame) -> pd.DataFrame:
    """The table with readable column names for the page (same numbers as the CSV)."""
    return table.rename(columns={"n_docs": "documents", "n_predictions": "predictions",
                                 "loss": "loss (nats / token)", "untouched": "untouched loss (nats / token)",
                                 "delta": "Δ vs untouched (nats)", "se": "paired SE (nats)", "delta_pct": "Δ (%)"})


def previous_loss_sweeps(store, limit: int = 30) -> list[dict]:
    """Finished loss-vs-rank jobs in the store, newest first: ``[{id, label, finished}]``; their results live in
    the job records, so reopening one is instant."""
    recs = []
    for key in store.jobs.iterkeys():
        if not str(key).startswith("job:"):
            continue
        rec = store.jobs.get(key)
        if rec and rec.get("kind") == "loss" and rec.get("status") == "done" and rec.get("result"):
            recs.append(rec)
    recs.sort(key=lambda r: r.get("finished") or 0, reverse=True)
    out = []
    for rec in recs[:limit]:
        res, sp = rec["result"], rec.get("spec") or {}
        name = str(res.get("model_name") or "?").replace("\\", "/").rstrip("/").split("/")[-1]
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(rec.get("finished") or 0))
        heads = sp.get("heads")
        heads = heads if isinstance(heads, str) else f"{len(heads or ())} heads"
        maps = sp.get("rank_maps") or ()
        out.append(dict(id=rec["id"], finished=rec.get("finished"), label=(
            f"{when} · {name} · {len(res.get('documents', []))} documents · r = "
            f"{', '.join(map(str, res.get('ranks', [])))} · heads: {heads} · d = {sp.get('min_distance')}"
            + (f" · {len(maps)} rank map(s)" if maps else ""))))
    return out
