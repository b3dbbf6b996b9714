"""The head panel of the pages with a chart of heads (Heatmap, Overview figures, Head scans & budgets): a click on a
head (not in pick mode) shows it under the chart in the same script run, without a page switch: its heading and six
key numbers (``head_summary``, as on the Head page), the singular spectrum of the document the Head page shows (the
Head page's cached figure), and a link to the full Head page.

``common.click_opens_or_picks`` opens it: the clicked head becomes the session's open head ("layer", "head") and
"head_panel" is set. The panel always shows the current run's numbers of the open head, so it stays open across
a change of statistic or of page, follows a head changed on the Head page, and is closed when the model of the
page's chart has no such head (another model's run).

The page's URL holds the open head (query params ``layer`` and ``head``, as on the Head page) while the panel is open
and neither while it is closed, so a reload or a shared link reopens the same panel. Query params that this session
did not write there itself (a reload or a pasted link: a new session) open the panel on their head."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from gdnviz.ui import common as C
from gdnviz.ui import head_summary as HSum
from gdnviz.ui import run_figures as RF

OPEN = "head_panel"
WRITTEN = "head_panel_url"  # the (layer, head) strings this session last wrote to the URL (None: it removed them)
REVEAL = "head_panel_reveal"  # set by a click that opened the panel: scroll its numbers into view once

# Scrolls the panel's key numbers (else the panel) into view by the least distance, once they are drawn: under a tall
# heatmap the panel starts below the fold, and this keeps as much of the chart in view as it can. ``NONCE`` makes
# each click's script a new element (head_panel_reveals counts them), so that the frontend runs it again.
_REVEAL_JS = """<script data-nonce="NONCE">(function () {
  let tries = 0;
  function go() {
    const box = document.querySelector('.st-key-head_panel_box');
    const metrics = box ? box.querySelectorAll('[data-testid="stMetric"]') : [];
    if ((!box || (HAS_NUMBERS && !metrics.length)) && tries++ < 40) { setTimeout(go, 50); return; }
    const target = metrics.length ? metrics[metrics.length - 1] : box;
    if (target) target.scrollIntoView({block: 'nearest'});
  }
  go();
})();</script>"""


def _from_url(model: dict) -> None:
    """Open the panel on the head of the URL's query params when this session did not write them there (a
    reload, a pasted link); an error names a link that is no head of ``model``."""
    q = (st.query_params.get("layer"), st.query_params.get("head"))
    if q == (None, None) or q == st.session_state.get(WRITTEN):
        return
    st.session_state[WRITTEN] = q
    lh = HSum.head_from_url(model, "Click a head to show it here.")
    if lh is None:
        st.session_state.pop(OPEN, None)
        return
    st.session_state["layer"], st.session_state["head"] = lh
    st.session_state[OPEN] = True


def _to_url(lh: tuple[int, int] | None) -> None:
    """Write the open head ``lh`` to the URL's query params, or remove them while the panel is closed."""
    if lh is None:
        for k in ("layer", "head"):
            if k in st.query_params:
                del st.query_params[k]
        st.session_state[WRITTEN] = None
        return
    q = (str(lh[0]), str(lh[1]))
    if (st.query_params.get("layer"), st.query_params.get("head")) != q:
        st.query_params.update(layer=q[0], head=q[1])
    st.session_state[WRITTEN] = q


def open_head(model: dict) -> tuple[int, int] | None:
    """(layer, head) the panel shows for a chart of the heads of ``model`` (its "gdn_layers", "num_heads"): the
    open head while the panel is open and the head is one of ``model``'s; else None, and the panel is closed. The
    URL's head, when this session did not write it, opens the panel first; the result is written to the URL."""
    _from_url(model)
    lh = None
    if st.session_state.get(OPEN):
        layer, head = st.session_state.get("layer"), st.session_state.get("head")
        if HSum.is_head(model, layer, head):
            lh = int(layer), int(head)
        else:
            st.session_state.pop(OPEN, None)
    _to_url(lh)
    return lh


def _close() -> None:
    st.session_state.pop(OPEN, None)


def _reveal(has_numbers: bool) -> None:
    """Once per click that opened the panel: scroll its key numbers (``has_numbers``; else the panel) into view."""
    if st.session_state.pop(REVEAL, None):
        st.session_state["head_panel_reveals"] = k = st.session_state.get("head_panel_reveals", 0) + 1
        st.html(_REVEAL_JS.replace("NONCE", str(k)).replace("HAS_NUMBERS", "true" if has_numbers else "false"),
                unsafe_allow_javascript=True)


def panel(model: dict, run: dict | None, table: pd.DataFrame | None, between) -> None:
    """The open head of a chart of the heads of ``model`` in a bordered box, or nothing while the panel is closed.
    ``run`` (``table``: its head table) is a run of ``model`` whose numbers the panel shows, or None: the panel
    then says that no capture of this model is open in this session. ``between(lh)`` is called after the
    panel's heading and numbers and before its chart (at once while the panel is closed), with the head the panel
    shows (``open_head``: (layer, head), or None while it is closed): the page draws its chart of heads there, into
    a container above the panel, so that the heading is sent before the chart's update."""
    lh = open_head(model)
    if lh is None:
        between(None)
        return
    layer, head = lh
    with st.container(border=True, key="head_panel_box"):
        if run is None:
            st.markdown(f"### Layer {layer} · head {head}  \n<span style='color:gray'>state {model['d_k']} × "
                        f"{model['d_v']} · no capture of this model is open in this session</span>",
                        unsafe_allow_html=True)
        else:
            HSum.heading(run, layer, head)
        with st.container(horizontal=True, gap="small", vertical_alignment="center"):
            if run is None:
                C.page_link("documents", "Capture documents with this model", icon=":material/arrow_forward:")
            else:
                C.page_link("head", "Open the full head page", icon=":material/open_in_full:",
                            query_params={"layer": str(layer), "head": str(head)})
            st.button("Close", key="head_panel_close", on_click=_close, icon=":material/close:", type="tertiary")
        if run is None:
            st.caption("A head's effective rank, horizon, key cone and spectrum come from a capture: run one on "
                       "**Model & documents**, or open one of this model under *Previous runs* in the sidebar.")
            between(lh)
            _reveal(False)
            return
        names = [d["name"] for d in run["documents"]]
        doc = HSum.shown_document(names)
        gl = list(model["gdn_layers"])
        HSum.key_numbers(run, HSum.head_row(table, layer, head), "on the full head page",
                         f"The spectrum shows one document, “{doc}”.")
        between(lh)
        a, b = st.columns(2)
        with a:
            spec, csv = RF.head_figure(str(C.store().dir), run["run_id"], tuple(d["key"] for d in run["documents"]),
                                       tuple(names), gl.index(layer), head, doc, int(run["segment_len"]), "spectrum")
            C.chart(spec, csv, f"L{layer}H{head}_spectrum", key="head_panel_spectrum", downloads=False)
        b.caption("**The full head page** adds this head's effective rank along each document, the energy kept by a "
                  "rank-r truncation, its decay α and key cone, the spread of every statistic over the documents, what "
                  "its state holds and its exact attention map, each figure with PNG / SVG / CSV downloads.")
        _reveal(True)
