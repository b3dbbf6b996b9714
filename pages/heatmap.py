"""Heatmap: one statistic for every (layer, head), median over the document set; a click on a cell shows that head
in a panel under the heatmap (or picks it for the truncation set)."""
from __future__ import annotations

import streamlit as st

from gdnviz import figures as F
from gdnviz.ui import common as C
from gdnviz.ui import head_panel
from gdnviz.ui import run_figures as RF

C.ensure_entrypoint()

st.title("Heatmap")
got = C.require_run()
if got is None:
    st.stop()
run, table = got

METRICS = list(F.HEATMAP_METRICS)
st.session_state.setdefault("heat_metric", "erank")
metric = st.session_state["heat_metric"]

# a click on a cell was handled by app.py before anything was drawn (common.HEAD_CLICKS): the head it opened is
# shown in the panel under the heatmap (its URL: /heatmap?layer=l&head=h), or its pick in the truncation set, in
# this run

c1, c2 = st.columns([3, 2])
c1.radio("Statistic", METRICS, key="heat_metric", horizontal=True,
         format_func=lambda m: {"erank": "effective rank", "numerical_rank": "numerical rank",
                                "stable_rank": "stable rank", "horizon": "horizon", "mean_key_norm": "key-cone norm",
                                "energy_rank99": "r for 99% energy",
                                "key_cov_erank": "key-covariance erank", "decayed_P_erank": "decayed-P erank"}[m])
with c2:
    C.click_action_radio("shows it below the heatmap")
n_docs = len(run["documents"])
st.caption(f"{F.HEATMAP_METRICS[metric][0]} of each head's state at the document end, median over {n_docs} "
           f"document{'s' if n_docs != 1 else ''} (min–max in the tooltip) · GDN layers only "
           f"(full-attention layers {list(run['model']['attn_layers'])} carry no state) · run `{run['run_id']}`")

# the heatmap and the truncation set, with the head panel under them; the panel sends its heading and numbers
# first, then has these drawn into their place above it, then its chart (docs/ui-speed.md)
above = st.container()


def draw_above(lh):  # the heatmap frames the head the panel shows (none while it is closed), as the other pages do
    sel = lh
    keys = tuple(d["key"] for d in run["documents"])
    spec, csv = RF.heatmap(str(C.store().dir), run["run_id"], keys, metric, sel, tuple(C.picked_heads()),
                           st.session_state.get("click_action") == "pick")
    with above:
        C.chart(spec, csv, f"heatmap_{metric}", key="heat", on_select="rerun", selection_mode="cell",
                fixed_size=True, export=lambda: F.heatmap(F.heatmap_frame(table, metric), metric, interactive=False))
        picked = C.picked_heads()
        if picked:
            st.markdown(f"**Truncation set** ({len(picked)} head{'s' if len(picked) != 1 else ''}): "
                        + ", ".join(C.head_label(*p) for p in picked))
            with st.container(horizontal=True, gap="small"):
                C.page_link("truncate", "Truncate these heads", icon=":material/content_cut:")
                if st.button("Clear the set", key="clear_picked"):
                    st.session_state["picked_heads"] = []
                    st.rerun()
        else:
            st.caption("Switch *Clicking a head* to “adds / removes it in the truncation set” to collect heads for "
                       "**Truncate & compare**.")


head_panel.panel(run["model"], run, table, draw_above)

with st.expander("Table of all heads (median, min, max over documents)"):
    cols = ["layer", "head"] + [c for m in METRICS for c in (m, f"{m}_min", f"{m}_max")] + \
           ["forgets_within_segment", "n_docs"]
    st.dataframe(table[cols], hide_index=True, width="stretch")
    st.download_button("CSV", data=lambda: F.to_csv(table), file_name=f"heads_{run['run_id']}.csv", mime="text/csv",
                       on_click="ignore", key="heads_csv")
