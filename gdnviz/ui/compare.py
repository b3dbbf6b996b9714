"""The Compare page's sections: pick two stored runs (A, B), their heatmaps side by side on one colour scale with
the B − A difference, both runs' erank-vs-horizon scatter overlaid, and two stored sweeps' tables with their
difference. Every figure has the usual PNG / SVG / CSV downloads.

Session keys: ``cmp_a`` / ``cmp_b`` (run ids, picked from the store's list; A starts as this session's run, B
as nothing), ``cmp_metric``, ``cmp_sw_a`` / ``cmp_sw_b`` (sweep job ids).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import streamlit as st

from gdnviz import compare as K
from gdnviz import figures as F
from gdnviz.ui import common as C


def short_label(run: dict) -> str:
    """"<model> · <first document> (+k)" — enough to tell two runs apart in a legend."""
    model = Path(str(run.get("model_name", "?"))).name or "?"
    docs = [d.get("name", "?") for d in run.get("documents", [])]
    more = f" +{len(docs) - 1}" if len(docs) > 1 else ""
    return f"{model} · {docs[0] if docs else 'no documents'}{more}"


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


def heatmaps(run_a: dict, run_b: dict, ta: pd.DataFrame, tb: pd.DataFrame) -> None:
    """Side-by-side heatmaps of one statistic on a shared colour scale, then B − A (same grid only)."""
    st.session_state.setdefault("cmp_metric", "erank")
    st.radio("Statistic", list(F.HEATMAP_METRICS), key="cmp_metric", horizontal=True,
             format_func=lambda m: F.SHORT_LABELS.get(m, m))
    metric = st.session_state["cmp_metric"]
    la, lb = short_label(run_a), short_label(run_b)
    da, db = F.heatmap_frame(ta, metric), F.heatmap_frame(tb, metric)
    both = np.concatenate([da["value"].to_numpy(float), db["value"].to_numpy(float)])
    both = both[np.isfinite(both) & ((both > 0) if F.HEATMAP_METRICS[metric][1] == "log" else True)]
    dom = (float(both.min()), float(both.max())) if both.size else None
    a, b = st.columns(2)
    for col, tag, d, lab, key in ((a, "A", da, la, "cmp_heat_a"), (b, "B", db, lb, "cmp_heat_b")):
        with col:
            ch = F.heatmap(d, metric, interactive=False, color_domain=dom, title=f"{tag}: {lab}")
            C.chart(ch, d, f"compare_{tag}_{metric}", key=key, fixed_size=True)
    st.caption("A and B share one colour scale.")
    c, _ = st.columns(2)
    with c:
        why = K.grid_mismatch(run_a["model"], run_b["model"])
        if why:
            st.warning(why, icon=":material/warning:")
            return
        diff = K.difference_frame(ta, tb, metric)
        C.chart(K.difference_heatmap(diff, metric, (la, lb)), diff, f"compare_diff_{metric}", key="cmp_heat_d",
                fixed_size=True)
        big = diff.reindex(diff["value"].abs().sort_values(ascending=False).index).head(3)
        st.caption("Largest |B − A|: " + ", ".join(f"{C.head_label(l, h)} {v:+.3g}" for l, h, v in
                                                   zip(big["layer"], big["head"], big["value"])))


def scatter(run_a: dict, run_b: dict) -> None:
    ova, ovb = C.run_overview(run_a), C.run_overview(run_b)
    ta, tb = C.run_table(run_a), C.run_table(run_b)
    la, lb = short_label(run_a), short_label(run_b)
    if la == lb:
        la, lb = f"A: {la}", f"B: {lb}"
    df = K.overlay_frame({la: ta, lb: tb})
    rho = {la: F.rho_text(ova["spearman_erank_horizon"], ova["spearman_ci95"]),
           lb: F.rho_text(ovb["spearman_erank_horizon"], ovb["spearman_ci95"])}
    rmax = max(min(int(r["model"]["d_k"]), int(r["model"]["d_v"])) for r in (run_a, run_b))
    paired = K.grid_mismatch(run_a["model"], run_b["model"]) is None
    C.chart(K.overlay_scatter(df, rho, rmax, paired), df, "compare_erank_vs_horizon", key="cmp_scatter")


def sweeps() -> None:
    """Two stored sweeps' seed-000 tables side by side, and B − A on the cells both measured."""
    from gdnviz.probes import sweep
    from gdnviz.ui import sweeps as S

    prev = S.previous_sweeps(C.store())
    if len(prev) < 2:
        st.caption(f"{len(prev)} finished sweep(s) in the store: run sweeps on the **Retrieval sweeps** page "
                   "(one per model or document set) to compare their tables here.")
        return
    labels = {p["id"]: p["label"] for p in prev}
    ids = list(labels)
    c1, c2 = st.columns(2)
    c1.selectbox("Sweep A", ids, key="cmp_sw_a", index=None, format_func=labels.get, placeholder="Pick sweep A")
    c2.selectbox("Sweep B", ids, key="cmp_sw_b", index=None, format_func=labels.get, placeholder="Pick sweep B")
    a, b = st.session_state.get("cmp_sw_a"), st.session_state.get("cmp_sw_b")
    if a is None or b is None:
        return
    tabs = []
    for col, jid in ((c1, a), (c2, b)):
        res = C.store().job(jid)["result"]
        tab = sweep.table_frame(res["table"])
        tabs.append(tab)
        with col:
            st.dataframe(S.seed000_table(tab, int(res["rmax"])), hide_index=True, width="stretch")
    diff = K.sweep_difference(*tabs)
    if diff.empty:
        st.warning("The two sweeps share no (task, length, r) cell: nothing to subtract.", icon=":material/warning:")
        return
    st.markdown("**B − A** on the cells both sweeps measured — RULER score (%), each a mean over its own n samples "
                "(not a paired difference)")
    st.dataframe(diff.rename(columns={"length": "length (tokens)", "score_a": "A score (%)", "score_b":
                                      "B score (%)", "delta": "B − A (points)", "n_a": "n A", "n_b": "n B"}),
                 hide_index=True, width="stretch",
                 column_config={"B − A (points)": st.column_config.NumberColumn(format="%+.1f")})
    st.download_button("CSV", data=F.to_csv(diff), file_name="compare_sweeps.csv", mime="text/csv",
                       on_click="ignore", key="cmp_sw_csv", icon=":material/table:")
