"""Tables and Altair charts of a HoldsJob result (``gdnviz.attribution.holds.what_it_holds`` plus ``tokens``,
``document``, ``layer``, ``head``): pure pandas / Altair, no Streamlit, no torch.

Token positions are 0-based indices into the document; the state is the one after ``position`` tokens, so the
tokens ``0..position−1`` wrote it. A token is *older than one segment* when its index is below ``position − L``.
"""
from __future__ import annotations

import html

import altair as alt
import numpy as np
import pandas as pd

from gdnviz.figures import configure

MAX_POINTS = 2000  # bars drawn along the document; longer ones show the largest norm per block of tokens


def contributions_frame(res: dict) -> pd.DataFrame:
    """One row per token 0..position−1: ``position``, ``token``, ``norm`` (‖c_t‖_F), ``older_than_L`` and
    ``share_i`` (⟨c_t, u_i w_iᵀ⟩_F; over tokens they sum to σ_i) and ``fraction_i`` (share_i / σ_i). The CSV."""
    n = int(res["position"])
    df = pd.DataFrame({"position": np.arange(n), "token": res["tokens"][:n], "norm": res["norms"],
                       "older_than_L": np.arange(n) < res["beyond"]["cutoff"]})
    for i, (s, sig) in enumerate(zip(res["shares"], res["sigma"])):
        df[f"share_{i + 1}"] = s
        df[f"fraction_{i + 1}"] = np.asarray(s) / sig if sig > 0 else 0.0
    return df


def context(res: dict, t: int, before: int = 8, after: int = 4) -> tuple[str, str]:
    """The text of the ``before`` tokens before token ``t`` and the ``after`` tokens after it (up to the state's
    position: later tokens did not write the state, but are shown, for reading)."""
    toks = res["tokens"]
    return "".join(toks[max(0, t - before):t]), "".join(toks[t + 1:t + 1 + after])


def top_tokens(res: dict, n: int = 12, direction: int | None = None) -> pd.DataFrame:
    """The ``n`` tokens with the largest ‖c_t‖ (``direction`` None) or the largest |share| along direction
    ``direction`` (1-based), with their text in context: ``rank``, ``position``, ``before``, ``token``, ``after``,
    ``norm``, ``share`` / ``fraction`` of σ (direction given) and the age ``tokens_back`` (position − index)."""
    df = contributions_frame(res)
    col = "norm" if direction is None else f"share_{direction}"
    order = df[col].abs().sort_values(ascending=False, kind="stable").index[:n]
    out = df.loc[order].copy()
    out["before"], out["after"] = zip(*(context(res, int(t)) for t in out["position"])) if len(out) else ((), ())
    out["tokens_back"] = int(res["position"]) - out["position"]
    out.insert(0, "rank", np.arange(1, len(out) + 1))
    keep = ["rank", "position", "tokens_back", "before", "token", "after", "norm"]
    if direction is not None:
        out = out.rename(columns={f"share_{direction}": "share", f"fraction_{direction}": "fraction"})
        keep += ["share", "fraction"]
    return out[keep].reset_index(drop=True)


DECADES = 3  # the text's colour scale: opacity 1 at the largest ‖c_t‖, 0 at 10^-DECADES of it (log)


def highlighted_html(res: dict, max_tokens: int = 600) -> str:
    """The last ``max_tokens`` tokens before the state's position as HTML, each token's background opacity
    ``1 + log10(‖c_t‖ / max_s ‖c_s‖) / DECADES`` clipped to [0, 1] (contributions fall off exponentially with
    age), a red bar at ``position − L``; hover: index and norm."""
    n = int(res["position"])
    norms = np.asarray(res["norms"])
    top = float(norms.max()) if len(norms) and norms.max() > 0 else 1.0
    lo, cut = max(0, n - max_tokens), int(res["beyond"]["cutoff"])
    parts = [] if lo == 0 else [f"<span style='color:gray'>… {lo:,} earlier tokens not shown …</span> "]
    for t in range(lo, n):
        if t == cut:
            parts.append("<span title='one segment (L tokens) before the boundary' style='border-left:3px solid "
                         "#d62728;margin:0 2px'></span>")
        a = min(1.0, max(0.0, 1 + np.log10(norms[t] / top) / DECADES)) if norms[t] > 0 else 0.0
        tok = html.escape(res["tokens"][t]).replace("\n", "↵\n")
        parts.append(f"<span title='token {t} · ‖c‖ = {norms[t]:.3g}' style='background:rgba(255,140,0,{0.85 * a:.3f})'>"
                     f"{tok}</span>")
    # column-reverse: the box opens scrolled to its end, the tokens just before p
    return ("<div style='display:flex;flex-direction:column-reverse;max-height:380px;overflow-y:auto;"
            "border:1px solid #ddd;padding:6px'><div style='font-family:monospace;font-size:0.85em;line-height:1.6;"
            "white-space:pre-wrap'>" + "".join(parts) + "</div></div>")


def _blocked(df: pd.DataFrame, col: str) -> pd.DataFrame:
    """At most MAX_POINTS rows: per block of consecutive tokens the row with the largest |col|."""
    block = max(1, int(np.ceil(len(df) / MAX_POINTS)))
    if block == 1:
        return df
    idx = df[col].abs().groupby(df["position"] // block).idxmax()
    return df.loc[idx.values]


def along_chart(res: dict):
    """‖c_t‖_F of every token along the document (one dot per token, log y; zero norms left out), older-than-L
    tokens grey, with the cutoff position − L marked."""
    df = contributions_frame(res)
    df = _blocked(df[df["norm"] > 0], "norm").assign(
        age=lambda d: np.where(d["older_than_L"], "older than one segment", "within the last segment"))
    L, p = int(res["segment_len"]), int(res["position"])
    bars = alt.Chart(df).mark_circle(size=10 if len(df) > 400 else 24, opacity=0.8).encode(
        x=alt.X("position:Q", title="token index (0-based)", scale=alt.Scale(domain=[0, p], nice=False)),
        y=alt.Y("norm:Q", title="‖c_t‖_F (log scale)", scale=alt.Scale(type="log")),
        color=alt.Color("age:N", title=None, scale=alt.Scale(domain=["older than one segment", "within the last segment"],
                                                              range=["#9e9e9e", "#1f77b4"]),
                        legend=alt.Legend(orient="bottom")),
        tooltip=[alt.Tooltip("position:Q", title="token index"), "token:N",
                 alt.Tooltip("norm:Q", title="‖c_t‖_F", format=".3g")])
    layers = [bars]
    if res["beyond"]["cutoff"] > 0:
        layers.append(alt.Chart(pd.DataFrame({"x": [res["beyond"]["cutoff"]]})).mark_rule(color="#d62728",
                                                                                           strokeDash=[4, 3])
                      .encode(x="x:Q"))
    sub = [f"the norm of each token's rank-1 contribution to the state after {p:,} tokens",
           f"red: {L} tokens (one segment) before it"]
    return configure(alt.layer(*layers).properties(width=560, height=220, title=alt.Title(
        "Contributions along the document", subtitle=sub)))


def directions_chart(res: dict, n: int = 8):
    """Per top singular direction i, the ``n`` tokens with the largest |share|, as fractions of σ_i (bars)."""
    rows = []
    for i in range(1, int(res["top"]) + 1):
        t = top_tokens(res, n, direction=i)
        for _, r in t.iterrows():
            rows.append(dict(direction=f"direction {i} (σ = {res['sigma'][i - 1]:.3g})", order=int(r["rank"]),
                             label=f"{int(r['position'])} · {r['token'].strip() or repr(r['token'])}"[:28],
                             fraction=float(r["fraction"]), share=float(r["share"]), token=r["token"],
                             position=int(r["position"]), context=f"{r['before']}[{r['token']}]{r['after']}"))
    df = pd.DataFrame(rows)
    ch = alt.Chart(df).mark_bar().encode(
        y=alt.Y("label:N", title=None, sort=alt.EncodingSortField("order"), axis=alt.Axis(labelLimit=180)),
        x=alt.X("fraction:Q", title="share of σ_i", axis=alt.Axis(format="%")),
        color=alt.condition("datum.fraction >= 0", alt.value("#1f77b4"), alt.value("#d62728")),
        tooltip=[alt.Tooltip("position:Q", title="token index"), "token:N", "context:N",
                 alt.Tooltip("share:Q", title="⟨c_t, u_i w_iᵀ⟩", format=".3g"),
                 alt.Tooltip("fraction:Q", title="share of σ_i", format=".1%")]
    ).properties(width=220, height=alt.Step(14)).facet(
        facet=alt.Facet("direction:N", title=None, sort=alt.SortField("direction")), columns=2
    ).resolve_scale(y="independent")
    return configure(ch.properties(title=alt.Title(
        "Which tokens fill each top singular direction",
        subtitle=[f"the {n} tokens with the largest |⟨c_t, u_i w_iᵀ⟩| per direction, as a share of σ_i "
                  "(they sum to 100% over all tokens; red: the token cancels part of it)"])), autosize="pad")


def rewrite_frame(res: dict) -> pd.DataFrame:
    return pd.DataFrame({"boundary": res["rewrite"]["boundaries"], "rate": res["rewrite"]["rates"]})


def rewrite_chart(res: dict):
    """‖S_b − S_{b−L}‖_F / ‖S_{b−L}‖_F at the boundaries b = 2L, 3L, …, with the chosen position marked."""
    df = rewrite_frame(res)
    L = int(res["segment_len"])
    line = alt.Chart(df).mark_line(point=True).encode(
        x=alt.X("boundary:Q", title="boundary b (tokens consumed)",
                scale=alt.Scale(domain=[0, max(int(res["T"]), int(res["position"]))], nice=False)),
        y=alt.Y("rate:Q", title="‖S_b − S_(b−L)‖_F / ‖S_(b−L)‖_F", scale=alt.Scale(zero=True)),
        tooltip=[alt.Tooltip("boundary:Q", title="b", format=","), alt.Tooltip("rate:Q", title="rate", format=".3f")])
    p, T = int(res["position"]), int(res["T"])
    where = "the document end" if p == T else ("a segment boundary" if p % L == 0 else "between two boundaries")
    mark = pd.DataFrame({"x": [p], "label": [f"p = {p:,}"]})
    rule = alt.Chart(mark).mark_rule(color="#d62728", strokeDash=[4, 3]).encode(x="x:Q")
    # the label left of the rule when the rule is in the right half of the axis (at the document end it is the
    # axis' last position): it stays inside the plot
    side = dict(align="right", dx=-4) if p > max(T, p) / 2 else dict(align="left", dx=4)
    label = alt.Chart(mark).mark_text(**side, y=8, color="#d62728", fontSize=11).encode(x="x:Q", text="label:N")
    return configure(alt.layer(line, rule, label).properties(width=480, height=220, title=alt.Title(
        "Rewrite rate between boundaries",
        subtitle=[f"how much of the state changes over each {L}-token segment (1 = as much as its size)",
                  f"red: p = {p:,} ({where}), the state decomposed above"])))
