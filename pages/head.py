"""Head: one GDN head in detail. Deep link: /head?layer=<model layer index>&head=<value head>."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from gdnviz.ui import attnmap as AM
from gdnviz.ui import common as C
from gdnviz.ui import head_summary as HSum
from gdnviz.ui import holds as HS
from gdnviz.ui import run_figures as RF

C.ensure_entrypoint()

st.title("Head")
got = C.require_run()
if got is None:
    st.stop()
run, table = got
model = run["model"]
gl = list(model["gdn_layers"])
H = int(model["num_heads"])


# the head: query parameters (a pasted link) win, then this session's choice, then the head with the largest erank
layer, head = HSum.head_from_url(model, "Showing the head with the largest effective rank instead.") or (
    st.session_state.get("layer"), st.session_state.get("head"))
if not HSum.is_head(model, layer, head):
    # nothing chosen yet: open the head with the largest effective rank of this run (the one using the most of
    # its state), not an arbitrary first head
    top = table.sort_values(["erank", "layer", "head"], ascending=[False, True, True], na_position="last").iloc[0]
    layer, head = int(top["layer"]), int(top["head"])
    st.caption(f"Showing layer {layer} head {head}, the head with the largest effective rank in this run "
               "(median over its documents). Pick another below, or click a cell on the Heatmap.")
layer, head = int(layer), int(head)
st.session_state["layer"], st.session_state["head"] = layer, head
st.session_state["head_sel_layer"], st.session_state["head_sel_head"] = layer, head


def _on_pick():
    st.session_state["layer"] = int(st.session_state["head_sel_layer"])
    st.session_state["head"] = int(st.session_state["head_sel_head"])
    st.query_params.update(layer=str(st.session_state["layer"]), head=str(st.session_state["head"]))


st.query_params.update(layer=str(layer), head=str(head))
c1, c2, c3, c4 = st.columns([1, 1, 2, 2])
c1.selectbox("Layer", gl, key="head_sel_layer", on_change=_on_pick, help="the model's own layer index")
c2.selectbox("Head", list(range(H)), key="head_sel_head", on_change=_on_pick)
names = [d["name"] for d in run["documents"]]
st.session_state["head_doc"] = HSum.shown_document(names)
c3.selectbox("Document for the spectrum and the key cone", names, key="head_doc")
with c4:
    st.write("")
    in_set = (layer, head) in C.picked_heads()
    st.button("Remove from the truncation set" if in_set else "Add to the truncation set", key="head_pick",
              on_click=C.toggle_pick, args=(layer, head), icon=":material/content_cut:")

caps = C.run_captures(run)
if caps is None:
    st.stop()
li = gl.index(layer)
doc = st.session_state["head_doc"]
row = HSum.head_row(table, layer, head)
L = int(run["segment_len"])

HSum.heading(run, layer, head)
HSum.key_numbers(run, row, "under *Over the documents*", f"The spectrum and the key cone show one document, “{doc}”; "
                 "the other plots draw every document.")

tag = f"L{layer}H{head}"
args = (str(C.store().dir), run["run_id"], tuple(d["key"] for d in run["documents"]), tuple(names), li, head, doc, L)


def spectrum_tab():
    a, b = st.columns(2)
    with a:
        C.chart(*RF.head_figure(*args, "spectrum"), f"{tag}_spectrum", key="ch_spectrum")
    with b:
        C.chart(*RF.head_figure(*args, "erank_along"), f"{tag}_erank_along", key="ch_along")


def energy_tab():
    a, b = st.columns(2)
    with a:
        spec, csv, ek = RF.head_figure(*args, "energy")
        C.chart(spec, csv, f"{tag}_energy_kept", key="ch_energy")
    with b:
        st.markdown("**Energy kept at seed 000's ranks, per document**")
        st.dataframe(ek, hide_index=True, width="stretch",
                     column_config={c: st.column_config.NumberColumn(format="percent") for c in ek.columns
                                    if c.startswith("r = ")})


def decay_tab():
    a, b = st.columns(2)
    with a:
        spec, csv, stats = RF.head_figure(*args, "alpha")
        C.chart(spec, csv, f"{tag}_alpha", key="ch_alpha")
        st.dataframe(stats.rename(columns={"mean_alpha": "mean α", "one_minus_mean_alpha": "1 − ᾱ",
                                           "horizon": "horizon (tokens)", "mean_beta": "mean β",
                                           "n_tokens": "tokens"}),
                     hide_index=True, width="stretch",
                     column_config={"mean α": st.column_config.NumberColumn(format="%.6f"),
                                    "1 − ᾱ": st.column_config.NumberColumn(format="%.2e"),
                                    "horizon (tokens)": st.column_config.NumberColumn(format="%.1f"),
                                    "mean β": st.column_config.NumberColumn(format="%.3f")})
    with b:
        spec, csv, kc = RF.head_figure(*args, "keycone")
        C.chart(spec, csv, f"{tag}_keycone", key="ch_cone")
        st.caption(f"{doc}: mean key norm {kc['mean_key_norm']:.3f} · key-covariance erank "
                   f"{kc['key_cov_erank']:.1f} · decayed-P erank {kc['decayed_P_erank_sqrt']:.1f} "
                   f"(√eig) / {kc['decayed_P_erank_eig']:.1f} (eig)")


STATS = [("erank", "effective rank", "directions carrying the norm, exp(−Σ p log p), p = σ/Σσ"),
         ("numerical_rank", "numerical rank", "σ above σ_max·128·ε_f32 (counts decayed residue)"),
         ("stable_rank", "stable rank", "‖S‖²_F / ‖S‖²₂"),
         ("energy_rank99", "r for 99% energy", "smallest r with Σ_{i≤r} σ_i² ≥ 0.99 Σ σ_i²"),
         ("horizon", "decay horizon (tokens)", "1/(1 − ᾱ), ᾱ the mean per-token decay"),
         ("mean_key_norm", "mean key norm", "norm of the mean unit key: 1 = all keys parallel"),
         ("key_cov_erank", "key-covariance erank", "covariance of the keys inside the horizon (eig scale)"),
         ("decayed_P_erank", "decayed-P erank (√eig)", "P = Σ_t w_t k_t k_tᵀ, weights = decay² since t"),
         ("decayed_P_erank_eig", "decayed-P erank (eig)", "the same P on the eigenvalue scale")]


def documents_tab():
    stat_df = pd.DataFrame([dict(statistic=lab, median=float(row[k]), min=float(row[f"{k}_min"]),
                                 max=float(row[f"{k}_max"]), meaning=txt) for k, lab, txt in STATS])
    a, b = st.columns([1, 1])
    with a:
        st.markdown("**Statistics of this head over the documents**")
        st.dataframe(stat_df, hide_index=True, width="stretch",
                     column_config={c: st.column_config.NumberColumn(format="%.3g") for c in ("median", "min", "max")})
    with b:
        C.chart(*RF.head_figure(*args, "per_document", min(int(model["d_k"]), int(model["d_v"]))),
                f"{tag}_per_document", key="ch_perdoc", fixed_size=True)


# one group of figures at a time (the tab kept across heads and pages): only the open tab is built and drawn, so
# a click on a head shows its numbers and first figures without waiting for the others; a fragment, so that
# opening another tab reruns only the tabs (docs/ui-speed.md)
TABS = {"Spectrum & effective rank": spectrum_tab, "Energy kept": energy_tab, "Decay α & key cone": decay_tab,
        "Over the documents": documents_tab}


@st.fragment
def figures():
    if st.session_state.get("head_tab") not in TABS:
        st.session_state["head_tab"] = next(iter(TABS))
    for tab, draw in zip(st.tabs(list(TABS), key="head_tab", on_change="rerun"), TABS.values()):
        if tab.open:
            with tab:
                draw()


figures()
HS.section(run, layer, head, doc)
AM.section(run, layer, head, doc)
C.page_link("heatmap", "Back to the heatmap", icon=":material/grid_on:")
