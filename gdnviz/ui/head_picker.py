"""The head-set and rank-map sections that the Retrieval sweeps and Loss vs rank pages share (Streamlit widgets).

Widget keys are ``<prefix>_heads``, ``<prefix>_layers``, ``<prefix>_rank_maps`` and ``<prefix>_add_tr_map``
(``sw`` on the sweeps page, ``ls`` on the loss page), so each page keeps its own choices.
"""
from __future__ import annotations

import streamlit as st

from gdnviz.errors import GDNVizError
from gdnviz.ui import common as C
from gdnviz.ui import sweeps as S


def head_set(prefix: str, info: dict, table, L: int, errors: list) -> list:
    """The "Heads" selector (all / layers / picked on the Heatmap / forgetting within a segment of L tokens) and
    its caption; returns the chosen (layer, head) pairs, appending a message to ``errors`` when there are none."""
    gl, H = list(info["gdn_layers"]), int(info["num_heads"])
    st.session_state.setdefault(f"{prefix}_heads", "all")
    c = st.columns([2, 4])
    mode = c[0].selectbox("Heads", list(S.HEAD_MODES), key=f"{prefix}_heads", format_func=S.HEAD_MODES.get)
    layers, picked = [], C.picked_heads()
    with c[1]:
        if mode == "layers":
            layers = st.multiselect("GDN layers", gl, key=f"{prefix}_layers", help="every head of these layers")
        elif mode == "picked":
            st.markdown("Picked: " + (", ".join(C.head_label(*p) for p in picked) or "none yet"))
            if not picked:
                st.caption("On the **Heatmap**, set *Clicking a cell* to “adds / removes it in the truncation set” "
                           "and click cells.")
        elif mode == "within":
            st.caption(f"heads whose decay horizon (median over the run's documents) is below L = {L} tokens")
    heads: list = []
    try:
        heads = S.head_set(mode, info, table, L, layers=layers, picked=picked)
    except (GDNVizError, ValueError) as e:
        errors.append(str(e))
    else:
        if not heads:
            errors.append("No heads in this set: choose another head set (or pick heads / layers).")
        else:
            st.caption(f"**{len(heads)} of {len(gl) * H} heads** cut to each r; all other heads and the attention "
                       "layers stay untouched.")
    return heads


def rank_maps(prefix: str, info: dict, errors: list, unit: str) -> tuple:
    """The optional per-head rank maps (a text area, one map per line, and a button that adds the Truncate &
    compare page's set); returns them parsed (``S.parse_rank_maps``), appending a message to ``errors`` for a bad
    line. ``unit``: what each map runs on ("samples", "documents")."""
    gl = list(info["gdn_layers"])
    key = f"{prefix}_rank_maps"
    with st.expander("Per-head rank maps (optional): extra settings with a rank for each head"):
        st.session_state.setdefault(key, "")

        def _add_truncate_map():
            line = S.rank_map_line("truncate_page", st.session_state["tr_rank_map"])
            cur = st.session_state.get(key, "").rstrip("\n")
            st.session_state[key] = (cur + "\n" if cur else "") + line

        st.text_area("One map per line: NAME: layer:head:r, layer:head:r, …", key=key, height=110,
                     placeholder=f"e.g. early_r1: {gl[0]}:0:1, {gl[0]}:1:1" + (f", {gl[1]}:0:4" if len(gl) > 1 else ""),
                     help=f"Each map is one more setting, run on the same {unit}: the listed heads are cut to their "
                          "own r at every boundary, every other head stays untouched; paired with the untouched "
                          "model like the uniform ranks.")
        st.button("Add the heads and ranks set on Truncate & compare", key=f"{prefix}_add_tr_map",
                  on_click=_add_truncate_map, disabled=not st.session_state.get("tr_rank_map"), icon=":material/add:",
                  help=None if st.session_state.get("tr_rank_map") else "set up heads and ranks on the Truncate & "
                                                                        "compare page first")
    maps: tuple = ()
    try:
        maps = S.parse_rank_maps(st.session_state.get(key, ""), info)
    except (GDNVizError, ValueError) as e:
        errors.append(str(e))
    if maps:
        st.caption(f"{len(maps)} rank map(s): " + "; ".join(f"**{name}** ({len(m)} heads)" for name, m in maps))
    return maps
