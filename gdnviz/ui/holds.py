"""The Head page's "What this state holds" section: which tokens the open head's state at a chosen boundary of a
run's document is made of, how much of it comes from beyond one segment, and the rewrite rate between boundaries
(docs/attribution.md). Computed by a HoldsJob in the worker and read back from the memo under its key
(``gdnviz.jobs.holds_key``: the run's capture key of the document, the head, the position, the number of
directions), so a result is shown only for exactly the request on the page.
"""
from __future__ import annotations

import streamlit as st

from gdnviz.ui import common as C
from gdnviz.ui import run_figures as RF

TITLE = "What this state holds"
TOP_TOKENS = 12  # rows of the "Tokens contributing most" table, all shown (no scrolling)


def request(run: dict, doc: str, layer: int, head: int, position: int, top: int) -> tuple[dict, str]:
    """(the HoldsJob as the queue's dict, its memo key) for document ``doc`` of ``run``; ``position`` 0 means the
    document end."""
    from gdnviz.jobs import HoldsJob, holds_key, spec_to_dict

    names = [d["name"] for d in run["documents"]]
    d = run["documents"][names.index(doc)]
    text = dict((n, t) for n, t in run["spec"]["documents"])[doc]
    pos, L = int(position) or int(d["n_tokens"]), int(run["segment_len"])
    spec = HoldsJob(model=run["model_name"], document=(doc, text), doc_key=d["key"], layer=int(layer), head=int(head),
                    position=pos, top=int(top), segment_len=L, device=run["spec"].get("device", "auto"),
                    dtype=run["spec"].get("dtype", "auto"),
                    trust_remote_code=run["spec"].get("trust_remote_code") is True)
    return spec_to_dict(spec), holds_key(d["key"], layer, head, pos, top, L)


@st.cache_data(show_spinner=False, max_entries=16)
def _result(cache_dir: str, key: str) -> dict:
    res = C._store(cache_dir).memo_get_json(key)
    if res is None:
        raise KeyError(key)
    return res


def section(run: dict, layer: int, head: int, default_doc: str) -> None:
    """Draw the section for ``(layer, head)`` of ``run``: the request widgets, the Compute state or the result."""
    L = int(run["segment_len"])
    names = [d["name"] for d in run["documents"]]
    st.markdown(f"#### {TITLE}")
    st.caption("The state after p tokens is exactly a sum of one rank-1 term per earlier token, c_t = (P k_t)(β_t v_t)ᵀ "
               "(its key carried through every later transition, so the delta rule's removals are included), "
               "from the model's own q, k, v, g, β in float64. Shares along the state's singular directions sum "
               "to σ_i. Definitions: docs/attribution.md.")
    if st.session_state.get("holds_doc") not in names:
        st.session_state["holds_doc"] = default_doc
    st.session_state.setdefault("holds_pos", 0)
    st.session_state.setdefault("holds_top", 4)
    c = st.columns([2, 1, 1])
    doc = c[0].selectbox("Document", names, key="holds_doc")
    T = int(run["documents"][names.index(doc)]["n_tokens"])
    pos = c[1].number_input("Boundary p (tokens consumed)", min_value=0, step=L, key="holds_pos",
                            help=f"the state after p tokens; 0: the document end ({T:,} tokens)")
    top = c[2].number_input("Top singular directions", min_value=1, max_value=8, key="holds_top")
    spec, key = request(run, doc, layer, head, int(pos), int(top))
    p = spec["position"]
    what = f"layer {layer} head {head}, “{doc}”, the state after {p:,} of {T:,} tokens"
    s = C.store()
    res = None
    if s.memo_has(key):
        try:
            res = _result(str(s.dir), key)
        except KeyError:  # the entry failed its checksum (the store deleted it): compute it again
            res = None
    if res is None:
        jobs = st.session_state.setdefault("holds_jobs", {})
        st.session_state["holds_job_now"] = jobs.get(key)
        rec = C.job_panel("holds_job_now", TITLE)
        busy = rec is not None and rec["status"] in ("queued", "running")
        if not busy:
            st.info(f"**Not computed yet** for {what}. **Compute** runs the model over the document in the worker "
                    "for this head's inputs and decomposes the state (float64 on the CPU; seconds for a few "
                    "thousand tokens).", icon=":material/info:")
        if st.button("Compute", key="holds_compute", type="primary", icon=":material/play_arrow:", disabled=busy):
            jobs[key] = C.submit("holds", spec, label=f"{TITLE}: L{layer}·H{head} at {p:,}")
            st.rerun()
        return
    draw(res, key)


def draw(res: dict, key: str) -> None:
    """The result: the numbers, the contributions along the document and as text, the directions, the rewrite."""
    from gdnviz.ui import holds_charts as HC

    cache, tag = str(C.store().dir), f"L{res['layer']}H{res['head']}_p{res['position']}"
    b, L = res["beyond"], int(res["segment_len"])
    st.caption(f"“{res['document']}” · state after {res['position']:,} of {res['T']:,} tokens · {res['dtype']} run "
               f"on {res['device']}, decomposition float64")
    m = st.columns(4)
    m[0].metric("‖S‖_F", f"{res['state_norm']:.4g}", help="Frobenius norm of the state")
    m[1].metric("σ₁", f"{res['sigma'][0]:.4g}", help="largest singular value of the state")
    if b["cutoff"] > 0:
        m[2].metric(f"From beyond {L} tokens", f"{100 * b['energy_share']:.1f}% of ‖S‖²",
                    help="⟨S_old, S⟩_F / ‖S‖²_F, S_old = the sum of the contributions of tokens before p − L "
                         "(= the state L tokens back, carried through the last L transitions)")
        m[3].metric("‖S_old‖ / ‖S‖", f"{b['norm_ratio']:.3f}", help="how large the part from before p − L is")
        st.caption("Share of each σ_i from tokens older than one segment (u_iᵀ S_old w_i / σ_i): " + " · ".join(
            f"σ_{i + 1}: {100 * x:.1f}%" for i, x in enumerate(b["sigma_share"])))
    else:
        m[2].metric(f"From beyond {L} tokens", "none", help=f"p = {res['position']} ≤ L: every token is recent")
    C.chart(*RF.holds_figure(cache, key, "along"), f"{tag}_contributions", key="ch_holds_along")
    st.markdown(f"**The text before p as the state holds it** (background: ‖c_t‖ on a log scale, darkest = the "
                f"largest, blank = 1/{10 ** HC.DECADES:,} of it or less; red bar: one segment before p; hover a token "
                "for its index and norm)")
    st.html(HC.highlighted_html(res))
    st.markdown("**Tokens contributing most** (largest ‖c_t‖_F)")
    st.dataframe(HC.top_tokens(res, TOP_TOKENS), hide_index=True, width="stretch", height="content", column_config={
        "position": "token index", "tokens_back": "tokens before p",
        "norm": st.column_config.NumberColumn("‖c_t‖_F", format="%.3g")})
    C.chart(*RF.holds_figure(cache, key, "directions"), f"{tag}_directions", key="ch_holds_dirs", fixed_size=True)
    if res["rewrite"]["boundaries"]:
        C.chart(*RF.holds_figure(cache, key, "rewrite"), f"{tag}_rewrite", key="ch_holds_rewrite")
    else:
        st.caption(f"Rewrite rate: the document has fewer than 2L = {2 * L} tokens, so no two boundaries to compare.")
