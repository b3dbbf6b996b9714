"""gdnviz: the Streamlit app. Start it with ``make app`` or ``python -m streamlit run app.py``.

Its environment variables are the table of ``gdnviz.settings`` (README, "Settings"); a value that does not parse
stops the app with a message naming it. The app itself never touches the GPU: the worker (python -m gdnviz.worker), started once by this server, does.
"""
import streamlit as st

from gdnviz import settings
from gdnviz.errors import BadSetting
from gdnviz.ui import common
from gdnviz.ui.blas import one_blas_thread

one_blas_thread()  # the app's linear algebra is small; many BLAS threads only spin on a busy machine
st.set_page_config(page_title="gdnviz", page_icon=":material/grid_view:", layout="wide")
try:
    for s in settings.table():
        settings.get(s.name)
except BadSetting as e:
    st.error(f"{e} Fix or unset it in the environment, then restart the app.")
    st.stop()
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
    st.Page(common.PAGES["loss"], title="Loss vs rank", icon=":material/trending_up:", url_path="loss"),
    st.Page(common.PAGES["scans"], title="Head scans & budgets", icon=":material/troubleshoot:", url_path="scans"),
    st.Page(common.PAGES["patching"], title="State patching", icon=":material/swap_horiz:", url_path="patching"),
    st.Page(common.PAGES["compare"], title="Compare two runs", icon=":material/compare:", url_path="compare"),
    st.Page(common.PAGES["budget"], title="Cache budget", icon=":material/memory:", url_path="budget"),
]
pg = st.navigation(pages)
common.handle_head_click(pg.url_path)  # a click on a chart of heads, before anything is drawn
with st.sidebar:
    st.markdown("### gdnviz\nInside the Gated DeltaNet heads of hybrid LMs")
common.adopt_finished_capture()
common.sidebar()
common.entrypoint_running(True)
try:
    pg.run()
finally:
    common.entrypoint_running(False)
