"""Loss vs rank: mean next-token loss over the current run's documents with the chosen heads cut to each r, on all
tokens and on both copy/induction subsets, paired over documents (seed 000 §3), in the worker."""
from __future__ import annotations

from pathlib import Path

import streamlit as st

from gdnviz.errors import GDNVizError
from gdnviz.ui import common as C

C.ensure_entrypoint()
from gdnviz.ui import loss as LS  # noqa: E402
from gdnviz.ui import head_picker as HP  # noqa: E402
from gdnviz.ui import sweeps as S  # noqa: E402

st.title("Loss vs rank")
st.caption("For every rank r: run each document of the current run with the chosen heads cut to rank r at every "
           "segment boundary, and take the mean next-token loss (nats / token); the untouched model always runs "
           "too. Documents are weighted equally, and differences to the untouched model are paired over them "
           "(seed 000 §3). Every document's losses are stored as soon as they are computed: a cancelled run "
           "resumes where it stopped, and the untouched losses are computed once per document and reused.")

run = C.current_run()
if run is None:
    C.empty_state("No capture yet.", "Loss vs rank runs on the documents of a capture: pick a model and documents "
                                     "and run a capture on the **Model & documents** page.")
    st.stop()
info, model_name, device, dtype, L, table, src, trust = C.run_model(run)
gl, H = list(info["gdn_layers"]), int(info["num_heads"])
rmax = min(int(info["d_k"]), int(info["d_v"]))
docs = run["documents"]
st.markdown(f"Model: {src} · {len(gl)} GDN layers × {H} heads of {info['d_k']}×{info['d_v']} · segment length "
            f"**L = {L}** · **{len(docs)} document(s)**, {sum(int(d['n_tokens']) for d in docs):,} tokens · "
            f"r = {rmax} keeps a state untouched")
errors: list[str] = LS.short_documents(docs, L)

# =============================================================================================================
# 1. ranks and the copy subsets
# =============================================================================================================
st.subheader("1 · Ranks and the copy subsets")
st.session_state.setdefault("ls_ranks", LS.default_ranks_text(rmax))
st.session_state.setdefault("ls_dist", 512)
c = st.columns([2, 1])
c[0].text_input("Ranks r (comma-separated)", key="ls_ranks",
                help=f"directions kept per chosen head, each in 1..{rmax}; r = {rmax} (untouched) always runs as "
                     "the baseline of the paired differences")
c[1].number_input("Copy distance d (tokens)", min_value=0, max_value=1 << 20, step=64, key="ls_dist",
                  help="the copy/induction subsets: predictions whose preceding bigram occurred earlier, with any "
                       "earlier occurrence (copy (any)) or the most recent one (copy (recent)) more than d tokens "
                       "back. Changing d needs no new model run.")
ranks: list = []
try:
    ranks = S.parse_ranks(st.session_state["ls_ranks"], rmax)
except (GDNVizError, ValueError) as e:
    errors.append(f"Ranks: {e}")
dist = int(st.session_state["ls_dist"])
if docs and max(int(d["n_tokens"]) for d in docs) <= dist + 2:
    st.warning(f"Every document has at most {dist + 2:,} tokens: no bigram can have been seen more than d = {dist:,} "
               "tokens back, so both copy subsets are empty. Lower d or capture longer documents.",
               icon=":material/warning:")

# =============================================================================================================
# 2. heads
# =============================================================================================================
st.subheader("2 · Heads cut to each r")
heads = HP.head_set("ls", info, table, L, errors)
rank_maps = HP.rank_maps("ls", info, errors, "documents")

# =============================================================================================================
# 3. run
# =============================================================================================================
st.subheader("3 · Run")
if ranks:
    n_set = len(ranks) + len(rank_maps)
    tok = LS.pass_tokens(docs, n_set - 1)
    st.caption(f"{len(docs)} document(s) × ({len(ranks)} ranks ({', '.join(map(str, ranks))} = untouched)"
               + (f" + {len(rank_maps)} rank map(s)" if rank_maps else "")
               + f") = **{LS.n_runs(len(docs), n_set):,} forward passes** over a document, {tok['untouched']:,} "
                 f"tokens untouched and {tok['truncated']:,} truncated (fewer when some are already stored): "
               + C.job_eta(info, "loss", tok, L))
form_spec = None
if not errors:
    from gdnviz.jobs import LossJob, spec_to_dict

    form_spec = spec_to_dict(LossJob(
        model=model_name, device=device, dtype=dtype, trust_remote_code=trust,
        documents=tuple(tuple(d) for d in run["spec"]["documents"]), ranks=tuple(r for r in ranks if r != rmax),
        heads="all" if st.session_state["ls_heads"] == "all" else tuple(heads), rank_maps=rank_maps,
        segment_len=L, min_distance=dist, fingerprint=str(info.get("fingerprint") or "")))
for e in errors:
    C.show_error(e)
running = C.job_active(st.session_state.get("loss_job"))
go = st.button("Run loss vs rank", type="primary", key="ls_run", icon=":material/play_arrow:",
               disabled=bool(errors) or running,
               help="one loss run at a time: cancel the running one first" if running else None)
if go and form_spec is not None:
    st.session_state["loss_job"] = C.submit("loss", form_spec, label="loss vs rank")
    st.session_state.setdefault("ls_submitted", []).append(st.session_state["loss_job"])
    st.rerun()  # redraw from the top: the sidebar's worker status and the Run button see the new job

prev = LS.previous_loss_sweeps(C.store())
if prev:
    labels = {p["id"]: p["label"] for p in prev}
    ids = [p["id"] for p in prev]

    def _reopen():
        st.session_state["loss_job"] = st.session_state["ls_prev"]

    cur = st.session_state.get("loss_job")
    if cur in labels:
        st.session_state["ls_prev"] = cur
    st.selectbox("Previous results (stored; reopening one is instant)", ids, key="ls_prev",
                 index=None if cur not in labels else ids.index(cur), format_func=labels.get, on_change=_reopen,
                 placeholder=f"{len(prev)} finished loss run(s) in the store: pick one to show it")

rec = C.job_panel("loss_job", "Loss vs rank", resume="documents")
if rec is not None and rec["status"] == "done":
    from gdnviz import figures as F
    from gdnviz.probes import loss_sweep

    res = rec["result"]
    tab = loss_sweep.table_frame(res["table"])
    rows = loss_sweep.rows_frame(res["rows"])
    sp = res["settings"]
    d = int(sp["min_distance"])
    sizes = LS.subset_sizes(tab)
    C.stale_result_note(C.settings_differ(rec["spec"], form_spec, {
        "model": "model", "documents": "documents", "ranks": "ranks", "heads": "heads", "rank_maps": "rank maps",
        "segment_len": "segment length", "min_distance": "copy distance d"}), "loss result")
    when = C.computed_when(rec, st.session_state.get("ls_submitted", []))
    st.markdown(f"**{res['n_results']:,} (document, setting) runs** ({res['computed']:,} computed {when}, "
                f"{res['reused']:,} read from the store) · {len(res['documents'])} documents · "
                f"{res['n_heads']} heads cut · L = {sp['segment_len']} · {res['dtype']} on {res['device']} · "
                f"{res['kernel_path']} kernels")
    st.markdown("**Mean next-token loss per r** (nats / token, documents weighted equally), the change vs the "
                "untouched model ± its paired standard error over documents, and the relative change")
    st.dataframe(LS.seed000_table(tab, int(res["rmax"])), hide_index=True, width="stretch")
    if LS.few_documents_note(len(res["documents"])):
        st.caption(LS.few_documents_note(len(res["documents"])))
    st.caption(f"**all**: every prediction · copy subsets, d = {d:,} tokens: the preceding bigram occurred "
               "earlier, and **any** earlier occurrence (copy (any)) / the **most recent** one (copy (recent)) is "
               "more than d tokens back · "
               + " · ".join(f"{LS.SUBSET_HEADS[s]}: {p:,} predictions in {n} document(s)" for s, (n, p) in
                            sizes.items()))
    if sizes["copy_recent"][0] == 0 or sizes["copy_any"][0] == 0:
        st.info("A copy subset is empty on these documents (no bigram recurs that far back): lower d, or use "
                "longer documents.", icon=":material/info:")
    name = Path(str(res["model_name"])).name
    C.chart(loss_sweep.loss_figure(tab, title=f"{name}: next-token loss vs rank", min_distance=d), tab,
            "loss_vs_rank", key="ls_chart", fixed_size=True)
    st.download_button("Per-document losses (CSV)", data=F.to_csv(rows), file_name="loss_documents.csv",
                       mime="text/csv", on_click="ignore", key="ls_rows_csv", icon=":material/table:")
    with st.expander("The table in long form (the CSV download)"):
        st.dataframe(LS.long_table(tab), hide_index=True, width="stretch")
