"""The Compare page's sections: pick two stored runs (A, B), their heatmaps side by side on one colour scale with
the B − A difference, both runs' erank-vs-horizon scatter overlaid, and two stored sweeps' tables with their
difference. Every figure has the usual PNG / SVG / CSV downloads, every table its CSV, and the whole comparison
downloads as one zip (``compare.comparison_zip``).

Session keys: ``cmp_a`` / ``cmp_b`` (run ids, picked from the store's list; A starts as this session's run, B
as nothing), ``cmp_metric``, ``cmp_sw_a`` / ``cmp_sw_b`` (sweep job ids); all kept across page switches
(``common.PERSISTED``); one no longer in the store's list is reset (A to this session's run, the others to
nothing).
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import streamlit as st

from gdnviz import compare as K
from gdnviz import figures as F
from gdnviz.ui import common as C


def pick_runs() -> tuple[dict, dict] | None:
    """Two selectboxes over the store's runs; returns (run A, run B) once both are picked and differ, else None
    after saying what is missing."""
    runs, bad = C.store().read_runs()
    C.unreadable_runs_warning(bad)
    if len(runs) < 2:
        C.empty_state("Two runs are needed.", f"The store holds {len(runs)} readable run(s). Run another capture on "
                      "the **Model & documents** page (another model on the same documents, or the same model on "
                      "other documents), then come back.")
        return None
    ids = [r["run_id"] for r in runs]
    labels = {r["run_id"]: C.run_label(r) for r in runs}
    if st.session_state.get("cmp_a") not in ids:
        st.session_state["cmp_a"] = st.session_state.get("run_id") if st.session_state.get("run_id") in ids else None
    if st.session_state.get("cmp_b") not in ids:
        st.session_state["cmp_b"] = None
    c1, c2 = st.columns(2)
    c1.selectbox("Run A", ids, key="cmp_a", format_func=lambda r: labels.get(r, r), placeholder="Pick run A")
    c2.selectbox("Run B", ids, key="cmp_b", format_func=lambda r: labels.get(r, r), placeholder="Pick run B")
    a, b = st.session_state.get("cmp_a"), st.session_state.get("cmp_b")
    if a is None or b is None:
        st.info("Pick two runs from the store's list: A and B. Differences are B − A.", icon=":material/info:")
        return None
    if a == b:
        st.warning("Run A and run B are the same run: pick another run for B.", icon=":material/warning:")
        return None
    return next(r for r in runs if r["run_id"] == a), next(r for r in runs if r["run_id"] == b)


def run_summary(tag: str, run: dict) -> None:
    docs = ", ".join(d["name"] for d in run["documents"])
    m = run["model"]
    st.markdown(f"**{tag}** `{run['run_id']}` · {Path(str(run['model_name'])).name} · {len(m['gdn_layers'])} GDN "
                f"layers × {m['num_heads']} heads · L = {run['segment_len']}  \n<span style='color:gray'>documents: "
                f"{docs}</span>", unsafe_allow_html=True)


def metric() -> str:
    """The statistic radio (``cmp_metric``, erank at first); returns the statistic picked."""
    st.session_state.setdefault("cmp_metric", "erank")
    st.radio("Statistic", list(F.HEATMAP_METRICS), key="cmp_metric", horizontal=True,
             format_func=lambda m: F.SHORT_LABELS.get(m, m))
    return st.session_state["cmp_metric"]


def figures(run_a: dict, run_b: dict, ta: pd.DataFrame, tb: pd.DataFrame, metric: str) -> dict[str, tuple]:
    """``compare.comparison_figures`` of the two runs (their overviews memoised)."""
    return K.comparison_figures((run_a, run_b), (ta, tb), (C.run_overview(run_a), C.run_overview(run_b)), metric)


def heatmaps(run_a: dict, run_b: dict, figs: dict[str, tuple], metric: str) -> None:
    """Side-by-side heatmaps of one statistic on a shared colour scale, then B − A (same grid only)."""
    a, b = st.columns(2)
    for col, tag, key in ((a, "A", "cmp_heat_a"), (b, "B", "cmp_heat_b")):
        with col:
            C.chart(*figs[f"compare_{tag}_{metric}"], f"compare_{tag}_{metric}", key=key, fixed_size=True)
    st.caption("A and B share one colour scale.")
    c, _ = st.columns(2)
    with c:
        why = K.grid_mismatch(run_a["model"], run_b["model"])
        if why:
            st.warning(why, icon=":material/warning:")
            return
        ch, diff = figs[f"compare_diff_{metric}"]
        C.chart(ch, diff, f"compare_diff_{metric}", key="cmp_heat_d", fixed_size=True)
        big = diff.reindex(diff["value"].abs().sort_values(ascending=False).index).head(3)
        st.caption("Largest |B − A|: " + ", ".join(f"{C.head_label(l, h)} {v:+.3g}" for l, h, v in
                                                   zip(big["layer"], big["head"], big["value"])))


def scatter(figs: dict[str, tuple]) -> None:
    C.chart(*figs["compare_erank_vs_horizon"], "compare_erank_vs_horizon", key="cmp_scatter")


def _csv_button(df: pd.DataFrame, name: str, key: str, tip: str | None = None) -> None:
    st.download_button("CSV", data=F.to_csv(df), file_name=f"{name}.csv", mime="text/csv", on_click="ignore",
                       key=key, icon=":material/table:", help=tip)


def sweeps() -> tuple[tuple[str, pd.DataFrame], tuple[str, pd.DataFrame]] | None:
    """Two stored sweeps' seed-000 tables side by side, and B − A on the cells both measured, each with its CSV;
    returns ((job id, table) of sweep A, of sweep B) once both are picked, else None."""
    from gdnviz.probes import sweep
    from gdnviz.ui import sweeps as S

    prev = S.previous_sweeps(C.store())
    if len(prev) < 2:
        st.caption(f"{len(prev)} finished sweep(s) in the store: run sweeps on the **Retrieval sweeps** page "
                   "(one per model or document set) to compare their tables here.")
        return None
    labels = {p["id"]: p["label"] for p in prev}
    ids = list(labels)
    for k in ("cmp_sw_a", "cmp_sw_b"):
        if st.session_state.get(k) not in ids:  # none yet, or no longer in the store's list
            st.session_state[k] = None
    c1, c2 = st.columns(2)
    c1.selectbox("Sweep A", ids, key="cmp_sw_a", format_func=labels.get, placeholder="Pick sweep A")
    c2.selectbox("Sweep B", ids, key="cmp_sw_b", format_func=labels.get, placeholder="Pick sweep B")
    a, b = st.session_state.get("cmp_sw_a"), st.session_state.get("cmp_sw_b")
    if a is None or b is None:
        return None
    results = [C.store().job(jid)["result"] for jid in (a, b)]
    tabs = K.sweep_tables(*(sweep.table_frame(res["table"]) for res in results))
    for col, res, name, key in zip((c1, c2), results, tabs, ("cmp_sw_a_csv", "cmp_sw_b_csv")):
        with col:
            st.dataframe(S.seed000_table(tabs[name], int(res["rmax"])), hide_index=True, width="stretch")
            _csv_button(tabs[name], name, key, "this sweep's table in long form: one row per (task, length, setting, "
                                               "r), the numbers as measured")
    picked = ((a, tabs["compare_sweep_A"]), (b, tabs["compare_sweep_B"]))
    diff = tabs["compare_sweep_B_minus_A"]
    if diff.empty:
        st.warning("The two sweeps share no (task, length, r) cell: nothing to subtract.", icon=":material/warning:")
        return picked
    st.markdown("**B − A** on the cells both sweeps measured — RULER score (%), each a mean over its own n samples "
                "(not a paired difference)")
    st.dataframe(diff.rename(columns={"length": "length (tokens)", "score_a": "A score (%)", "score_b":
                                      "B score (%)", "delta": "B − A (points)", "n_a": "n A", "n_b": "n B"}),
                 hide_index=True, width="stretch",
                 column_config={"B − A (points)": st.column_config.NumberColumn(format="%+.1f")})
    _csv_button(diff, "compare_sweep_B_minus_A", "cmp_sw_csv")
    return picked


def download_zip(run_a: dict, run_b: dict, ta: pd.DataFrame, tb: pd.DataFrame, metric: str, sweep_pair) -> None:
    """"Download this comparison (zip)": ``compare.comparison_zip`` at the sidebar's export settings, built on
    click; ``sweep_pair``: what ``sweeps`` returned."""
    from gdnviz.ui.export import export_kwargs

    ex = export_kwargs()  # read here: the zip is built on click, outside this session's script run
    ov = (C.run_overview(run_a), C.run_overview(run_b))
    st.download_button(
        "Download this comparison (zip)", data=lambda: K.comparison_zip((run_a, run_b), (ta, tb), ov, metric,
                                                                        sweep_pair, **ex),
        file_name=f"gdnviz-compare-{run_a['run_id']}-{run_b['run_id']}.zip", mime="application/zip",
        on_click="ignore", key="cmp_zip", icon=":material/folder_zip:",
        help="Every figure on this page (PNG + SVG at the sidebar's export size and scale) with its data (CSV), the "
             "sweep tables when two sweeps are picked (CSV), and settings.json naming both runs")
