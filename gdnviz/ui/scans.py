"""The Head scans & budgets page's logic (pure: no Streamlit): plans with their wording, the layers worth a head
scan, result frames for the page, the hand-off of a budget to the Sweeps page.

The page shows every message returned or raised here with ``st.error`` and submits nothing while one is present.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pandas as pd

from gdnviz.probes import budget, rates, scan
from gdnviz.ui.sweeps import done_text, to_run_text, unread_cells

BY = {"layer": "one layer at a time", "head": "one head at a time"}


def model_ns(info: dict) -> SimpleNamespace:
    """A ModelInfo-like namespace of an inspected model (what the memo keys and validators read)."""
    return SimpleNamespace(**{**info, "gdn_layers": tuple(info["gdn_layers"]),
                              "attn_layers": tuple(info.get("attn_layers", ()))})


def scan_plan_text(plan: dict, n: int) -> str:
    return (f"{plan['units']} units → {plan['settings']} settings (the baseline included) × {n} samples = "
            f"**{plan['answers']:,} answers**: {done_text(plan['cells'])}, {to_run_text(plan)}")


def _memo(cells) -> str:
    if any(c["cached"] is not None for c in cells):
        return done_text(cells)
    return f"too many prompts to build on this page: the job reads the memo for {unread_cells(cells)}"


def budget_plan_text(plan: dict) -> str:
    """The budget's preview (``budget.plan_budget``): the cells whose prompts the page did not build are named, and
    the time then counts their answers as not in the memo."""
    ho = (f"{plan['heldout_cached']:,} in the memo" if plan["heldout_cached"] is not None
          else _memo(plan["heldout_cells"]))
    unread = plan["scan_cached"] is None or plan["heldout_cached"] is None
    what = "for the most the search can need" + (", none of the answers the page did not count taken as in the "
                                                 "memo" if unread else "")
    return (f"Sensitivity scans {plan['scan_answers']:,} answers ({_memo(plan['scan_cells'])}) "
            f"+ the search, at most {plan['search_max']:,} + the held-out check {plan['heldout_answers']:,} "
            f"({ho}): **at most {plan['max_to_run']:,} to run**, "
            f"{rates.eta_text(plan, plan['max_to_run'])}" + (f" ({what})" if plan["seconds"] else ""))


def over_limit(to_run: int, limit: int, what: str, counted: bool = True) -> str | None:
    """The message for ``to_run`` answers over the prompt limit; ``counted`` False: the memo was not read (the
    count is an upper bound)."""
    if to_run <= limit:
        return None
    return (f"This {what} would run {'' if counted else 'up to '}{to_run:,} answers"
            + ("" if counted else " (the job reads the memo's share when it starts)")
            + f", over the prompt limit of {limit:,}. Lower n, narrow it to fewer layers, or raise the limit if you "
              "mean to run it.")


def layers_that_matter(table: pd.DataFrame, min_points: float = 5.0) -> list[int]:
    """Layers of a layer scan whose |delta| is at least ``min_points`` and at least twice its paired SE (noise
    below that, seed 000: "differences under about five points are noise" at n = 50)."""
    out = []
    for _, x in table.iterrows():
        se = 0.0 if pd.isna(x["se"]) else float(x["se"])
        if abs(float(x["delta"])) >= max(min_points, 2 * se):
            out.append(int(x["layer"]))
    return sorted(set(out))


def ranked_view(table: pd.DataFrame, keep: bool) -> pd.DataFrame:
    """The ranked table with readable columns (same numbers as scan.csv)."""
    t = scan.ranked(table, keep)
    unit = [f"layer {l}" if pd.isna(h) else f"{l}:{h}" for l, h in zip(t["layer"], t["head"])]
    return pd.DataFrame({"unit": unit, "score (%)": t["score"], "baseline (%)": t["baseline"],
                         "Δ (points)": t["delta"], "paired SE (points)": t["se"], "n": t["n"], "r": t["r"]})


def memory_view(summary: dict) -> pd.DataFrame:
    rows = [dict(layer=int(x["layer"]), ranks=x["ranks"], full_KiB=x["full_bytes"] / 1024,
                 budget_KiB=x["budget_bytes"] / 1024) for x in summary["per_layer"]]
    return pd.DataFrame(rows)


def tests_view(summary: dict) -> pd.DataFrame:
    rows = []
    for which, key in (("search", "tasks"), ("held-out", "heldout")):
        for name, x in summary[key].items():
            rows.append({"samples": which, "task @ length": name, "n": x["n"], "untouched (%)": x["untouched"],
                         "budget (%)": x["score"], "Δ (points)": x["delta"], "paired SE": x["se"],
                         "lower bound": x["bound"], f"within δ = {summary['tolerance']:g}": bool(x["passed"])})
    return pd.DataFrame(rows)


def sweeps_line(name: str, summary: dict) -> str:
    """A Sweeps-page rank-map line for a budget (``gdnviz.ui.sweeps.parse_rank_maps`` reads it back)."""
    ranks = summary["rank_map"]
    if not ranks:
        return ""
    return f"{name}: " + ", ".join(f"{l}:{h}:{r}" for l, h, r in ranks)


def map_name(filename: str) -> str:
    """A Sweeps-page rank-map name from a file name (letters, digits, '_', '-', '.'; at most 40)."""
    import re

    stem = filename.rsplit("/", 1)[-1].rsplit(".", 1)[0]
    return (re.sub(r"[^A-Za-z0-9_.\-]+", "_", stem).strip("_") or "imported")[:40]


def budget_name(summary: dict) -> str:
    return f"budget_d{summary['tolerance']:g}".replace(".", "_")


def saved_text(summary: dict) -> str:
    f = summary["state_saved_fraction"]
    return f"{100 * f:.1f}% less" if math.isfinite(f) else ""


def parse_tolerances(text: str) -> list[float]:
    """'1, 2, 5' → [1.0, 2.0, 5.0] (order kept, repeats dropped); ValueError naming a bad or non-positive entry."""
    out = []
    for tok in [t for t in str(text or "").replace(";", ",").split(",") if t.strip()]:
        try:
            v = float(tok)
        except ValueError:
            raise ValueError(f"Tolerances are numbers of points: {tok.strip()!r} is not one.") from None
        if not math.isfinite(v) or v <= 0:
            raise ValueError(f"A tolerance must be > 0 points: {tok.strip()} is not (δ = 0 asks for a budget that "
                             "provably changes nothing, which no finite n can show).")
        if v not in out:
            out.append(v)
    return out


def budget_memory(info: dict, ranks: dict) -> pd.DataFrame:
    return budget.state_memory(model_ns(info), ranks)
