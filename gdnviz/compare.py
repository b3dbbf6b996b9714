"""Two runs side by side: two models on the same documents, or one model on two document sets.

Frames and Altair charts (pure functions of head tables, ``summary.document_set_table``, and sweep tables,
``probes.sweep.table_frame``); the difference is always B − A. A head-by-head comparison needs the same grid of
GDN layers × heads; ``grid_mismatch`` says in words why two runs do not have it. ``comparison_figures`` builds the
figures of a comparison as the Compare page shows them and ``comparison_zip`` writes them, their data and the sweep
tables into one zip.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import altair as alt
import numpy as np
import pandas as pd

from gdnviz import figures as F

RUN_COLORS = ("#1f77b4", "#d62728")  # run A, run B
SWEEP_KEYS = ["task", "length", "setting", "r"]


def grid_mismatch(model_a: dict, model_b: dict) -> str | None:
    """None when both runs' models have the same GDN layer indices, heads per layer and state shape (d_k × d_v);
    else one sentence naming each run's values."""
    def grid(m):
        return list(m["gdn_layers"]), int(m["num_heads"]), (int(m["d_k"]), int(m["d_v"]))

    (la, ha, sa), (lb, hb, sb) = grid(model_a), grid(model_b)
    parts = []
    if la != lb:
        parts.append(f"GDN layers {la} vs {lb}")
    if ha != hb:
        parts.append(f"{ha} vs {hb} heads per layer")
    if sa != sb:
        parts.append(f"states {sa[0]}×{sa[1]} vs {sb[0]}×{sb[1]}")
    if not parts:
        return None
    return "The two runs' models have different head grids (" + "; ".join(parts) + "): a head-by-head difference " \
           "is not defined. The overlaid scatter below still compares them."


def difference_frame(table_a: pd.DataFrame, table_b: pd.DataFrame, metric: str) -> pd.DataFrame:
    """layer, head, a, b (the medians over each run's documents), value = b − a, for heads in both tables.
    Raises ``KeyError`` naming a metric missing from either table."""
    for name, t in (("A", table_a), ("B", table_b)):
        if metric not in t:
            raise KeyError(f"run {name}'s head table has no column {metric!r}")
    a = table_a[["layer", "head", metric]].rename(columns={metric: "a"})
    b = table_b[["layer", "head", metric]].rename(columns={metric: "b"})
    df = a.merge(b, on=["layer", "head"], how="inner")
    df["layer"], df["head"] = df["layer"].astype(int), df["head"].astype(int)
    df["value"] = df["b"] - df["a"]
    df["metric"] = metric
    return df


def difference_heatmap(df: pd.DataFrame, metric: str, labels: tuple[str, str]):
    """B − A on the layer × head grid, a diverging scale symmetric about 0 (blue: B higher, red: B lower)."""
    label = F.HEATMAP_METRICS.get(metric, (metric,))[0]
    v = df["value"].to_numpy(float)
    v = v[np.isfinite(v)]
    m = float(np.abs(v).max()) if v.size and np.abs(v).max() > 0 else 1.0
    fmt = F._fmt(metric)
    color = alt.Color("value:Q", title=["B − A", F.SHORT_LABELS.get(metric, metric)],
                      scale=alt.Scale(scheme="redblue", domain=[-m, m], domainMid=0),
                      legend=alt.Legend(orient="right", gradientLength=180, titleLimit=0, format=",.3~g"))
    tooltip = [alt.Tooltip("layer:O"), alt.Tooltip("head:O"), alt.Tooltip("a:Q", title=f"A: {labels[0]}", format=fmt),
               alt.Tooltip("b:Q", title=f"B: {labels[1]}", format=fmt),
               alt.Tooltip("value:Q", title="B − A", format="+" + fmt.lstrip(","))]
    return F._grid(df, color, tooltip, f"B − A: {label}",
                   [f"A = {labels[0]}", f"B = {labels[1]}", "medians over each run's documents"], selected=None,
                   picked=(), interactive=False)


def overlay_frame(tables: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """run, layer, head, erank, horizon (finite, > 0) of every run's heads, stacked."""
    rows = []
    for name, t in tables.items():
        d = t[["layer", "head", "erank", "horizon"]].copy()
        d = d[np.isfinite(d["horizon"]) & (d["horizon"] > 0) & (d["erank"] > 0)]
        d.insert(0, "run", name)
        rows.append(d)
    return pd.concat(rows, ignore_index=True) if rows else pd.DataFrame(columns=["run", "layer", "head", "erank",
                                                                                 "horizon"])


def overlay_scatter(df: pd.DataFrame, rho: Mapping[str, str], rank_max: int | None = None, paired: bool = False):
    """Effective rank vs horizon (log–log) of both runs, one colour and shape per run; ``rho`` maps each run to
    its Spearman ρ text (``figures.rho_text``), shown in the subtitle. ``paired`` (same head grid): a grey segment
    joins each head's A and B points."""
    runs = list(dict.fromkeys(df["run"]))
    xlo = float(df["horizon"].min()) / 1.25 if len(df) else 0.8
    xhi = float(df["horizon"].max()) * 1.6 if len(df) else 10.0
    ylo = min(float(df["erank"].min()), 1.0) / 1.25 if len(df) else 0.8
    yhi = float(rank_max * 1.25) if rank_max else (float(df["erank"].max()) * 1.5 if len(df) else 10.0)
    xs = alt.Scale(type="log", domain=[xlo, xhi], nice=False)
    ys = alt.Scale(type="log", domain=[ylo, yhi], nice=False)
    pts = alt.Chart(df).mark_point(size=60, filled=True, opacity=0.8).encode(
        x=alt.X("horizon:Q", scale=xs, axis=F.log_axis(xlo, xhi, "decay horizon 1/(1 − ᾱ) (tokens, log scale)")),
        y=alt.Y("erank:Q", scale=ys, axis=F.log_axis(ylo, yhi, "effective rank (directions, log scale)")),
        color=alt.Color("run:N", title="run", scale=alt.Scale(domain=runs, range=list(RUN_COLORS[:len(runs)])),
                        legend=alt.Legend(orient="bottom", direction="vertical")),
        shape=alt.Shape("run:N", scale=alt.Scale(domain=runs, range=["circle", "triangle-up"]), legend=None),
        tooltip=["run", alt.Tooltip("layer:O"), alt.Tooltip("head:O"),
                 alt.Tooltip("erank:Q", title="erank", format=".2f"),
                 alt.Tooltip("horizon:Q", title="horizon (tokens)", format=",.1f")])
    lo, hi = max(xlo, ylo), min(xhi, yhi)
    diag = alt.Chart(pd.DataFrame({"x": [lo, hi], "y": [lo, hi]})).mark_line(
        color="#888", strokeDash=[4, 4], clip=True).encode(x=alt.X("x:Q", scale=xs), y=alt.Y("y:Q", scale=ys))
    layers = [diag, pts]
    if paired and len(runs) == 2:
        pair = df.assign(pair=df["layer"].astype(str) + ":" + df["head"].astype(str))
        seg = alt.Chart(pair).mark_line(color="#bbbbbb", strokeWidth=1).encode(
            x=alt.X("horizon:Q", scale=xs), y=alt.Y("erank:Q", scale=ys), detail="pair:N",
            order=alt.Order("run:N"))
        layers.insert(1, seg)
    sub = ["one point per head (median over its run's documents) · dashed: y = x"
           + (" · grey: the same head in A and B" if paired and len(runs) == 2 else "")] + \
          [f"{'AB'[i]}: Spearman ρ = {rho.get(r, 'n/a')}" for i, r in enumerate(runs)]
    return F.configure(alt.layer(*layers).properties(width=480, height=360, title=alt.Title(
        "Effective rank vs decay horizon, two runs", subtitle=sub)))


def sweep_difference(table_a: pd.DataFrame, table_b: pd.DataFrame) -> pd.DataFrame:
    """The cells (task, length, setting, r) both sweeps measured: score_a, score_b, Δ = score_b − score_a (points),
    n_a, n_b. Each score is a mean over its own n samples; Δ is not a paired difference."""
    cols = SWEEP_KEYS + ["score", "n"]
    a = table_a[[c for c in cols if c in table_a]].copy()
    b = table_b[[c for c in cols if c in table_b]].copy()
    keys = [k for k in SWEEP_KEYS if k in a and k in b]
    df = a.merge(b, on=keys, suffixes=("_a", "_b"), how="inner")
    df["delta"] = df["score_b"] - df["score_a"]
    return df.sort_values(keys).reset_index(drop=True)


def run_name(run: dict) -> str:
    """"<model> · <first document> (+k)" — enough to tell two runs apart in a legend."""
    model = Path(str(run.get("model_name", "?"))).name or "?"
    docs = [d.get("name", "?") for d in run.get("documents", [])]
    more = f" +{len(docs) - 1}" if len(docs) > 1 else ""
    return f"{model} · {docs[0] if docs else 'no documents'}{more}"


def comparison_figures(runs: tuple[dict, dict], tables: tuple[pd.DataFrame, pd.DataFrame],
                       overviews: tuple[dict, dict], metric: str) -> dict[str, tuple]:
    """The figures of runs A and B (stored run records) as the Compare page shows them, in its order, as
    {name: (chart, its data)} with the names of their downloads: ``compare_A_<metric>`` and ``compare_B_<metric>``
    (the heatmaps of ``metric`` on one colour scale), ``compare_diff_<metric>`` (B − A; only when
    ``grid_mismatch`` is None), ``compare_erank_vs_horizon`` (both runs overlaid). ``tables``: the runs' head tables;
    ``overviews``: their ``summary.overview``."""
    (run_a, run_b), (ta, tb) = runs, tables
    la, lb = run_name(run_a), run_name(run_b)
    da, db = F.heatmap_frame(ta, metric), F.heatmap_frame(tb, metric)
    both = np.concatenate([da["value"].to_numpy(float), db["value"].to_numpy(float)])
    both = both[np.isfinite(both) & ((both > 0) if F.HEATMAP_METRICS[metric][1] == "log" else True)]
    dom = (float(both.min()), float(both.max())) if both.size else None
    out = {f"compare_{tag}_{metric}": (F.heatmap(d, metric, interactive=False, color_domain=dom,
                                                  title=f"{tag}: {lab}"), d)
           for tag, d, lab in (("A", da, la), ("B", db, lb))}
    paired = grid_mismatch(run_a["model"], run_b["model"]) is None
    if paired:
        diff = difference_frame(ta, tb, metric)
        out[f"compare_diff_{metric}"] = (difference_heatmap(diff, metric, (la, lb)), diff)
    if la == lb:
        la, lb = f"A: {la}", f"B: {lb}"
    df = overlay_frame({la: ta, lb: tb})
    rho = {lab: F.rho_text(ov["spearman_erank_horizon"], ov["spearman_ci95"]) for lab, ov in zip((la, lb), overviews)}
    rmax = max(min(int(r["model"]["d_k"]), int(r["model"]["d_v"])) for r in runs)
    out["compare_erank_vs_horizon"] = (overlay_scatter(df, rho, rmax, paired), df)
    return out


def sweep_tables(table_a: pd.DataFrame, table_b: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Two sweeps' tables (``probes.sweep.table_frame``) and their ``sweep_difference``, named as their CSV
    downloads: ``compare_sweep_A``, ``compare_sweep_B``, ``compare_sweep_B_minus_A``."""
    return {"compare_sweep_A": table_a, "compare_sweep_B": table_b,
            "compare_sweep_B_minus_A": sweep_difference(table_a, table_b)}


def comparison_zip(runs: tuple[dict, dict], tables: tuple[pd.DataFrame, pd.DataFrame], overviews: tuple[dict, dict],
                   metric: str, sweeps: tuple[tuple[str, pd.DataFrame], tuple[str, pd.DataFrame]] | None = None, *,
                   scale: float = 2.0, width: int | None = None, height: int | None = None) -> bytes:
    """The comparison as one zip (``figures.run_zip``): ``figures/<name>.png|.svg`` at ``scale`` / ``width`` /
    ``height`` (as ``figures.to_png``) and ``data/<name>.csv`` for each of ``comparison_figures``; with ``sweeps``
    ((job id, table) of sweep A and of sweep B) ``tables/<name>.csv`` for each of ``sweep_tables``; and
    ``settings.json``: both runs (id, model, documents, L), the statistic and the sweeps' job ids."""
    figs = comparison_figures(runs, tables, overviews, metric)
    settings = dict(difference="B − A", metric=metric, runs={tag: dict(
        run_id=r["run_id"], model=r.get("model_name"), documents=[d["name"] for d in r["documents"]],
        segment_len=int(r["segment_len"])) for tag, r in zip("AB", runs)})
    tabs = {}
    if sweeps is not None:
        (ida, sa), (idb, sb) = sweeps
        settings["sweeps"] = {"A": ida, "B": idb}
        tabs = sweep_tables(sa, sb)
    return F.run_zip(figs, settings, tabs, scale=scale, width=width, height=height)
