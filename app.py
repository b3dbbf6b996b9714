"""gdnviz: the Streamlit app. Start it with ``make app`` or ``python -m streamlit run app.py``.

Environment variables:
  GDNVIZ_DEFAULT_MODEL  model selected at start: "demo" (the bundled model, the default), a local checkpoint folder,
                        or an org/name in the local Hugging Face cache
  GDNVIZ_CACHE_DIR      where jobs, results and previous runs are stored (default: cache/ in the repository)
  GDNVIZ_MAX_TOKENS     default per-document token limit (32768)
  GDNVIZ_NO_WORKER=1    do not start the worker process (tests run jobs in-process)
The app itself never touches the GPU: the worker (python -m gdnviz.worker), started once by this server, does.
"""
import streamlit as st

from gdnviz.ui import common

st.set_page_config(page_title="gdnviz", page_icon=":material/grid_view:", layout="wide")
common.persist_widgets()
common.init_model_state()

pages = [
    st.Page(common.PAGES["documents"], title="Model & documents", icon=":material/description:",
            url_path="documents", default=True),
    st.Page(common.PAGES["heatmap"], title="Heatmap", icon=":material/grid_on:", url_path="heatmap"),
    st.Page(common.PAGES["head"], title="Head", icon=":material/center_focus_strong:", url_path="head"),
    st.Page(common.PAGES["overview"], title="Overview figures", icon=":material/scatter_plot:", url_path="overview"),
    st.Page(common.PAGES["truncate"], title="Truncate & compare", icon=":material/content_cut:",
            url_path="truncate"),
    st.Page(common.PAGES["sweeps"], title="Retrieval sweeps", icon=":material/query_stats:", url_path="sweeps"),
    st.Page(common.PAGES["budget"], title="Cache budget", icon=":material/memory:", url_path="budget"),
]
pg = st.navigation(pages)
with st.sidebar:
    st.markdown("### gdnviz\nInside the Gated DeltaNet heads of hybrid LMs")
common.sidebar()
common.entrypoint_running(True)
try:
    pg.run()
finally:
    common.entrypoint_running(False)
