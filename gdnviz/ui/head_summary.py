"""A head at a glance, shared by the Head page and the head panel of the pages with a chart of heads: the head a
link names, its heading, its six key numbers (medians over the run's documents) and the document that its
one-document figures show."""
from __future__ import annotations

import numpy as np
import pandas as pd
import streamlit as st

from gdnviz.ui import common as C


def _int(v) -> int | None:
    try:
        return int(str(v))
    except (TypeError, ValueError):
        return None


def is_head(model: dict, layer, head) -> bool:
    """Whether (``layer``, ``head``) names a GDN head of ``model`` (its "gdn_layers" and "num_heads")."""
    h = _int(head)
    return layer in model["gdn_layers"] and h is not None and 0 <= h < int(model["num_heads"])


def head_from_url(model: dict, instead: str) -> tuple[int, int] | None:
    """The GDN head of ``model`` that the page URL's query params ``layer`` and ``head`` name, as (layer, head);
    None when the URL names neither. When they name no GDN head of ``model``, shows an error saying what is wrong
    with the link and then ``instead`` (a sentence: what the page shows in its place), and returns None."""
    ql, qh = st.query_params.get("layer"), st.query_params.get("head")
    if ql is None and qh is None:
        return None
    layer, head = _int(ql), _int(qh)
    if layer is not None and head is not None and is_head(model, layer, head):
        return layer, head
    gl, H = list(model["gdn_layers"]), int(model["num_heads"])
    link = f"The link asks for layer={ql!r}, head={qh!r}"
    if layer is None or head is None:
        C.show_error(f"{link}: both must be integers.", f"GDN layers of this model: {gl}; heads 0–{H - 1}. {instead}")
    elif layer not in gl:
        attn = list(model.get("attn_layers", []))
        C.show_error(f"{link}. Layer {layer} is not a Gated DeltaNet layer of this model.",
                     f"GDN layers: {gl}" + (f" (full-attention layers {attn} have no state)" if attn else "")
                     + f". {instead}")
    else:
        C.show_error(f"{link}. Head {head} is out of range: GDN layers of this model have {H} heads (0–{H - 1}).",
                     instead)
    return None


def shown_document(names: list[str]) -> str:
    """The document of the Head page's one-document figures (spectrum, key cone): the session's choice
    ("head_doc") if it is one of the run's ``names``, else the first."""
    doc = st.session_state.get("head_doc")
    return doc if doc in names else names[0]


def head_row(table: pd.DataFrame, layer: int, head: int) -> pd.Series:
    """The row of the run's head table (``summary.document_set_table``) of (layer, head)."""
    return table[(table["layer"] == layer) & (table["head"] == head)].iloc[0]


def heading(run: dict, layer: int, head: int) -> None:
    """``### Layer l · head h`` and a grey line: the state's shape, the documents, the segment length, the run."""
    model = run["model"]
    n = len(run["documents"])
    st.markdown(f"### Layer {layer} · head {head}  \n"
                f"<span style='color:gray'>state {model['d_k']} × {model['d_v']} · {n} document(s) · "
                f"segment length {int(run['segment_len'])} · run `{run['run_id']}`</span>", unsafe_allow_html=True)


def key_numbers(run: dict, row: pd.Series, min_max: str, one_document: str) -> None:
    """A caption saying that the numbers are medians over the run's documents (their min–max: ``min_max``, where
    to find them) and which figures show one document (``one_document``, a sentence), the six key numbers of the
    head's ``row`` in one row of metrics, and a note when the head forgets within one segment."""
    nd = len(run["documents"])
    L = int(run["segment_len"])
    st.caption(f"The numbers below are medians over the {nd} document{'s' if nd != 1 else ''} of this run (their "
               f"min–max {min_max}). {one_document}")
    m = st.columns(6)
    m[0].metric("Effective rank", f"{row['erank']:.1f}", help="exp of the entropy of σ/Σσ: directions carrying the norm")
    m[1].metric("Numerical rank", f"{row['numerical_rank']:.0f}", help="σ above σ_max·128·ε_f32")
    m[2].metric("Horizon", f"{row['horizon']:,.0f} tok" if np.isfinite(row["horizon"]) else "∞", help="1/(1 − ᾱ)")
    m[3].metric("Mean key norm", f"{row['mean_key_norm']:.3f}", help="‖mean of the unit keys‖: 1 = all keys parallel, "
                "≈ 0 = isotropic")
    m[4].metric("Key-cov erank", f"{row['key_cov_erank']:.1f}", help="effective rank of the covariance of the keys "
                "written inside the horizon")
    m[5].metric("r for 99% energy", f"{row['energy_rank99']:g}", help="smallest r with Σ_{i≤r} σ_i² ≥ 0.99 Σ σ_i² "
                "(median over documents)")
    if row["horizon"] < L:
        st.caption(f"This head forgets within one segment (horizon {row['horizon']:,.0f} < L = {L} tokens): "
                   "truncating it at segment boundaries should change little.")
