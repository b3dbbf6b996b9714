"""Figures: tidy DataFrames from captures (``*_frame``) and Altair chart builders (pure functions of DataFrames),
with offline export (``to_png`` / ``to_svg`` through vl-convert) and a whole-run zip (``run_zip``).

Every chart has axis titles with units, a legend where colour means something, and tooltips; the data a chart
draws is exactly the DataFrame it was built from, so "download CSV" is that frame.
"""
from __future__ import annotations

import io
import json
import math
import zipfile
from typing import Iterable, Mapping

import altair as alt
import numpy as np
import pandas as pd

from gdnviz import plotstyle as PS

#: Metrics offered on the heatmap: column of ``summary.document_set_table`` → (label, colour-scale kind).
HEATMAP_METRICS = {
    "erank": ("effective rank (directions)", "linear"),
    "numerical_rank": ("numerical rank (σ above the f32 floor)", "linear"),
    "stable_rank": ("stable rank ‖S‖²_F / ‖S‖²₂", "linear"),
    "energy_rank99": ("smallest r keeping 99% of the energy Σσ²", "linear"),
    "horizon": ("decay horizon 1/(1−ᾱ) (tokens, log scale)", "log"),
    "mean_key_norm": ("key cone: norm of the mean unit key", "linear"),
    "key_cov_erank": ("key-covariance erank inside the horizon", "linear"),
    "decayed_P_erank": ("decayed key covariance P erank (√eig scale)", "linear"),
}
SHORT_LABELS = {"erank": "effective rank", "numerical_rank": "numerical rank", "stable_rank": "stable rank",
                "energy_rank99": "r for 99% energy",
                "horizon": "horizon (tokens)", "mean_key_norm": "mean key norm", "key_cov_erank": "key-cov erank",
                "decayed_P_erank": "decayed-P erank"}
FONT = dict(titleFontSize=13, labelFontSize=11)
#: DejaVu Sans has every glyph used in titles (σ, ᾱ, ⊥, ‖, subscripts); browsers without it use their sans-serif.
FONT_FAMILY = "DejaVu Sans, Liberation Sans, Arial, Helvetica, sans-serif"
F32_EPS = float(np.finfo(np.float32).eps)


def _fmt(metric: str) -> str:
    return ",.0f" if metric in ("numerical_rank", "horizon", "energy_rank99") else ".2f"


#: Metrics whose values are integers (drawn with integer ticks).
INTEGER_METRICS = ("numerical_rank", "energy_rank99")


def layer_scale(layers: Iterable[int]) -> alt.Scale:
    """Colour scale for layer identity: the qualitative ``plotstyle.layer_colors`` over the layers present, in
    order, so that neighbouring layers never share a colour (viridis made layers 0/1 and 4/5 alike)."""
    dom = sorted({int(x) for x in layers})
    return alt.Scale(domain=dom, range=PS.layer_colors(len(dom)))


def log_axis(lo: float, hi: float, title: str, **kw) -> alt.Axis:
    """A log axis over ``[lo, hi]`` with ``plotstyle.log_ticks`` and one label notation (``plotstyle.log_format``)."""
    t = PS.log_ticks(lo, hi)
    return alt.Axis(values=t, format=PS.log_format(t), title=title, **kw)


def configure(chart, autosize: str = "fit-x"):
    """Shared look. autosize "fit-x": the whole chart (axes, legend) fits the width it is given (the page column,
    or the chart's own width in exports) and keeps its height; "pad" for grids and facets, which keep their size."""
    chart = chart.properties(autosize=alt.AutoSizeParams(type=autosize, contains="padding"))
    # one configure call: each configure_* copies the chart
    return chart.configure(font=FONT_FAMILY, axis=alt.AxisConfig(**FONT),
                           legend=alt.LegendConfig(**FONT, labelLimit=320, titleLimit=0),
                           title=alt.TitleConfig(fontSize=14, anchor="start"), view=alt.ViewConfig(strokeWidth=0))


# =============================================================================================================
# frames (captures → tidy DataFrames)
# =============================================================================================================
def heatmap_frame(table: pd.DataFrame, metric: str) -> pd.DataFrame:
    """layer, head, value (median over documents), min, max, n_docs for one metric of a document-set table."""
    df = pd.DataFrame({"layer": table["layer"].astype(int), "head": table["head"].astype(int),
                       "value": table[metric].astype(float)})
    df["min"] = table.get(f"{metric}_min", table[metric]).astype(float)
    df["max"] = table.get(f"{metric}_max", table[metric]).astype(float)
    df["n_docs"] = table["n_docs"].astype(int) if "n_docs" in table else 1
    df["metric"] = metric
    return df


def spectrum_frame(captures, names, li: int, head: int) -> pd.DataFrame:
    """Singular values of the head's state at each document's end: document, index (1-based), sigma, and per
    document the f32 floor, numerical rank and effective rank."""
    from gdnviz.analysis import spectra

    rows = []
    for cap, name in zip(captures, names):
        sv = cap.sv[-1, li, head].astype(np.float64)
        floor = float(spectra.numerical_rank_threshold(sv))
        nr = int(spectra.numerical_rank(sv))
        er = float(spectra.effective_rank(sv))
        for i, s in enumerate(sv):
            rows.append(dict(document=name, index=i + 1, sigma=float(s), floor=floor, numerical_rank=nr, erank=er,
                             position=int(cap.positions[-1])))
    return pd.DataFrame(rows)


def erank_along_frame(captures, names, li: int, head: int) -> pd.DataFrame:
    """Effective, numerical and stable rank of the head's state at every recorded boundary, per document."""
    from gdnviz.analysis import spectra

    rows = []
    for cap, name in zip(captures, names):
        sv = cap.sv[:, li, head].astype(np.float64)  # [NB, n]
        er, nr, sr = spectra.effective_rank(sv), spectra.numerical_rank(sv), spectra.stable_rank(sv)
        for b, pos in enumerate(cap.positions):
            rows.append(dict(document=name, position=int(pos), erank=float(np.atleast_1d(er)[b]),
                             numerical_rank=int(np.atleast_1d(nr)[b]), stable_rank=float(np.atleast_1d(sr)[b])))
    return pd.DataFrame(rows)


def alpha_frame(captures, names, li: int, head: int, bins: int = 40) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Histogram of per-token 1 − α on log-spaced bins (per document) and per-document ᾱ / horizon."""
    rows, stats = [], []
    all_one_minus = np.concatenate([-np.expm1(c.g[li, head].astype(np.float64)) for c in captures])
    pos = all_one_minus[all_one_minus > 0]
    lo = max(float(pos.min()) if pos.size else 1e-6, 1e-9)
    hi = max(float(all_one_minus.max()), lo * 10)
    edges = np.logspace(math.log10(lo) - 1e-9, math.log10(hi) + 1e-9, bins + 1)
    for cap, name in zip(captures, names):
        g = cap.g[li, head].astype(np.float64)
        om = np.clip(-np.expm1(g), edges[0], edges[-1])
        counts, _ = np.histogram(om, bins=edges)
        for a, b, c in zip(edges[:-1], edges[1:], counts):
            rows.append(dict(document=name, one_minus_alpha_lo=a, one_minus_alpha_hi=b, alpha_lo=1 - b,
                             alpha_hi=1 - a, tokens=int(c), share=float(c) / max(1, len(g))))
        abar = float(np.exp(g).mean())
        stats.append(dict(document=name, mean_alpha=abar, one_minus_mean_alpha=1 - abar,
                          horizon=float(1.0 / (1.0 - abar)) if abar < 1 else float("inf"),
                          mean_beta=float(cap.beta[li, head].astype(np.float64).mean()), n_tokens=len(g)))
    return pd.DataFrame(rows), pd.DataFrame(stats)


def keycone_frame(capture, li: int, head: int) -> tuple[pd.DataFrame, dict]:
    """A 2-D view of the head's sampled unit keys: x = cosine with the mean key direction, y = coordinate along
    the top principal direction of the keys' components orthogonal to it. Returns (points, axis info)."""
    k = capture.key_sample[li, head].astype(np.float64)  # [S, K]
    pos = capture.key_sample_pos.astype(np.int64)
    mu = capture.key_mean[li, head].astype(np.float64)
    mnorm = float(np.linalg.norm(mu))
    u = mu / mnorm if mnorm > 0 else np.eye(k.shape[1])[0]
    x = k @ u
    resid = k - np.outer(x, u)
    resid_c = resid - resid.mean(0)
    if np.allclose(resid_c, 0):
        v, share = np.eye(k.shape[1])[1 % k.shape[1]], 0.0
    else:
        _, s, vt = np.linalg.svd(resid_c, full_matrices=False)
        v = vt[0]
        share = float(s[0] ** 2 / np.sum(s ** 2))
    y = resid @ v
    df = pd.DataFrame(dict(position=pos, cos_to_mean=x, orth_pc1=y, norm=np.linalg.norm(k, axis=1)))
    return df, dict(mean_key_norm=mnorm, orth_var_share=share)


def energy_frame(captures, names, li: int, head: int, share: float = 0.99) -> pd.DataFrame:
    """Energy kept by the rank-r truncation of the head's state at each document's end: document, r (1..n),
    energy = Σ_{i≤r} σ_i² / Σ σ_i² (``spectra.energy_curve``), and per document r_share, the smallest r keeping
    ``share`` of it (``spectra.rank_for_energy``)."""
    from gdnviz.analysis import spectra

    rows = []
    for cap, name in zip(captures, names):
        sv = cap.sv[-1, li, head].astype(np.float64)
        cum = spectra.energy_curve(sv)
        r_need = int(spectra.rank_for_energy(sv, share))
        rows += [dict(document=name, r=i + 1, energy=float(e), r_share=r_need) for i, e in enumerate(cum)]
    return pd.DataFrame(rows, columns=["document", "r", "energy", "r_share"])


def energy_chart(df: pd.DataFrame, share: float = 0.99, marked_r: Iterable[int] = ()):
    """Energy kept vs r (log x) per document, the ``share`` line, and each document's smallest r reaching it
    (dotted rule); ``marked_r`` adds grey ticks at ranks of interest (e.g. seed 000's 1, 4, 12, 32)."""
    n = int(df["r"].max()) if len(df) else 128
    xs = alt.Scale(type="log", domain=[1, n], nice=False)
    lines = alt.Chart(df).mark_line(point=alt.OverlayMarkDef(size=12)).encode(
        x=alt.X("r:Q", scale=xs, axis=log_axis(1, n, "rank r kept (directions, log scale)")),
        y=alt.Y("energy:Q", title="energy kept: share of Σσ² in the top r", scale=alt.Scale(domain=[0, 1]),
                axis=alt.Axis(format="%")),
        color=alt.Color("document:N", title="document", legend=alt.Legend(orient="bottom", columns=2)),
        tooltip=["document", alt.Tooltip("r:Q", title="r"), alt.Tooltip("energy:Q", title="energy kept",
                                                                       format=".4%")])
    q = pd.DataFrame({"y": [share], "label": [f"{100 * share:g}%"]})
    qline = alt.Chart(q).mark_rule(color="#888", strokeDash=[4, 3]).encode(y="y:Q")
    need = df.drop_duplicates("document")
    rules = alt.Chart(need).mark_rule(strokeDash=[2, 2]).encode(
        x=alt.X("r_share:Q", scale=xs), color=alt.Color("document:N", legend=None),
        tooltip=["document", alt.Tooltip("r_share:Q", title=f"smallest r keeping {100 * share:g}%")])
    layers = [qline, lines, rules]
    if list(marked_r):
        m = pd.DataFrame({"r": [int(r) for r in marked_r if 1 <= int(r) <= n]})
        layers.insert(0, alt.Chart(m).mark_rule(color="#ddd").encode(x=alt.X("r:Q", scale=xs)))
    med = float(np.median(need["r_share"])) if len(need) else float("nan")
    sub = [f"dashed: {100 * share:g}% of Σσ² · dotted: each document's smallest r keeping it",
           f"median over {len(need)} document{'s' if len(need) != 1 else ''}: r = {med:g}"]
    return configure(alt.layer(*layers).properties(width=480, height=260, title=alt.Title(
        "Energy kept by rank-r truncation at the document end", subtitle=sub)))


def keycone_ceiling_chart(table: pd.DataFrame):
    """Seed 000 §2, the key cone's ceiling: mean key norm and key-covariance erank (rows) against the state's
    effective rank and the decay horizon (columns, horizon on a log axis), one point per head (medians over
    documents), coloured by layer. Long-horizon heads with a narrow cone (norm near 1, key-cov erank of a few)
    are the ones whose erank plateaus."""
    cols = ["layer", "head", "erank", "horizon", "mean_key_norm", "key_cov_erank"]
    df = table[cols].copy()
    df = df[np.isfinite(df["horizon"]) & (df["horizon"] > 0)]
    hlo = float(df["horizon"].min()) / 1.25 if len(df) else 1.0
    hhi = float(df["horizon"].max()) * 1.25 if len(df) else 10.0
    color = alt.Color("layer:O", title="layer", scale=layer_scale(df["layer"]))
    tooltip = [alt.Tooltip("layer:O"), alt.Tooltip("head:O"), alt.Tooltip("erank:Q", format=".2f"),
               alt.Tooltip("horizon:Q", title="horizon (tokens)", format=",.1f"),
               alt.Tooltip("mean_key_norm:Q", title="mean key norm", format=".3f"),
               alt.Tooltip("key_cov_erank:Q", title="key-cov erank", format=".2f")]
    xs = {"erank": alt.X("erank:Q", title="effective rank of the state (directions)",
                         scale=alt.Scale(zero=True)),
          "horizon": alt.X("horizon:Q", scale=alt.Scale(type="log", domain=[hlo, hhi], nice=False),
                           axis=log_axis(hlo, hhi, "decay horizon 1/(1 − ᾱ) (tokens, log scale)"))}
    ys = {"mean_key_norm": alt.Y("mean_key_norm:Q", title="mean key norm ‖mean unit key‖",
                                 scale=alt.Scale(domain=[0, 1])),
          "key_cov_erank": alt.Y("key_cov_erank:Q", title="key-covariance erank (directions)",
                                 scale=alt.Scale(zero=True))}
    rows = []
    for y in ys.values():
        rows.append(alt.hconcat(*[alt.Chart(df).mark_circle(size=50, opacity=0.85).encode(
            x=x, y=y, color=color, tooltip=tooltip).properties(width=260, height=200) for x in xs.values()]))
    n_docs = int(table["n_docs"].max()) if "n_docs" in table and len(table) else 1
    over = f"median over {n_docs} documents" if n_docs != 1 else "one document"
    return configure(alt.vconcat(*rows).properties(title=alt.Title(
        "The key cone's ceiling", subtitle=[f"one point per head ({over})",
                                           "norm near 1 and a key-cov erank of a few: a narrow cone caps the rank"])),
        "pad")


def per_document_frame(captures, names, li: int, head: int) -> pd.DataFrame:
    """Long frame metric × document of the head's statistics (for the per-document spread)."""
    from gdnviz.summary import head_table

    rows = []
    labels = SHORT_LABELS
    for cap, name in zip(captures, names):
        r = head_table(cap, only=(li, head)).iloc[0]
        for m in HEATMAP_METRICS:
            rows.append(dict(document=name, metric=m, label=labels[m], value=float(r[m])))
    return pd.DataFrame(rows)


def cache_budget_frame(*, n_gdn: int, h_v: int, h_k: int, d_k: int, d_v: int, n_attn: int, h_kv: int, d_h: int,
                       conv_kernel: int, batch: int, b_state: float, b_kv: float, b_conv: float,
                       contexts: Iterable[int]) -> pd.DataFrame:
    """Bytes of each cache vs context length T (seed 003 §7).

    recurrent = B·|GDN|·H_v·d_k·d_v·b_state (constant in T); KV = B·|attn|·2·H_kv·d_h·T·b_KV;
    conv = B·|GDN|·(2·H_k·d_k + H_v·d_v)·conv_kernel·b_conv (the short-convolution window, constant in T).
    """
    rows = []
    rec = batch * n_gdn * h_v * d_k * d_v * b_state
    conv = batch * n_gdn * (2 * h_k * d_k + h_v * d_v) * conv_kernel * b_conv
    for T in contexts:
        kv = batch * n_attn * 2 * h_kv * d_h * T * b_kv
        for cache, b in (("GDN recurrent state", rec), ("full-attention KV", kv), ("GDN conv window", conv),
                         ("total", rec + kv + conv)):
            rows.append(dict(context=int(T), cache=cache, bytes=float(b), GiB=float(b) / 2 ** 30))
    return pd.DataFrame(rows)


def crossover_context(*, n_gdn, h_v, d_k, d_v, n_attn, h_kv, d_h, b_state, b_kv, **_) -> float:
    """Context length T at which the full-attention KV equals the recurrent state (inf without attention)."""
    per_token = n_attn * 2 * h_kv * d_h * b_kv
    return float("inf") if per_token == 0 else n_gdn * h_v * d_k * d_v * b_state / per_token


# =============================================================================================================
# charts
# =============================================================================================================
def _grid(df: pd.DataFrame, color, tooltip: list, title: str, subtitle: str, *, selected: tuple | None,
          picked: Iterable, interactive: bool):
    """The layer × head grid of ``heatmap`` and ``scan_heatmap``: ``df`` has layer, head and the colour's fields;
    click selection param ``cell`` (fields layer, head); the open head framed black, the truncation set orange."""
    n_heads = int(df["head"].max()) + 1 if len(df) else 1
    picked = {tuple(map(int, p)) for p in picked} if interactive else set()
    df = df.copy()
    sel_t = None if selected is None or not interactive else (int(selected[0]), int(selected[1]))
    df["frame"] = ["open head" if (l, h) == sel_t else "truncation set" if (l, h) in picked else "none"
                   for l, h in zip(df["layer"].astype(int), df["head"].astype(int))]
    frames = ["open head", "truncation set", "none"]
    # framed cells drawn last: a cell drawn after a framed neighbour would cover half of its frame
    df = df.iloc[np.argsort(df["frame"].map({"none": 0, "truncation set": 1, "open head": 2}).to_numpy(),
                            kind="stable")]
    enc = dict(
        x=alt.X("head:O", title="value head", axis=alt.Axis(labelAngle=0)),
        y=alt.Y("layer:O", title="layer (model index)", sort="ascending"),
        color=color, tooltip=tooltip,
        stroke=alt.Stroke("frame:N", scale=alt.Scale(domain=frames, range=["black", "#ff7f0e", "white"]),
                          legend=None),
        strokeWidth=alt.StrokeWidth("frame:N", scale=alt.Scale(domain=frames, range=[3.5, 2.5, 0.5]),
                                    legend=None),
    )
    chart = alt.Chart(df).mark_rect().encode(**enc)
    if interactive:
        sel = alt.selection_point(name="cell", fields=["layer", "head"], on="click", clear="dblclick",
                                  toggle=False)
        chart = chart.add_params(sel)
    chart = chart.properties(
        width=alt.Step(max(18, min(40, 640 // n_heads))), height=alt.Step(26),
        title=alt.Title(title, subtitle=subtitle, limit=0), usermeta={"embedOptions": {"renderer": "svg"}})
    return configure(chart, "pad")


def _legend_title(metric: str) -> list[str]:
    """The colour legend's title in two short lines: the statistic, then its unit (never cut with "…")."""
    unit = {"horizon": "(tokens, log scale)", "mean_key_norm": "(0 to 1)", "numerical_rank": "(directions)",
            "energy_rank99": "(directions)"}.get(metric, "(directions)")
    name = {"horizon": "decay horizon"}.get(metric, SHORT_LABELS.get(metric, metric))
    return [name, unit]


def heatmap(df: pd.DataFrame, metric: str, *, selected: tuple | None = None, picked: Iterable = (),
            title: str | None = None, interactive: bool = True, color_domain: tuple | None = None,
            subtitle: str | list | None = None):
    """Layer × head grid coloured by ``value`` (median over documents); min–max in the tooltip. Interactive: click
    selection param ``cell`` (fields layer, head), the open head framed black, the truncation set orange, and a
    subtitle saying how to use it (``subtitle``: one line or a list of lines; default: a click shows the head below).
    ``interactive=False`` is the exported figure: no hints, no frames. ``color_domain`` (lo, hi) fixes the colour
    scale (two runs side by side on one scale)."""
    label, scale = HEATMAP_METRICS.get(metric, (metric, "linear"))
    fmt = _fmt(metric)
    vals = df["value"].to_numpy(float) if len(df) else np.array([1.0])
    vals = vals[np.isfinite(vals)]
    if color_domain is not None:
        vals = np.asarray(color_domain, float)
    dom = dict(domain=[float(vals.min()), float(vals.max())]) if color_domain is not None else {}
    if scale == "log" and vals.size and vals.min() > 0:
        lo, hi = float(vals.min()), float(vals.max())
        ticks = PS.log_ticks(lo, hi) if hi > lo else [lo]
        color_scale = alt.Scale(type="log", scheme="viridis", **dom)
        legend = alt.Legend(orient="right", gradientLength=180, titleLimit=0, values=ticks,
                            format=PS.log_format(ticks))
    else:
        color_scale = alt.Scale(scheme="viridis", **dom)
        legend = alt.Legend(orient="right", gradientLength=180, titleLimit=0,
                            format="d" if metric in INTEGER_METRICS else ",.3~g")
    color = alt.Color("value:Q", title=_legend_title(metric), scale=color_scale, legend=legend)
    tooltip = [alt.Tooltip("layer:O", title="layer"), alt.Tooltip("head:O", title="head"),
               alt.Tooltip("value:Q", title=f"median {label}", format=fmt),
               alt.Tooltip("min:Q", title="min over documents", format=fmt),
               alt.Tooltip("max:Q", title="max over documents", format=fmt),
               alt.Tooltip("n_docs:Q", title="documents")]
    n_docs = int(df["n_docs"].max()) if len(df) and "n_docs" in df else 1
    over = f"median over {n_docs} documents" if n_docs != 1 else "one document"
    if not interactive:
        sub = f"{over} (min–max in the CSV)"
    elif subtitle is not None:
        sub = ([subtitle] if isinstance(subtitle, str) else list(subtitle)) + [over]
    else:
        sub = ["click a cell to see that head below", "hover for the min–max over documents", over]
    return _grid(df, color, tooltip, title or label[:1].upper() + label[1:], sub, selected=selected, picked=picked,
                 interactive=interactive)


def scan_heatmap_frame(table: pd.DataFrame, gdn_layers: Iterable[int], num_heads: int) -> pd.DataFrame:
    """A scan table (``gdnviz.probes.scan.TABLE_COLUMNS``) on the layer × head grid: layer, head, unit ("layer 5"
    or "5:1"), value = delta, se, score, baseline, n, r. A layer row fills every head of its layer; heads the scan
    did not cover are absent (blank cells)."""
    rows = []
    for _, x in table.iterrows():
        heads = range(int(num_heads)) if pd.isna(x["head"]) else [int(x["head"])]
        unit = f"layer {int(x['layer'])}" if pd.isna(x["head"]) else f"{int(x['layer'])}:{int(x['head'])}"
        for h in heads:
            rows.append(dict(layer=int(x["layer"]), head=h, unit=unit, value=float(x["delta"]),
                             se=float(x["se"]) if pd.notna(x["se"]) else float("nan"), score=float(x["score"]),
                             baseline=float(x["baseline"]), n=int(x["n"]), r=int(x["r"])))
    return pd.DataFrame(rows, columns=["layer", "head", "unit", "value", "se", "score", "baseline", "n", "r"])


def scan_heatmap(df: pd.DataFrame, *, keep: bool, title: str, selected: tuple | None = None,
                 interactive: bool = True):
    """Δscore of a scan on the layer × head grid, a diverging scale centred at 0 (red: the unit's setting scores
    below the baseline, blue: above), symmetric about 0; the paired SE, scores and n in the tooltip."""
    m = max(1.0, float(np.nanmax(np.abs(df["value"].to_numpy(float)))) if len(df) else 1.0)
    what = "keeping it whole vs all cut" if keep else "cutting it vs untouched"
    color = alt.Color("value:Q", title=["Δ score", "(points)"],
                      scale=alt.Scale(scheme="redblue", domain=[-m, m], domainMid=0),
                      legend=alt.Legend(orient="right", gradientLength=180))
    tooltip = [alt.Tooltip("unit:N", title="unit (layer or layer:head)"), alt.Tooltip("layer:O", title="layer"),
               alt.Tooltip("head:O", title="head"),
               alt.Tooltip("value:Q", title=f"Δ score, {what} (points)", format="+.1f"),
               alt.Tooltip("se:Q", title="paired SE (points)", format=".1f"),
               alt.Tooltip("score:Q", title="score (%)", format=".1f"),
               alt.Tooltip("baseline:Q", title="baseline score (%)", format=".1f"),
               alt.Tooltip("n:Q", title="samples n"), alt.Tooltip("r:Q", title="r")]
    n = int(df["n"].max()) if len(df) else 0
    sub = f"Δ = mean over the same {n} samples of (score − baseline); red: lower, blue: higher"
    if interactive:
        sub += " · click a cell to see that head below · hover for the paired SE"
    return _grid(df, color, tooltip, title, sub, selected=selected, picked=(), interactive=interactive)


def spectrum_chart(df: pd.DataFrame, document: str | None = None):
    """Singular values of one head's state (log scale) with the f32 floor (dashed), the numerical rank and the
    effective rank (vertical rules), for one document (``document``) or all (lines coloured by document)."""
    d = df if document is None else df[df.document == document]
    one = d.drop_duplicates("document")
    # σ = 0 has no place on a log axis (a rank-1 head has 127 of them: the Gram route's eigenvalues below its
    # resolution are clamped to 0); they stay in the CSV and the subtitle counts them
    zeros = int((d["sigma"] <= 0).sum()) if len(d) else 0
    n_max = int(d["index"].max()) if len(d) else 2
    d = d[d["sigma"] > 0]
    slo, shi = (float(d["sigma"].min()), float(d["sigma"].max())) if len(d) else (1.0, 1.0)
    flo = float(one["floor"].min()) if len(one) and (one["floor"] > 0).any() else slo
    slo = min(slo, flo)
    lines = alt.Chart(d).mark_line(point=alt.OverlayMarkDef(size=18)).encode(
        x=alt.X("index:Q", title="singular value index i (descending)",
                scale=alt.Scale(domain=[1, n_max], nice=False)),
        y=alt.Y("sigma:Q", scale=alt.Scale(type="log"), axis=log_axis(slo, shi, "singular value σ_i (log scale)")),
        color=alt.Color("document:N", title="document", legend=alt.Legend(orient="bottom", columns=2)),
        tooltip=["document", alt.Tooltip("index:Q", title="i"), alt.Tooltip("sigma:Q", title="σ_i", format=".3e")])
    floor = alt.Chart(one).mark_rule(strokeDash=[6, 3], color="#d62728").encode(
        y="floor:Q", tooltip=[alt.Tooltip("floor:Q", title="f32 floor σ_max·128·ε", format=".3e"), "document"])
    floor_txt = alt.Chart(one.head(1)).mark_text(align="left", dx=4, dy=-6, color="#d62728", fontSize=11).encode(
        x=alt.value(4), y="floor:Q", text=alt.value("f32 floor σ_max·128·ε"))
    nr = alt.Chart(one).mark_rule(color="#7f7f7f", strokeDash=[2, 2]).encode(
        x="numerical_rank:Q", tooltip=["document", alt.Tooltip("numerical_rank:Q", title="numerical rank")])
    er = alt.Chart(one).mark_rule(color="#2ca02c", strokeWidth=2).encode(
        x="erank:Q", tooltip=["document", alt.Tooltip("erank:Q", title="effective rank", format=".2f")])
    lab = one.head(1).copy()
    # labels right of their rule when the rule is in the left half (a rank-1 head: left of it is the y axis)
    def side(col):
        left = len(lab) and float(lab[col].iloc[0]) > n_max / 2
        return dict(align="right", dx=-3) if left else dict(align="left", dx=3)

    nr_txt = alt.Chart(lab).mark_text(**side("numerical_rank"), color="#555555", fontSize=11).encode(
        x="numerical_rank:Q", y=alt.value(26),
        text=alt.value(f"numerical rank {int(lab['numerical_rank'].iloc[0])}" if len(lab) else ""))
    er_txt = alt.Chart(lab).mark_text(**side("erank"), color="#2ca02c", fontSize=11).encode(
        x="erank:Q", y=alt.value(10),
        text=alt.value(f"erank {float(lab['erank'].iloc[0]):.1f}" if len(lab) else ""))
    title = "Singular spectrum at the document end"
    sub = ([f"one document: “{document}”"] if document is not None else []) + ["dashed red: the f32 floor σ_max·128·ε", "grey: numerical rank · green: effective rank"]
    if zeros:
        sub += [f"{zeros:,} singular value{'s are' if zeros > 1 else ' is'} 0 (below the resolution √ε_f64·σ_max)",
                "and not drawn on the log axis"]
    return configure(alt.layer(lines, floor, floor_txt, nr, er, nr_txt, er_txt).properties(
        width=480, height=260, title=alt.Title(title, subtitle=sub)))


def erank_along_chart(df: pd.DataFrame, segment_len: int | None = None, metric: str = "erank"):
    """Effective rank of the head's state at every segment boundary, one line per document."""
    label = {"erank": "effective rank", "numerical_rank": "numerical rank", "stable_rank": "stable rank"}[metric]
    ch = alt.Chart(df).mark_line(point=True).encode(
        x=alt.X("position:Q", title="token position of the boundary (tokens)"),
        y=alt.Y(f"{metric}:Q", title=f"{label} (directions)", scale=alt.Scale(zero=True)),
        color=alt.Color("document:N", title="document", legend=alt.Legend(orient="bottom", columns=2)),
        tooltip=["document", alt.Tooltip("position:Q", title="position", format=","),
                 alt.Tooltip("erank:Q", title="effective rank", format=".2f"),
                 alt.Tooltip("numerical_rank:Q", title="numerical rank"),
                 alt.Tooltip("stable_rank:Q", title="stable rank", format=".2f")])
    sub = [f"the state after every {segment_len}-token boundary", "and at the document end"] if segment_len else ""
    return configure(ch.properties(width=480, height=260, title=alt.Title(f"{label.capitalize()} along the document",
                                                                            subtitle=sub)))


def alpha_chart(hist: pd.DataFrame, stats: pd.DataFrame, segment_len: int | None = None):
    """Distribution of per-token 1 − α (log x), per document, with 1 − ᾱ marked (horizon = 1/(1 − ᾱ))."""
    hist = hist.assign(zero=0.0)
    lo = float(hist["one_minus_alpha_lo"].min()) if len(hist) else 1e-4
    hi = float(hist["one_minus_alpha_hi"].max()) if len(hist) else 1.0
    if segment_len:
        lo, hi = min(lo, 0.5 / segment_len), max(hi, 2.0 / segment_len)
    bars = alt.Chart(hist).mark_rect(opacity=0.5).encode(
        x=alt.X("one_minus_alpha_lo:Q", scale=alt.Scale(type="log", domain=[lo, hi], nice=False),
                axis=log_axis(lo, hi, "1 − α per token (log scale; α = exp(g), the decay)")),
        x2="one_minus_alpha_hi:Q",
        y=alt.Y("share:Q", title="share of the document's tokens", stack=None, axis=alt.Axis(format="%")),
        y2="zero:Q",
        color=alt.Color("document:N", title="document", legend=alt.Legend(orient="bottom", columns=2)),
        tooltip=["document", alt.Tooltip("alpha_lo:Q", title="α from", format=".6f"),
                 alt.Tooltip("alpha_hi:Q", title="α to", format=".6f"), alt.Tooltip("tokens:Q", title="tokens"),
                 alt.Tooltip("share:Q", title="share", format=".1%")])
    rule = alt.Chart(stats).mark_rule(strokeWidth=2, strokeDash=[5, 3]).encode(
        x="one_minus_mean_alpha:Q", color=alt.Color("document:N", legend=None),
        tooltip=["document", alt.Tooltip("mean_alpha:Q", title="mean α", format=".6f"),
                 alt.Tooltip("horizon:Q", title="horizon 1/(1−ᾱ) (tokens)", format=",.1f")])
    layers = [bars, rule]
    if segment_len:
        seg = pd.DataFrame({"x": [1.0 / segment_len], "label": [f"1/L (L = {segment_len})"]})
        layers.append(alt.Chart(seg).mark_rule(color="#d62728", strokeDash=[2, 2]).encode(
            x="x:Q", tooltip=[alt.Tooltip("label:N", title="segment")]))
        layers.append(alt.Chart(seg).mark_text(align="left", dx=3, y=8, color="#d62728", fontSize=11).encode(
            x="x:Q", text="label:N"))
    sub = ["dashed: 1 − ᾱ per document (horizon = 1/(1 − ᾱ))",
           "red: 1/L; left of it a token's write outlives a segment"]
    return configure(alt.layer(*layers).properties(width=480, height=260, title=alt.Title(
        "Per-token decay α of this head", subtitle=sub)))


def keycone_chart(df: pd.DataFrame, info: dict | None = None, document: str | None = None):
    """The head's sampled unit keys of one document (named in the title when given) in 2-D: cosine with the mean
    key direction × coordinate along the top principal direction orthogonal to it, coloured by token position."""
    info = info or {}
    sub = [f"{len(df)} unit keys sampled evenly along the document",
           f"‖mean key‖ = {info.get('mean_key_norm', float('nan')):.3f} · y holds "
           f"{100 * info.get('orth_var_share', float('nan')):.0f}% of the variance ⊥ μ̂"]
    ch = alt.Chart(df).mark_circle(size=28, opacity=0.8).encode(
        x=alt.X("cos_to_mean:Q", title="cosine with the mean key direction μ̂ (unit keys)",
                scale=alt.Scale(domain=[-1, 1])),
        y=alt.Y("orth_pc1:Q", title="component along the top PC ⊥ μ̂"),
        color=alt.Color("position:Q", title="token position", scale=alt.Scale(scheme="plasma")),
        tooltip=[alt.Tooltip("position:Q", title="token position", format=","),
                 alt.Tooltip("cos_to_mean:Q", title="cos to μ̂", format=".3f"),
                 alt.Tooltip("orth_pc1:Q", title="⊥ PC1", format=".3f")])
    if document is not None:
        sub = [f"one document: “{document}”"] + sub
    return configure(ch.properties(width=420, height=300, title=alt.Title("Key cone of this head", subtitle=sub)))


#: The per-document spread draws each statistic on an axis at least this share of its largest |value| wide, so that
#: document-to-document differences below it (numerical rank 127 vs 128) look as small as they are.
SPREAD_MIN_SPAN = 0.10


#: Statistics bounded by min(d_k, d_v) (a rank of the state).
STATE_RANKS = ("erank", "numerical_rank", "stable_rank", "energy_rank99")


def spread_domain(values, metric: str, rank_max: int | None = None) -> list[float]:
    """x range of one statistic in the per-document spread: the values' range, widened about its centre to at
    least ``SPREAD_MIN_SPAN`` × max|value| (and ≥ 2 for integer statistics), shifted inside the statistic's
    natural bounds (ranks and horizons ≥ 0, the mean key norm ≤ 1, the state's ranks ≤ ``rank_max``), then padded
    4% on each side."""
    v = np.asarray(values, float)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return [0.0, 1.0]
    lo, hi = float(v.min()), float(v.max())
    need = max(SPREAD_MIN_SPAN * float(np.abs(v).max()), 2.0 if metric in INTEGER_METRICS else 1e-6)
    if hi - lo < need:
        c = (lo + hi) / 2
        lo, hi = c - need / 2, c + need / 2
    top = 1.0 if metric == "mean_key_norm" else float(rank_max) if rank_max and metric in STATE_RANKS else float("inf")
    if lo < 0:
        lo, hi = 0.0, hi - lo
    if hi > top:
        lo, hi = max(0.0, lo - (hi - top)), top
    pad = 0.04 * (hi - lo)  # outside the bounds too: a dot on a bound is drawn whole
    return [lo - pad, hi + pad]


def per_document_chart(df: pd.DataFrame, rank_max: int | None = None):
    """Each statistic of the head per document (dots) with the median over documents (black tick): the
    document-to-document spread. One row per statistic, each on its own x range (``spread_domain``: never zoomed
    until noise looks like spread), integer ticks for integer statistics."""
    rows = []
    for metric in dict.fromkeys(df["metric"]):
        d = df[df["metric"] == metric]
        integer = metric in INTEGER_METRICS
        dom = spread_domain(d["value"], metric, rank_max)
        axis = alt.Axis(format="d", tickMinStep=1, tickCount=5, labelFlush=True) if integer else \
            alt.Axis(format=",.3~g", tickCount=5, labelFlush=True)
        x = alt.X("value:Q", title=None, scale=alt.Scale(domain=dom, nice=False, zero=False), axis=axis)
        y = alt.Y("label:N", title=None, axis=alt.Axis(labelLimit=170, ticks=False, domain=False, labelPadding=8))
        dots = alt.Chart(d).mark_circle(size=70, opacity=0.85).encode(
            x=x, y=y,
            color=alt.Color("document:N", title="document", legend=alt.Legend(orient="bottom", columns=2)),
            tooltip=["document", alt.Tooltip("label:N", title="statistic"), alt.Tooltip("value:Q", format=",.3f")])
        tick = alt.Chart(d).mark_tick(color="black", thickness=2, size=18).encode(
            x=alt.X("median(value):Q", scale=alt.Scale(domain=dom, nice=False, zero=False)), y=y,
            tooltip=[alt.Tooltip("median(value):Q", title="median over documents", format=",.3f")])
        rows.append(alt.layer(dots, tick).properties(width=300, height=34))
    n = df["document"].nunique()
    sub = [f"dots: the {n} documents · black tick: median over documents",
           f"each axis spans at least {100 * SPREAD_MIN_SPAN:.0f}% of the statistic's value"]
    return configure(alt.vconcat(*rows, spacing=4).properties(
        title=alt.Title("Per-document spread of this head", subtitle=sub)), "pad")


def rho_text(rho: float | None, ci: Iterable[float] | None = None) -> str:
    """"ρ = 0.91 (95% CI 0.85–0.95)", "n/a" for a missing ρ; the interval only when both ends are finite."""
    if rho is None or not np.isfinite(rho):
        return "n/a"
    lo, hi = (list(ci) + [float("nan")] * 2)[:2] if ci is not None else (float("nan"), float("nan"))
    if np.isfinite(lo) and np.isfinite(hi):
        return f"{rho:.2f} (95% CI {lo:.2f} to {hi:.2f})"
    return f"{rho:.2f}"


def erank_vs_horizon_chart(table: pd.DataFrame, rho: float | None = None, rank_max: int | None = None,
                           ci: Iterable[float] | None = None, interactive: bool = False,
                           selected: tuple[int, int] | None = None):
    """Effective rank vs decay horizon per head (log–log), with the y = x line, the ceiling min(d_k, d_v), each
    head's min–max effective rank over documents (vertical bars, when the table has them) and Spearman ρ with its
    bootstrap interval ``ci`` (``summary.overview``'s ``spearman_ci95``); layers coloured by ``layer_scale``.
    ``interactive``: a click selects a point (selection param ``head``, fields layer, head), and the head
    ``selected`` (layer, head), the app's open head, is ringed black."""
    cols = ["layer", "head", "erank", "horizon"] + [c for c in ("erank_min", "erank_max") if c in table]
    df = table[cols].copy()
    df = df[np.isfinite(df["horizon"]) & (df["erank"] > 0)]
    # log-axis margins so that no point sits half outside the plot (e.g. the longest head at the right edge)
    xlo = float(min(df["horizon"].min(), 1.0)) / 1.25 if len(df) else 0.8
    xhi = float(max(df["horizon"].max(), 2.0)) * 1.6 if len(df) else 10.0
    ylo = float(min(df["erank"].min(), 1.0)) / 1.25 if len(df) else 0.8
    yhi = float(rank_max * 1.25 if rank_max else (df["erank"].max() * 1.5 if len(df) else 10.0))
    end = min(xhi, yhi)
    diag = pd.DataFrame({"x": [max(xlo, ylo), end], "y": [max(xlo, ylo), end]})
    tooltip = [alt.Tooltip("layer:O"), alt.Tooltip("head:O"), alt.Tooltip("erank:Q", title="erank", format=".2f"),
               alt.Tooltip("horizon:Q", title="horizon (tokens)", format=",.1f")]
    if "erank_min" in df:
        tooltip += [alt.Tooltip("erank_min:Q", title="erank min over documents", format=".2f"),
                    alt.Tooltip("erank_max:Q", title="erank max over documents", format=".2f")]
    xs = alt.Scale(type="log", domain=[xlo, xhi], nice=False)
    ys = alt.Scale(type="log", domain=[ylo, yhi], nice=False)
    pts = alt.Chart(df).mark_circle(size=60, opacity=0.85).encode(
        x=alt.X("horizon:Q", scale=xs, axis=log_axis(xlo, xhi, "decay horizon 1/(1 − ᾱ) (tokens, log scale)")),
        y=alt.Y("erank:Q", scale=ys, axis=log_axis(ylo, yhi, "effective rank (directions, log scale)")),
        color=alt.Color("layer:O", title="layer", scale=layer_scale(df["layer"])), tooltip=tooltip)
    if interactive:
        pts = pts.add_params(alt.selection_point(name="head", fields=["layer", "head"], on="click",
                                                 clear="dblclick", toggle=False))
    line = alt.Chart(diag).mark_line(color="#888", strokeDash=[4, 4], clip=True).encode(
        x=alt.X("x:Q", scale=xs), y=alt.Y("y:Q", scale=ys))
    txt = alt.Chart(diag.tail(1)).mark_text(align="left", dx=6, dy=10, color="#888", clip=True).encode(
        x=alt.X("x:Q", scale=xs), y=alt.Y("y:Q", scale=ys), text=alt.value("y = x"))
    layers = [line, txt]
    if "erank_min" in df:
        layers.append(alt.Chart(df).mark_rule(opacity=0.45).encode(
            x=alt.X("horizon:Q", scale=xs), y=alt.Y("erank_min:Q", scale=ys), y2="erank_max:Q",
            color=alt.Color("layer:O", title="layer", scale=layer_scale(df["layer"])), tooltip=tooltip))
    ring = df[(df["layer"] == selected[0]) & (df["head"] == selected[1])] if interactive and selected else df[:0]
    if len(ring):  # under the points, so that a click still lands on the point
        layers.append(alt.Chart(ring).mark_point(shape="circle", size=260, filled=False, color="black",
                                                 strokeWidth=2).encode(
            x=alt.X("horizon:Q", scale=xs), y=alt.Y("erank:Q", scale=ys), tooltip=tooltip))
    layers.append(pts)
    if rank_max:
        cap = pd.DataFrame({"y": [float(rank_max)], "label": [f"min(d_k, d_v) = {rank_max}"]})
        layers += [alt.Chart(cap).mark_rule(color="#bbb").encode(y=alt.Y("y:Q", scale=ys)),
                   alt.Chart(cap).mark_text(align="left", x=4, dy=8, color="#888").encode(
                       y=alt.Y("y:Q", scale=ys), text="label:N")]
    n_docs = int(table["n_docs"].max()) if "n_docs" in table and len(table) else 1
    over = f"median over {n_docs} documents" if n_docs != 1 else "one document"
    return configure(alt.layer(*layers).properties(width=440, height=340, title=alt.Title(
        "Effective rank vs decay horizon",
        subtitle=[f"one point per head ({over}) · dashed: y = x"]
        + (["bar: the head's min–max over documents"] if "erank_min" in df else [])
        + ([f"ringed: layer {selected[0]} head {selected[1]}, shown below"] if len(ring) else [])
        + [f"Spearman ρ = {rho_text(rho, ci)}, bootstrap over heads"])))


def horizon_hist_chart(table: pd.DataFrame, segment_len: int):
    """Histogram of the heads' decay horizons on log-spaced bins, with the segment length marked."""
    h = table["horizon"].to_numpy(float)
    h = h[np.isfinite(h) & (h > 0)]
    if h.size == 0:
        h = np.array([1.0])
    lo = math.floor(math.log10(max(min(h.min(), segment_len), 1e-3)))
    hi = math.ceil(math.log10(max(h.max(), segment_len) * 1.001))
    edges = np.logspace(lo, hi, max(4, 4 * (hi - lo)) + 1)
    counts, _ = np.histogram(h, bins=edges)
    df = pd.DataFrame(dict(lo=edges[:-1], hi=edges[1:], heads=counts, zero=0,
                           side=np.where(edges[1:] <= segment_len, "forgets within a segment", "longer")))
    bars = alt.Chart(df).mark_rect(stroke="white", strokeWidth=0.5).encode(
        x=alt.X("lo:Q", scale=alt.Scale(type="log", domain=[float(edges[0]), float(edges[-1])], nice=False),
                axis=log_axis(float(edges[0]), float(edges[-1]), "decay horizon 1/(1 − ᾱ) (tokens, log scale)")),
        x2="hi:Q", y=alt.Y("heads:Q", title="number of heads", scale=alt.Scale(domainMin=0),
                                 axis=alt.Axis(tickMinStep=1, format="d")), y2="zero:Q",
        color=alt.Color("side:N", title="", scale=alt.Scale(domain=["forgets within a segment", "longer"],
                                                             range=["#ff7f0e", "#1f77b4"]),
                        legend=alt.Legend(orient="top")),
        tooltip=[alt.Tooltip("lo:Q", title="from (tokens)", format=",.1f"),
                 alt.Tooltip("hi:Q", title="to (tokens)", format=",.1f"), alt.Tooltip("heads:Q", title="heads")])
    seg = pd.DataFrame({"x": [segment_len], "label": [f"segment length L = {segment_len}"]})
    rule = alt.Chart(seg).mark_rule(color="#d62728", strokeWidth=2).encode(x="x:Q")
    # the label sits on the side of the rule with room for it (right of it, the plot may end within ~100 px)
    lo_e, hi_e = float(edges[0]), float(edges[-1])
    frac = np.log(segment_len / lo_e) / np.log(hi_e / lo_e) if hi_e > lo_e > 0 and segment_len > 0 else 0.0
    left = frac > 0.55
    txt = alt.Chart(seg).mark_text(align="right" if left else "left", dx=-4 if left else 4, y=10,
                                   color="#d62728").encode(x="x:Q", text="label:N")
    share = float(np.mean(table["horizon"].to_numpy(float) < segment_len))
    return configure(alt.layer(bars, rule, txt).properties(width=440, height=300, title=alt.Title(
        "Decay horizons of all GDN heads",
        subtitle=[f"{100 * share:.0f}% of heads forget within one {segment_len}-token segment (horizon < L)"])))


def forgetting_by_layer_frame(table: pd.DataFrame, segment_len: int) -> pd.DataFrame:
    g = table.assign(forgets=table["horizon"] < segment_len).groupby("layer", as_index=False)
    df = g.agg(heads=("head", "count"), forgetting=("forgets", "sum"))
    df["share"] = df["forgetting"] / df["heads"]
    return df


def forgetting_chart(df: pd.DataFrame, segment_len: int):
    """Share of each layer's heads whose horizon is below the segment length."""
    ch = alt.Chart(df).mark_bar(color="#ff7f0e").encode(
        x=alt.X("layer:O", title="layer (model index)", axis=alt.Axis(labelAngle=0)),
        y=alt.Y("share:Q", title="share of the layer's heads", axis=alt.Axis(format="%"),
                scale=alt.Scale(domain=[0, 1])),
        tooltip=[alt.Tooltip("layer:O"), alt.Tooltip("forgetting:Q", title="heads forgetting"),
                 alt.Tooltip("heads:Q", title="heads"), alt.Tooltip("share:Q", format=".0%")])
    return configure(ch.properties(width=440, height=220, title=alt.Title(
        "Heads forgetting within a segment, per layer", subtitle=f"horizon < L = {segment_len} tokens")))


def cache_budget_chart(df: pd.DataFrame, crossover: float | None = None):
    """Bytes per cache vs context length (log–log) for the loaded configuration."""
    d = df[df["bytes"] > 0].copy()
    d["size"] = [PS.human_bytes(b) for b in d["bytes"]]
    c0, c1 = float(d["context"].min()), float(d["context"].max())
    b0, b1 = float(d["bytes"].min()), float(d["bytes"].max())
    lines = alt.Chart(d).mark_line(point=alt.OverlayMarkDef(size=20)).encode(
        x=alt.X("context:Q", scale=alt.Scale(type="log", domain=[c0, c1], nice=False),
                axis=log_axis(c0, c1, "context length T (tokens, log scale)")),
        y=alt.Y("bytes:Q", scale=alt.Scale(type="log"),
                axis=alt.Axis(title="cache size (log scale)", values=PS.byte_ticks(b0, b1),
                              labelExpr=PS.BYTES_LABEL_EXPR)),
        color=alt.Color("cache:N", title="cache", sort=["total", "full-attention KV", "GDN recurrent state",
                                                          "GDN conv window"],
                        scale=alt.Scale(domain=["total", "full-attention KV", "GDN recurrent state",
                                                "GDN conv window"],
                                        range=["#333333", "#d62728", "#1f77b4", "#9467bd"])),
        strokeDash=alt.condition("datum.cache == 'total'", alt.value([5, 3]), alt.value([1, 0])),
        tooltip=[alt.Tooltip("context:Q", title="T (tokens)", format=","), "cache",
                 alt.Tooltip("size:N", title="size"), alt.Tooltip("bytes:Q", title="bytes", format=",.0f")])
    layers = [lines]
    sub = "recurrent state and conv window are constant in T; full-attention KV grows linearly"
    if crossover and np.isfinite(crossover) and crossover > 0:
        cx = pd.DataFrame({"x": [crossover], "label": [f"KV = recurrent at T ≈ {crossover:,.0f}"]})
        layers += [alt.Chart(cx).mark_rule(color="#888", strokeDash=[2, 2]).encode(x="x:Q"),
                   alt.Chart(cx).mark_text(align="left", dx=4, y=10, color="#555").encode(x="x:Q", text="label:N")]
    return configure(alt.layer(*layers).properties(width=560, height=340, title=alt.Title(
        "Cache memory vs context length", subtitle=sub)))


def loss_delta_chart(df: pd.DataFrame):
    """Truncated − untouched next-token loss along the document (block means), per document."""
    zero = alt.Chart(pd.DataFrame({"y": [0.0]})).mark_rule(color="#888").encode(y="y:Q")
    ch = alt.Chart(df).mark_line(point=alt.OverlayMarkDef(size=14)).encode(
        x=alt.X("position:Q", title="token position (tokens)"),
        y=alt.Y("delta:Q", title="Δ loss, truncated − untouched (nats / token)"),
        color=alt.Color("document:N", title="document", legend=alt.Legend(orient="bottom", columns=2)),
        tooltip=["document", alt.Tooltip("position:Q", format=",.0f"), alt.Tooltip("delta:Q", format="+.4f")])
    return configure(alt.layer(zero, ch).properties(width=560, height=240, title=alt.Title(
        "Loss change along the document",
        subtitle=["per-token difference, averaged over blocks of tokens", "0 = no change; > 0: truncation hurts"])))


def loss_vs_rank_chart(df: pd.DataFrame):
    """Δ mean loss vs the rank kept per head; ticks at the ranks measured."""
    rs = sorted({int(r) for r in df["r"]}) if len(df) else [1]
    ch = alt.Chart(df).mark_line(point=True).encode(
        x=alt.X("r:Q", title="rank r kept per head (log scale)", scale=alt.Scale(type="log"),
                axis=alt.Axis(values=rs, format="d")),
        y=alt.Y("delta:Q", title="Δ mean loss vs untouched (nats / token)"),
        tooltip=["r", alt.Tooltip("loss:Q", format=".4f"), alt.Tooltip("delta:Q", format="+.4f")])
    return configure(ch.properties(width=440, height=260, title="Next-token loss vs rank"))


# =============================================================================================================
# export
# =============================================================================================================
def _spec(chart, width: int | None = None, height: int | None = None) -> dict:
    """The chart's Vega-Lite dict; ``width`` / ``height`` (CSS px) replace a single or layered chart's size
    (grids, facets and concatenations keep theirs: their cells have fixed steps)."""
    d = chart.to_dict() if hasattr(chart, "to_dict") else dict(chart)
    d.pop("usermeta", None)
    sized = not any(k in d for k in ("vconcat", "hconcat", "concat", "facet", "repeat"))
    for key, v in (("width", width), ("height", height)):
        if v is None:
            continue
        v = int(v)
        if v < 50 or v > 5000:
            raise ValueError(f"figure {key} must be 50–5000 px; got {v}")
        if sized and not isinstance(d.get(key), dict):
            d[key] = v
    return d


def to_png(chart, scale: float = 2.0, width: int | None = None, height: int | None = None) -> bytes:
    """PNG bytes of a chart (vl-convert, offline): ``width`` × ``height`` CSS px (see ``_spec``) rendered at
    ``scale`` device pixels per CSS px (2 ≈ 192 dpi at 96 dpi per CSS px). ``scale`` must be in (0, 8]."""
    import vl_convert as vlc

    if not 0 < float(scale) <= 8:
        raise ValueError(f"PNG scale must be in (0, 8]; got {scale!r}")
    return vlc.vegalite_to_png(_spec(chart, width, height), scale=float(scale))


def to_svg(chart, width: int | None = None, height: int | None = None) -> str:
    """SVG text of a chart (vl-convert, offline), sized as in ``to_png``."""
    import vl_convert as vlc

    return vlc.vegalite_to_svg(_spec(chart, width, height))


def to_csv(df: pd.DataFrame) -> bytes:
    return df.to_csv(index=False).encode()


def run_zip(figures: Mapping[str, tuple], settings: dict, tables: Mapping[str, pd.DataFrame] | None = None, *,
            scale: float = 2.0, width: int | None = None, height: int | None = None,
            files: Mapping[str, bytes] | None = None) -> bytes:
    """One zip: ``figures/<name>.png|.svg`` (sized and scaled as in ``to_png``), ``data/<name>.csv`` for each
    (chart, frame) in ``figures``, ``tables/<name>.csv``, ``settings.json`` and ``files`` ({path in the zip: bytes},
    e.g. ``gdnviz.run_export.run_files``)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("settings.json", json.dumps(settings, indent=2, default=str))
        for name, (chart, df) in figures.items():
            z.writestr(f"figures/{name}.png", to_png(chart, scale, width, height))
            z.writestr(f"figures/{name}.svg", to_svg(chart, width, height))
            if df is not None:
                z.writestr(f"data/{name}.csv", to_csv(df))
        for name, df in (tables or {}).items():
            z.writestr(f"tables/{name}.csv", to_csv(df))
        for path, data in (files or {}).items():
            z.writestr(path, data)
    return buf.getvalue()
