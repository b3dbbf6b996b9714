"""Overview figures: erank vs horizon (a click on a point shows its head in a panel under the figures, or picks it),
the horizon histogram, and the share of heads forgetting within a segment."""
from __future__ import annotations

import numpy as np
import streamlit as st

from gdnviz import figures as F
from gdnviz.ui import common as C
from gdnviz.ui import head_panel
from gdnviz.ui import run_figures as RF

C.ensure_entrypoint()

st.title("Overview figures")
got = C.require_run()
if got is None:
    st.stop()
run, table = got
L = int(run["segment_len"])
ov = C.run_overview(run)
n_docs = len(run["documents"])
st.caption(f"{ov['n_heads']} GDN heads, statistics of the state at each document's end, median over {n_docs} "
           f"document{'s' if n_docs != 1 else ''} · segment length L = {L} · run `{run['run_id']}`")

m = st.columns(5)
rho = ov["spearman_erank_horizon"]
lo, hi = ov["spearman_ci95"]
m[0].metric("Spearman ρ", "n/a" if not np.isfinite(rho) else f"{rho:.2f}",
            delta=f"95% CI {lo:.2f} to {hi:.2f}" if np.isfinite(lo) and np.isfinite(hi) else None,
            delta_color="off", delta_arrow="off",
            help="rank correlation of effective rank and horizon across heads; seed 000 reports 0.91 for "
                 "Qwen3.5-0.8B. Interval: percentile bootstrap over heads (2000 resamples, seed 0)")
m[1].metric("Forget within L", f"{100 * ov['share_forgetting_within_segment']:.0f}%",
            help=f"share of heads forgetting within a segment: horizon 1/(1−ᾱ) < L = {L} tokens")
m[2].metric("Median erank", f"{ov['erank_median']:.1f}", help=f"max {ov['erank_max']:.1f}, "
            f"25th percentile {ov['erank_q25']:.1f}")
m[3].metric("Median num. rank", f"{ov['numerical_rank_median']:.0f}",
            help=f"of min(d_k, d_v) = {min(run['model']['d_k'], run['model']['d_v'])}")
m[4].metric("Max erank", f"{ov['erank_max']:.1f}")

# the scatter (a click shows its head in the panel under these figures, or picks it; app.py handled it before
# anything was drawn: common.HEAD_CLICKS) and the horizon histogram, drawn into their place above the panel after
# its heading and numbers (head_panel.panel)
above = st.container()


def figure(which):  # (spec, CSV) of a figure no click changes, built once per run (run_figures.overview_figure)
    return RF.overview_figure(str(C.store().dir), run["run_id"], tuple(d["key"] for d in run["documents"]), L, which)


def draw_above(lh):  # lh: the panel's open head, ringed on the scatter
    with above:
        a, b = st.columns(2)
        with a:
            rmax = min(int(run["model"]["d_k"]), int(run["model"]["d_v"]))
            ci = tuple(float(x) for x in ov["spearman_ci95"])
            spec, csv = RF.erank_vs_horizon(str(C.store().dir), run["run_id"],
                                            tuple(d["key"] for d in run["documents"]), float(rho), rmax, ci, lh)
            C.click_action_radio("shows it below these figures")
            C.chart(spec, csv, "erank_vs_horizon", key="ov_evh", on_select="rerun", selection_mode="head",
                    export=lambda: F.erank_vs_horizon_chart(table, float(rho), rmax, ci))
            picked = C.picked_heads()
            if picked:
                st.caption(f"Truncation set ({len(picked)} head{'s' if len(picked) != 1 else ''}): "
                           + ", ".join(C.head_label(*p) for p in picked))
        with b:
            C.chart(*figure("horizon_hist"), "horizon_histogram", key="ov_hist")


head_panel.panel(run["model"], run, table, draw_above)
C.chart(*figure("forgetting"), "forgetting_by_layer", key="ov_forget")
C.chart(*figure("keycone_ceiling"), "keycone_ceiling", key="ov_ceiling", fixed_size=True)
st.caption("Seed 000 §2: heads with short horizons sit on y = x (they hold about as many directions as distinct keys "
           "inside their horizon); long-horizon heads plateau, capped by the narrow cone of their keys.")
