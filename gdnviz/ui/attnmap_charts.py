"""Tables and Altair heatmaps of an AttnMapJob's maps (``gdnviz.jobs.unpack_map``): pure numpy / pandas / Altair, no
Streamlit, no torch.

A map ``w`` is ``[end − start, end]``: row i is query position ``t = start + i``, column ``s`` key position (0-based
token indices); causal, so only ``s ≤ t`` is defined (the CSV and the figures leave ``s > t`` out). The GDN map is
signed and unnormalised (``o_t = Σ_s w_{t,s} v_s``); the softmax map is a probability (rows sum to 1).
"""
from __future__ import annotations

import altair as alt
import numpy as np
import pandas as pd

from gdnviz.figures import configure

MAX_ROWS, MAX_COLS = 128, 256  # cells drawn; larger maps are shown as blocks (the largest |w| of each block)
WIDTH, HEIGHT = 440, 300
# A map's up to MAX_ROWS × MAX_COLS cells exceed Altair's 5,000-row guard. The guard is one setting for the whole
# process: it is switched off once here, never toggled around a build (a toggle in one script thread made the builds
# of concurrent ones fail with MaxRowsError).
alt.data_transformers.disable_max_rows()


def long_frame(w: np.ndarray, start: int) -> pd.DataFrame:
    """The map in long form, one row per (query, key) with key ≤ query: ``query``, ``key``, ``weight``. The CSV."""
    n, end = w.shape
    t = np.arange(start, start + n)[:, None]
    s = np.arange(end)[None]
    keep = np.broadcast_to(s <= t, w.shape)
    return pd.DataFrame({"query": np.broadcast_to(t, w.shape)[keep], "key": np.broadcast_to(s, w.shape)[keep],
                         "weight": w[keep]})


def block_sizes(n_rows: int, n_cols: int) -> tuple[int, int]:
    """(queries, keys) per drawn cell: 1 × 1 up to MAX_ROWS × MAX_COLS cells, else blocks of that many."""
    return max(1, -(-n_rows // MAX_ROWS)), max(1, -(-n_cols // MAX_COLS))


def key_range(end: int, keys: tuple[int, int] | None) -> tuple[int, int]:
    """``keys`` = (first key, end exclusive) checked against the map's ``end`` keys; None: all of them. ValueError
    for an empty or out-of-range range."""
    if keys is None:
        return 0, end
    k0, k1 = int(keys[0]), int(keys[1])
    if not 0 <= k0 < k1 <= end:
        raise ValueError(f"key range {k0}..{k1 - 1} is outside the map's keys 0..{end - 1} (or empty)")
    return k0, k1


def blocks(w: np.ndarray, start: int, keys: tuple[int, int] | None = None) -> pd.DataFrame:
    """The cells drawn: per block of ``block_sizes`` queries × keys the entry with the largest |w| over its defined
    entries (key ≤ query), signed. Columns ``q0``, ``q1`` (queries q0..q1−1), ``k0``, ``k1``, ``weight``, ``t``,
    ``s`` (where that entry is; absolute positions). Blocks wholly above the diagonal are left out. ``keys``: only
    the key positions k0..k1−1 (a zoom: the blocks are then over that range)."""
    n, end = w.shape
    a, b = key_range(end, keys)
    w = w[:, a:b]
    m = b - a
    br, bc = block_sizes(n, m)
    nr, nc = -(-n // br), -(-m // bc)
    pad = np.full((nr * br, nc * bc), np.nan)
    pad[:n, :m] = w
    t = start + np.arange(nr * br)[:, None]
    s = a + np.arange(nc * bc)[None]
    pad[np.broadcast_to(s > t, pad.shape)] = np.nan
    cells = pad.reshape(nr, br, nc, bc).transpose(0, 2, 1, 3).reshape(nr, nc, br * bc)
    mag = np.where(np.isnan(cells), -1.0, np.abs(cells))
    j = mag.argmax(-1)
    val = np.take_along_axis(cells, j[..., None], -1)[..., 0]
    R, Cc = np.meshgrid(np.arange(nr), np.arange(nc), indexing="ij")
    ok = ~np.isnan(val)
    q0, k0 = start + R * br, a + Cc * bc
    return pd.DataFrame({"q0": q0[ok], "q1": np.minimum(q0 + br, start + n)[ok], "k0": k0[ok],
                         "k1": np.minimum(k0 + bc, b)[ok], "weight": val[ok],
                         "t": (q0 + j // bc)[ok], "s": (k0 + j % bc)[ok]})


def heatmap(w: np.ndarray, start: int, kind: str, title: str, subtitle: list[str], interactive: bool = True,
            keys: tuple[int, int] | None = None):
    """Query position (y, down) × key position (x) heatmap of ``w`` on the axes ``[0, end] × [start, end]`` (``keys``:
    only key positions k0..k1−1, the x axis ``[k0, k1]``; the colour scale stays the whole map's).

    kind "gdn": diverging red (positive) / blue (negative) colour centred at 0, symmetric-log scale (three decades
    below the largest |w|); kind "softmax": sequential, log scale from 10⁻⁴ (smaller probabilities get its colour).
    ``interactive``: a click on a cell selects its query block (the selection ``row``, field ``q0``), and an orange
    rule marks the picked query (:func:`with_query` sets it; drawn at the window's last query until then)."""
    n, end = w.shape
    k0, k1 = key_range(end, keys)
    df = blocks(w, start, (k0, k1))
    br, bc = block_sizes(n, k1 - k0)
    if kind == "gdn":
        causal = np.arange(end)[None] <= np.arange(start, start + n)[:, None]
        m = float(np.abs(np.where(causal, w, 0.0)).max()) if w.size else 1.0
        m = m if m > 0 else 1.0
        color = alt.Color("weight:Q", title=["w_t,s", "(signed, unnormalised)"],
                          scale=alt.Scale(type="symlog", constant=m / 1000, domain=[-m, m], domainMid=0,
                                          scheme="redblue", reverse=True),
                          legend=alt.Legend(orient="right", format=".1e", gradientLength=220,
                                            values=[-m, -m / 10, -m / 100, 0, m / 100, m / 10, m]))
    elif kind == "softmax":
        color = alt.Color("weight:Q", title=["softmax weight", "(probability)"],
                          scale=alt.Scale(type="log", domain=[1e-4, 1], clamp=True, scheme="viridis"),
                          legend=alt.Legend(orient="right", format=".0e", values=[1e-4, 1e-3, 1e-2, 1e-1, 1],
                                            gradientLength=220))
    else:
        raise ValueError(f"kind must be 'gdn' or 'softmax'; got {kind!r}")
    tips = [alt.Tooltip("t:Q", title="query position t"), alt.Tooltip("s:Q", title="key position s"),
            alt.Tooltip("weight:Q", title="weight", format=".4g")]
    if br > 1 or bc > 1:
        tips += [alt.Tooltip("q0:Q", title="block: first query"), alt.Tooltip("k0:Q", title="block: first key")]
    # the block ends are computed in the browser: fewer columns to send (up to MAX_ROWS × MAX_COLS cells)
    ch = alt.Chart(df.drop(columns=["q1", "k1"])).transform_calculate(
        q1=f"min(datum.q0 + {br}, {start + n})", k1=f"min(datum.k0 + {bc}, {k1})").mark_rect().encode(
        x=alt.X("k0:Q", title="key position s (token index)", scale=alt.Scale(domain=[k0, k1], nice=False)),
        x2="k1:Q",
        y=alt.Y("q0:Q", title="query position t (token index)", scale=alt.Scale(domain=[start, start + n],
                                                                                 nice=False, reverse=True)),
        y2="q1:Q", color=color, tooltip=tips)
    sub = list(subtitle)
    if (k0, k1) != (0, end):
        sub.append(f"zoom: keys {k0:,}..{k1 - 1:,} of 0..{end - 1:,}; colours: whole map")
    if br > 1 or bc > 1:
        sub.append(f"shown: {br} × {bc} blocks (queries × keys), each its largest |w|")
    if interactive:
        ch = ch.add_params(alt.selection_point(name="row", fields=["q0"], on="click", clear="dblclick"))
        rule = alt.Chart(alt.Data(values=[{}])).mark_rule(color="#ff7f0e", strokeWidth=1.5).encode(
            y=alt.Y(datum=start + n - 1)).properties(name=QUERY_RULE)
        sub.append("orange: the query t of the tables below (click a cell for another)")
        ch = alt.layer(ch, rule)
    return configure(ch.properties(width=WIDTH, height=HEIGHT, title=alt.Title(title, subtitle=sub)))


QUERY_RULE = "query_rule"


def with_query(spec: dict, t: int) -> dict:
    """``spec`` (an interactive :func:`heatmap` as a Vega-Lite dict) with its query rule at ``t``; a copy of the
    few dicts on the way, the datasets shared."""
    layers = [dict(lay, encoding={**lay["encoding"], "y": {**lay["encoding"]["y"], "datum": int(t)}})
              if lay.get("name") == QUERY_RULE else lay for lay in spec["layer"]]
    return {**spec, "layer": layers}


def context(tokens: list[str], s: int, before: int = 6, after: int = 3) -> tuple[str, str]:
    return "".join(tokens[max(0, s - before):s]), "".join(tokens[s + 1:s + 1 + after])


def top_keys(w: np.ndarray, start: int, tokens: list[str], t: int, n: int = 10) -> pd.DataFrame:
    """The ``n`` keys of query position ``t`` with the largest |w_{t,s}| (s ≤ t), with their text in context:
    ``rank``, ``key`` (position s), ``tokens_back`` (t − s), ``token``, ``context`` (``before[token]after``,
    newlines as ↵), ``weight``, and
    ``share`` (|w| over Σ_s |w_{t,s}|: the fraction of the row's absolute weight). ValueError for a ``t`` outside
    the window."""
    rows, end = w.shape
    if not start <= t < start + rows:
        raise ValueError(f"query position {t} is outside the window {start}..{start + rows - 1}")
    row = w[t - start, :t + 1]
    order = np.argsort(-np.abs(row), kind="stable")[:n]
    tot = float(np.abs(row).sum())
    ctx = [context(tokens, int(s)) for s in order]
    toks = [tokens[int(s)] for s in order]
    return pd.DataFrame({"rank": np.arange(1, len(order) + 1), "key": order, "tokens_back": t - order,
                         "token": toks,
                         "context": [f"{b}[{x}]{a}".replace("\n", "↵") for (b, a), x in zip(ctx, toks)],
                         "weight": row[order],
                         "share": np.abs(row[order]) / tot if tot > 0 else 0.0})
