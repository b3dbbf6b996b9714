"""Figure export settings (sidebar): the size and resolution every PNG / SVG download, the run zip and the
comparison zip use (read with ``export_kwargs`` when their button is drawn: a download is built outside the script
run, where the session's state cannot be read).

Session keys: ``ex_width`` / ``ex_height`` (CSS px, 0 = the figure's own size), ``ex_scale`` (PNG device pixels
per CSS px). They are sidebar widgets, drawn on every page, so they keep their values across pages.
"""
from __future__ import annotations

import streamlit as st

SCALES = (1.0, 2.0, 3.0, 4.0, 6.0, 8.0)


def export_options() -> None:
    """The sidebar expander with the export size and scale."""
    with st.expander("Figure export", icon=":material/image:"):
        c1, c2 = st.columns(2)
        c1.number_input("width (px)", min_value=0, max_value=5000, value=0, step=50, key="ex_width",
                        help="CSS pixels; 0 = the figure's own size. Grids and multi-panel figures keep theirs.")
        c2.number_input("height (px)", min_value=0, max_value=5000, value=0, step=50, key="ex_height",
                        help="CSS pixels; 0 = the figure's own size")
        st.select_slider("PNG scale", SCALES, value=2.0, key="ex_scale", format_func=lambda s: f"{s:g}×",
                         help="device pixels per CSS pixel: 2× ≈ 192 dpi, 4× ≈ 384 dpi (at 96 dpi per CSS px). "
                              "SVG is vector and ignores it.")
        for what in ("width", "height"):
            v = int(st.session_state.get(f"ex_{what}") or 0)
            if 0 < v < 50:
                st.caption(f":orange[A {what} of {v} px is below 50 px: the figure's own {what} is used.]")
        st.caption("Downloads leave out on-screen hints and selection outlines.")


def export_kwargs() -> dict:
    """``width`` / ``height`` (None for 0) for ``figures.to_png`` / ``to_svg``, and ``scale`` for PNG."""
    w = int(st.session_state.get("ex_width") or 0)
    h = int(st.session_state.get("ex_height") or 0)
    return dict(width=w if w >= 50 else None, height=h if h >= 50 else None,
                scale=float(st.session_state.get("ex_scale") or 2.0))
