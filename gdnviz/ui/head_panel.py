"""The Heatmap's head panel: a click on a cell (not in pick mode) shows that head under the heatmap in the same
script run, without a page switch: its heading and six key numbers (``head_summary``, as on the Head page), the
singular spectrum of the document the Head page shows (the Head page's cached figure), and a link to the full
Head page.

``common.click_opens_or_picks`` opens it: the clicked head becomes the session's open head ("layer", "head") and
"head_panel" is set. The panel always shows the current run's numbers of the open head, so it stays open across
a change of statistic or of page, follows a head changed on the Head page, and is closed when the run shown has
no such head (another model's run)."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from gdnviz.ui import common as C
from gdnviz.ui import head_summary as HSum
from gdnviz.ui import run_figures as RF

OPEN = "head_panel"


def open_head(run: dict) -> tuple[int, int] | None:
    """(layer, head) the panel shows for ``run``: the open head while the panel is open and the head is one of the
    run's model; else None, and the panel is closed."""
    if not st.session_state.get(OPEN):
        return None
    model = run["model"]
    layer, head = st.session_state.get("layer"), st.session_state.get("head")
    if layer in model["gdn_layers"] and head is not None and 0 <= int(head) < int(model["num_heads"]):
        return int(layer), int(head)
    st.session_state.pop(OPEN, None)
    return None


def _close() -> None:
    st.session_state.pop(OPEN, None)


def panel(run: dict, table: pd.DataFrame, between) -> None:
    """The open head of ``run`` (``table``: its head table) in a bordered box, or nothing while the panel is
    closed. ``between`` (a function) is called after the panel's heading and numbers and before its chart (at once
    while the panel is closed): the Heatmap page draws its heatmap and truncation set there, into a container above
    the panel, so that the heading is sent before the heatmap's update and a pick's set before the spectrum."""
    lh = open_head(run)
    if lh is None:
        between()
        return
    layer, head = lh
    names = [d["name"] for d in run["documents"]]
    doc = HSum.shown_document(names)
    gl = list(run["model"]["gdn_layers"])
    with st.container(border=True, key="head_panel_box"):
        HSum.heading(run, layer, head)
        with st.container(horizontal=True, gap="small", vertical_alignment="center"):
            C.page_link("head", "Open the full head page", icon=":material/open_in_full:",
                        query_params={"layer": str(layer), "head": str(head)})
            st.button("Close", key="head_panel_close", on_click=_close, icon=":material/close:", type="tertiary")
        HSum.key_numbers(run, HSum.head_row(table, layer, head), "on the full head page",
                         f"The spectrum shows one document, “{doc}”.")
        between()
        a, b = st.columns(2)
        with a:
            spec, csv = RF.head_figure(str(C.store().dir), run["run_id"], tuple(d["key"] for d in run["documents"]),
                                       tuple(names), gl.index(layer), head, doc, int(run["segment_len"]), "spectrum")
            C.chart(spec, csv, f"L{layer}H{head}_spectrum", key="head_panel_spectrum", downloads=False)
        b.caption("**The full head page** adds this head's effective rank along each document, the energy kept by a "
                  "rank-r truncation, its decay α and key cone, the spread of every statistic over the documents, what "
                  "its state holds and its exact attention map, each figure with PNG / SVG / CSV downloads.")
