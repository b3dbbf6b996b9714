"""The figures of a run as Vega-Lite specs (``specs.spec``) with their CSV, built once and cached for the server.

A cache entry is keyed by the store directory, the run id and the memo keys of the run's documents (which name
their content), plus the figure's own arguments (head, document, metric, the highlighted cells): it is a pure
function of those, so sessions share it safely, and a run whose results change gets new keys. Revisiting a head
or a statistic costs a cache lookup instead of rebuilding and serialising its charts.
"""
from __future__ import annotations

import streamlit as st

from gdnviz import figures as F
from gdnviz.ui import specs


def _captures(cache_dir: str, run_id: str, keys: tuple):
    from gdnviz.ui.common import _load_captures

    return _load_captures(cache_dir, run_id, keys)


def _table(cache_dir: str, run_id: str, keys: tuple):
    from gdnviz.ui.common import _run_table

    return _run_table(cache_dir, run_id, keys)


@st.cache_data(show_spinner=False, max_entries=512)
def heatmap(cache_dir: str, run_id: str, keys: tuple, metric: str, selected: tuple | None, picked: tuple,
            pick_mode: bool) -> tuple[dict, bytes]:
    """(spec, CSV) of the heatmap of ``metric``; ``selected`` framed black, ``picked`` orange; the subtitle says
    what a click does (show the head in the panel under the heatmap, or add / remove it in the truncation set when
    ``pick_mode``)."""
    df = F.heatmap_frame(_table(cache_dir, run_id, keys), metric)
    sub = ["click a cell to add it to / remove it from the truncation set" if pick_mode
           else "click a cell to see that head below", "hover for the min–max over documents"]
    with specs.fast_build():
        ch = F.heatmap(df, metric, selected=selected, picked=picked, subtitle=sub)
    return specs.spec(ch), F.to_csv(df)


HEAD_FIGURES = ("spectrum", "erank_along", "energy", "alpha", "keycone", "per_document")
SEED_RANKS = (1, 4, 12, 32)  # seed 000's ranks, marked on the energy-kept figure


@st.cache_data(show_spinner=False, max_entries=1024)
def head_figure(cache_dir: str, run_id: str, keys: tuple, names: tuple, li: int, head: int, doc: str,
                segment_len: int, which: str, rank_max: int = 0) -> tuple:
    """One figure of the Head page for GDN layer position ``li`` (index into the model's GDN layers), value head
    ``head`` and the document ``doc`` of ``names``: ``which`` in HEAD_FIGURES → (spec, CSV); "energy" → (spec, CSV,
    per-document energy kept at ``SEED_RANKS`` and the smallest r keeping 99%); "alpha" → (spec, CSV,
    per-document ᾱ / horizon / β̄ frame); "keycone" → (spec, CSV, the document's key-cone numbers); "per_document"
    draws the state's ranks up to ``rank_max`` (0: unbounded). One figure per call, so that the page draws each
    chart as soon as it is built."""
    caps = _captures(cache_dir, run_id, keys)
    names = list(names)
    with specs.fast_build():
        if which == "spectrum":
            sp = F.spectrum_frame(caps, names, li, head)
            return specs.spec(F.spectrum_chart(sp, doc)), F.to_csv(sp[sp.document == doc])
        if which == "erank_along":
            al = F.erank_along_frame(caps, names, li, head)
            return specs.spec(F.erank_along_chart(al, segment_len)), F.to_csv(al)
        if which == "energy":
            en = F.energy_frame(caps, names, li, head)
            ek = en[en["r"].isin(SEED_RANKS)].pivot(index="document", columns="r", values="energy")
            ek.columns = [f"r = {c}" for c in ek.columns]
            ek["smallest r keeping 99%"] = en.drop_duplicates("document").set_index("document")["r_share"]
            return (specs.spec(F.energy_chart(en, marked_r=SEED_RANKS)), F.to_csv(en), ek.reset_index())
        if which == "alpha":
            hist, stats = F.alpha_frame(caps, names, li, head)
            return specs.spec(F.alpha_chart(hist, stats, segment_len)), F.to_csv(hist), stats
        if which == "keycone":
            cap = caps[names.index(doc)]
            kdf, kinfo = F.keycone_frame(cap, li, head)
            kc = {k: float(cap.keycone[k][li, head]) for k in ("mean_key_norm", "key_cov_erank",
                                                                "decayed_P_erank_sqrt", "decayed_P_erank_eig")}
            return specs.spec(F.keycone_chart(kdf, kinfo, doc)), F.to_csv(kdf), kc
        if which == "per_document":
            pdf = F.per_document_frame(caps, names, li, head)
            return specs.spec(F.per_document_chart(pdf, rank_max or None)), F.to_csv(pdf)
    raise ValueError(f"no Head page figure {which!r}: one of {HEAD_FIGURES}")


@st.cache_data(show_spinner=False, max_entries=64)
def erank_vs_horizon(cache_dir: str, run_id: str, keys: tuple, rho: float, rank_max: int,
                     ci: tuple = (), selected: tuple | None = None) -> tuple[dict, bytes]:
    """(spec, CSV) of the Overview's effective rank vs horizon scatter (ρ's interval ``ci``), its points clickable
    (param ``head``), the open head ``selected`` (layer, head) ringed."""
    table = _table(cache_dir, run_id, keys)
    with specs.fast_build():
        ch = F.erank_vs_horizon_chart(table, rho, rank_max, ci or None, interactive=True, selected=selected)
    return specs.spec(ch), F.to_csv(table[["layer", "head", "erank", "erank_min", "erank_max", "horizon"]])


OVERVIEW_FIGURES = ("horizon_hist", "forgetting", "keycone_ceiling")


@st.cache_data(show_spinner=False, max_entries=256)
def overview_figure(cache_dir: str, run_id: str, keys: tuple, segment_len: int, which: str) -> tuple[dict, bytes]:
    """(spec, CSV) of one of the Overview's figures that no click changes, ``which`` in OVERVIEW_FIGURES: the
    horizon histogram, the share of heads forgetting within a segment per layer, the key cone's ceiling."""
    table = _table(cache_dir, run_id, keys)
    with specs.fast_build():
        if which == "horizon_hist":
            return specs.spec(F.horizon_hist_chart(table, segment_len)), F.to_csv(table[["layer", "head", "horizon"]])
        if which == "forgetting":
            fl = F.forgetting_by_layer_frame(table, segment_len)
            return specs.spec(F.forgetting_chart(fl, segment_len)), F.to_csv(fl)
        if which == "keycone_ceiling":
            kc = table[["layer", "head", "erank", "horizon", "mean_key_norm", "key_cov_erank"]]
            return specs.spec(F.keycone_ceiling_chart(table)), F.to_csv(kc)
    raise ValueError(f"unknown Overview figure {which!r}; known: {', '.join(OVERVIEW_FIGURES)}")


HOLDS_FIGURES = ("along", "directions", "rewrite")


@st.cache_data(show_spinner=False, max_entries=64)
def holds_figure(cache_dir: str, memo_key: str, which: str) -> tuple[dict, bytes]:
    """(spec, CSV) of one figure of a stored HoldsJob result (``memo_key``: ``gdnviz.jobs.holds_key``, which names
    the model, the tokens and the request, so the entry is a pure function of it); ``which`` in HOLDS_FIGURES.
    KeyError when the result is not in the memo (nothing is cached then)."""
    from gdnviz.ui import holds_charts as HC
    from gdnviz.ui.common import _store

    res = _store(cache_dir).memo_get_json(memo_key)
    if res is None:
        raise KeyError(f"no stored result under {memo_key}")
    with specs.fast_build():
        if which == "along":
            return specs.spec(HC.along_chart(res)), F.to_csv(HC.contributions_frame(res))
        if which == "directions":
            return specs.spec(HC.directions_chart(res)), F.to_csv(HC.contributions_frame(res))
        if which == "rewrite":
            return specs.spec(HC.rewrite_chart(res)), F.to_csv(HC.rewrite_frame(res))
    raise ValueError(f"no holds figure {which!r}: one of {HOLDS_FIGURES}")
