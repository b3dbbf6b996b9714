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

#: Metrics offered on the heatmap: column of ``summary.document_set_table`` → (label, colour-scale kind).
HEATMAP_METRICS = {
    "erank": ("effective rank (directions)", "linear"),
    "numerical_rank": ("numerical rank (σ above the f32 floor)", "linear"),
    "stable_rank": ("stable rank ‖S‖²_F / ‖S‖²₂", "linear"),
    "horizon": ("decay horizon 1/(1−ᾱ) (tokens, log scale)", "log"),
    "mean_key_norm": ("key cone: norm of the mean unit key", "linear"),
    "key_cov_erank": ("key-covariance erank inside the horizon", "linear"),
    "decayed_P_erank": ("decayed key covariance P erank (√eig scale)", "linear"),
}
SHORT_LABELS = {"erank": "effective rank", "numerical_rank": "numerical rank", "stable_rank": "stable rank",
                "horizon": "horizon (tokens)", "mean_key_norm": "mean key norm", "key_cov_erank": "key-cov erank",
                "decayed_P_erank": "decayed-P erank"}
FONT = dict(titleFontSize=13, labelFontSize=11)
#: DejaVu Sans has every glyph used in titles (σ, ᾱ, ⊥, ‖, subscripts); browsers without it use their sans-serif.
FONT_FAMILY = "DejaVu Sans, Liberation Sans, Arial, Helvetica, sans-serif"
F32_EPS = float(np.finfo(np.float32).eps)


def _fmt(metric: str) -> str:
    return ",.0f" if metric in ("numerical_rank", "horizon") else ".2f"


def configure(chart, autosize: str = "fit-x"):
    """Shared look. autosize "fit-x": the whole chart (axes, legend) fits the width it is given (the page column,
    or the chart's own width in exports) and keeps its height; "pad" for grids and facets, which keep their size."""
    chart = chart.properties(autosize=alt.AutoSizeParams(type=autosize, contains="padding"))
    return (chart.configure(font=FONT_FAMILY).configure_axis(**FONT).configure_legend(**FONT).configure_title(fontSize=14, anchor="start")
            .configure_view(strokeWidth=0))


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


def per_document_frame(captures, names, li: int, head: int) -> pd.DataFrame:
    """Long frame metric × document of the head's statistics (for the per-document spread)."""
    from gdnviz.summary import head_table

    rows = []
    H = captures[0].meta["num_heads"]
    labels = SHORT_LABELS
    for cap, name in zip(captures, names):
        t = head_table(cap)
        r = t.iloc[li * H + head]
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
    picked = {tuple(map(int, p)) for p in picked}
    df = df.copy()
    sel_t = None if selected is None else (int(selected[0]), int(selected[1]))
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
        title=alt.Title(title, subtitle=subtitle), usermeta={"embedOptions": {"renderer": "svg"}})
    return configure(chart, "pad")


def heatmap(df: pd.DataFrame, metric: str, *, selected: tuple | None = None, picked: Iterable = (),
            title: str | None = None, interactive: bool = True, subtitle: str | list | None = None):
    """Layer × head grid coloured by ``value`` (median over documents); min–max in the tooltip. Click selection
    param ``cell`` (fields layer, head); the open head gets a black frame, heads in the truncation set orange.
    ``subtitle``: what a click does, one line or a list of lines (default: it opens the head)."""
    label, scale = HEATMAP_METRICS.get(metric, (metric, "linear"))
    fmt = _fmt(metric)
    color_scale = alt.Scale(type="log", scheme="viridis") if scale == "log" else alt.Scale(scheme="viridis")
    color = alt.Color("value:Q", title=label.split(" (")[0], scale=color_scale,
                      legend=alt.Legend(orient="right", gradientLength=180))
    tooltip = [alt.Tooltip("layer:O", title="layer"), alt.Tooltip("head:O", title="head"),
               alt.Tooltip("value:Q", title=f"median {label}", format=fmt),
               alt.Tooltip("min:Q", title="min over documents", format=fmt),
               alt.Tooltip("max:Q", title="max over documents", format=fmt),
               alt.Tooltip("n_docs:Q", title="documents")]
    return _grid(df, color, tooltip, title or f"{label}: median over documents",
                 subtitle or "click a cell to open that head · hover for the min–max over documents", selected=selected,
                 picked=picked, interactive=interactive)


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
    sub = (f"Δ = mean over the same {n} samples of (score − baseline); red: lower, blue: higher · click a cell to "
           "open that head · hover for the paired SE")
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
    lines = alt.Chart(d).mark_line(point=alt.OverlayMarkDef(size=18)).encode(
        x=alt.X("index:Q", title="singular value index i (descending)",
                scale=alt.Scale(domain=[1, n_max], nice=False)),
        y=alt.Y("sigma:Q", title="singular value σ_i (log scale)", scale=alt.Scale(type="log")),
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
    sub = ["dashed red: the f32 floor σ_max·128·ε", "grey: numerical rank · green: effective rank"]
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
        x=alt.X("one_minus_alpha_lo:Q", title="1 − α per token (log scale; α = exp(g), the decay)",
                scale=alt.Scale(type="log", domain=[lo, hi], nice=False)),
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


def keycone_chart(df: pd.DataFrame, info: dict | None = None):
    """The head's sampled unit keys in 2-D: cosine with the mean key direction × coordinate along the top
    principal direction orthogonal to it, coloured by token position."""
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
    return configure(ch.properties(width=420, height=300, title=alt.Title("Key cone of this head", subtitle=sub)))


def per_document_chart(df: pd.DataFrame):
    """Each statistic of the head per document (dots) with the median (tick): the document-to-document spread.
    One row per statistic, each with its own x scale."""
    dots = alt.Chart().mark_circle(size=70, opacity=0.85).encode(
        x=alt.X("value:Q", title=None, scale=alt.Scale(zero=False), axis=alt.Axis(format=",.4~g", tickCount=5)),
        color=alt.Color("document:N", title="document", legend=alt.Legend(orient="bottom", columns=2)),
        tooltip=["document", alt.Tooltip("label:N", title="statistic"), alt.Tooltip("value:Q", format=",.3f")])
    tick = alt.Chart().mark_tick(color="black", thickness=2, size=18).encode(
        x="median(value):Q", tooltip=[alt.Tooltip("median(value):Q", title="median", format=",.3f")])
    fac = alt.layer(dots, tick, data=df).properties(width=300, height=28).facet(
        row=alt.Row("label:N", title=None, sort=list(dict.fromkeys(df["label"])),
                    header=alt.Header(labelAngle=0, labelAlign="left", labelFontSize=11, labelLimit=140))
    ).resolve_scale(x="independent")
    return configure(fac.properties(title=alt.Title("Per-document spread of this head",
                                                     subtitle="dots: documents · black tick: median")), "pad")


def erank_vs_horizon_chart(table: pd.DataFrame, rho: float | None = None, rank_max: int | None = None,
                           interactive: bool = False):
    """Effective rank vs decay horizon per head (log–log), with the y = x line, the ceiling min(d_k, d_v), each
    head's min–max effective rank over documents (vertical bars, when the table has them) and Spearman ρ.
    ``interactive``: a click selects a point (selection param ``head``, fields layer, head)."""
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
    pts = alt.Chart(df).mark_circle(size=60, opacity=0.8).encode(
        x=alt.X("horizon:Q", title="decay horizon 1/(1 − ᾱ) (tokens, log scale)", scale=xs),
        y=alt.Y("erank:Q", title="effective rank (directions, log scale)", scale=ys),
        color=alt.Color("layer:O", title="layer", scale=alt.Scale(scheme="viridis")), tooltip=tooltip)
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
            color=alt.Color("layer:O", scale=alt.Scale(scheme="viridis"), legend=None), tooltip=tooltip))
    layers.append(pts)
    if rank_max:
        cap = pd.DataFrame({"y": [float(rank_max)], "label": [f"min(d_k, d_v) = {rank_max}"]})
        layers += [alt.Chart(cap).mark_rule(color="#bbb").encode(y=alt.Y("y:Q", scale=ys)),
                   alt.Chart(cap).mark_text(align="left", x=4, dy=8, color="#888").encode(
                       y=alt.Y("y:Q", scale=ys), text="label:N")]
    rho_s = "n/a" if rho is None or not np.isfinite(rho) else f"{rho:.2f}"
    return configure(alt.layer(*layers).properties(width=440, height=340, title=alt.Title(
        "Effective rank vs decay horizon",
        subtitle=["one point per head (median over documents)"]
        + (["bar: the head's min–max over documents"] if "erank_min" in df else [])
        + [f"Spearman ρ = {rho_s} · dashed: y = x"])))


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
        x=alt.X("lo:Q", title="decay horizon 1/(1 − ᾱ) (tokens, log scale)",
                scale=alt.Scale(type="log", domain=[float(edges[0]), float(edges[-1])], nice=False)),
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
    d = df[df["bytes"] > 0]
    lines = alt.Chart(d).mark_line(point=alt.OverlayMarkDef(size=20)).encode(
        x=alt.X("context:Q", title="context length T (tokens, log scale)",
                scale=alt.Scale(type="log", domain=[float(d["context"].min()), float(d["context"].max())],
                                nice=False)),
        y=alt.Y("GiB:Q", title="cache size (GiB, log scale)", scale=alt.Scale(type="log")),
        color=alt.Color("cache:N", title="cache", sort=["total", "full-attention KV", "GDN recurrent state",
                                                          "GDN conv window"],
                        scale=alt.Scale(domain=["total", "full-attention KV", "GDN recurrent state",
                                                "GDN conv window"],
                                        range=["#333333", "#d62728", "#1f77b4", "#9467bd"])),
        strokeDash=alt.condition("datum.cache == 'total'", alt.value([5, 3]), alt.value([1, 0])),
        tooltip=[alt.Tooltip("context:Q", title="T (tokens)", format=","), "cache",
                 alt.Tooltip("GiB:Q", title="GiB", format=",.4f"), alt.Tooltip("bytes:Q", title="bytes",
                                                                              format=",.0f")])
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
    ch = alt.Chart(df).mark_line(point=True).encode(
        x=alt.X("r:Q", title="rank r kept per head (log scale)", scale=alt.Scale(type="log")),
        y=alt.Y("delta:Q", title="Δ mean loss vs untouched (nats / token)"),
        tooltip=["r", alt.Tooltip("loss:Q", format=".4f"), alt.Tooltip("delta:Q", format="+.4f")])
    return configure(ch.properties(width=440, height=260, title="Next-token loss vs rank"))


# =============================================================================================================
# export
# =============================================================================================================
def _spec(chart) -> dict:
    d = chart.to_dict() if hasattr(chart, "to_dict") else dict(chart)
    d.pop("usermeta", None)
    return d


def to_png(chart, scale: float = 2.0) -> bytes:
    """PNG bytes of a chart (vl-convert, offline)."""
    import vl_convert as vlc

    return vlc.vegalite_to_png(_spec(chart), scale=scale)


def to_svg(chart) -> str:
    """SVG text of a chart (vl-convert, offline)."""
    import vl_convert as vlc

    return vlc.vegalite_to_svg(_spec(chart))


def to_csv(df: pd.DataFrame) -> bytes:
    return df.to_csv(index=False).encode()


def run_zip(figures: Mapping[str, tuple], settings: dict, tables: Mapping[str, pd.DataFrame] | None = None,
            png_scale: float = 2.0) -> bytes:
    """One zip: ``figures/<name>.png|.svg``, ``data/<name>.csv`` for each (chart, frame) in ``figures``,
    ``tables/<name>.csv`` and ``settings.json``."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("settings.json", json.dumps(settings, indent=2, default=str))
        for name, (chart, df) in figures.items():
            z.writestr(f"figures/{name}.png", to_png(chart, png_scale))
            z.writestr(f"figures/{name}.svg", to_svg(chart))
            if df is not None:
                z.writestr(f"data/{name}.csv", to_csv(df))
        for name, df in (tables or {}).items():
            z.writestr(f"tables/{name}.csv", to_csv(df))
    return buf.getvalue()
