"""Streamlit-side helpers of the gdnviz app (no torch at import time)."""
