"""A head at a glance, shared by the Head page and the Heatmap's head panel: its heading, its six key numbers
(medians over the run's documents) and the document that its one-document figures show."""
from __future__ import annotations

import numpy as np
import pandas as pd
import streamlit as st


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
