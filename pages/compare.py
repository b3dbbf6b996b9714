"""Compare two runs: heatmaps side by side with the B − A difference, the overview scatter overlaid, sweep tables."""
from __future__ import annotations

import streamlit as st

from gdnviz.ui import common as C
from gdnviz.ui import compare as K

C.ensure_entrypoint()

st.title("Compare two runs")
st.caption("Two models on the same documents, or one model on two document sets. Runs come from the store's list; "
           "differences are B − A.")
picked = K.pick_runs()
if picked is None:
    st.stop()
run_a, run_b = picked
ta, tb = C.run_table(run_a), C.run_table(run_b)
if ta is None or tb is None:
    st.stop()
c1, c2 = st.columns(2)
with c1:
    K.run_summary("A", run_a)
with c2:
    K.run_summary("B", run_b)
top = st.container()  # the zip's button, drawn last: it holds what every section below picked
st.markdown("#### Heatmaps")
metric = K.metric()
figs = K.figures(run_a, run_b, ta, tb, metric)
K.heatmaps(run_a, run_b, figs, metric)
st.markdown("#### Effective rank vs decay horizon")
K.scatter(figs)
st.markdown("#### Retrieval sweeps")
sweep_pair = K.sweeps()
with top:
    K.download_zip(run_a, run_b, ta, tb, metric, sweep_pair)
