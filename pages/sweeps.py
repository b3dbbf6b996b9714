"""Sweeps: RULER retrieval score vs the rank r kept in chosen heads, tasks x lengths x r x samples, in the worker."""
from __future__ import annotations

from pathlib import Path

import streamlit as st

from gdnviz.errors import GDNVizError
from gdnviz.ui import common as C

C.ensure_entrypoint()
from gdnviz.probes import ruler  # noqa: E402
from gdnviz.ui import head_picker as HP  # noqa: E402
from gdnviz.ui import sweeps as S  # noqa: E402

st.title("Retrieval sweeps")
st.caption("For every task, length and rank r: generate n RULER samples, answer each greedily with the chosen heads "
           "cut to rank r at every segment boundary (the untouched model always runs too), score them with RULER's "
           "string match. Differences to the untouched model are paired over the same samples (seed 000 §3). "
           "Every sample's result is stored as soon as its batch finishes: a cancelled or crashed sweep resumes "
           "where it stopped, and a repeated one is read back instantly.")

run, info, model_name, device, dtype, L_default, table, src, trust = C.page_model(
    "sweeps run on it here (a capture also lets you choose the heads that forget within a segment).")
gl, H = list(info["gdn_layers"]), int(info["num_heads"])
rmax = min(int(info["d_k"]), int(info["d_v"]))
st.markdown(f"Model: {src} · {len(gl)} GDN layers × {H} heads of {info['d_k']}×{info['d_v']} · segment length "
            f"**L = {L_default}** · r = {rmax} keeps a state untouched")
errors: list[str] = []

# =============================================================================================================
# 1. tasks, lengths, ranks, samples
# =============================================================================================================
st.subheader("1 · Tasks, lengths, ranks")
st.session_state.setdefault("sw_tasks", list(S.DEFAULT_TASKS))
st.session_state.setdefault("sw_lengths", ", ".join(str(x) for x in (4 * L_default, 16 * L_default)))
st.session_state.setdefault("sw_ranks", S.default_ranks_text(rmax))
for k, v in (("sw_n", 20), ("sw_batch", None), ("sw_seed0", 0), ("sw_max_new", 0), ("sw_chat", True)):
    st.session_state.setdefault(k, v)
st.multiselect("RULER tasks", list(ruler.TASK_NAMES), key="sw_tasks",
               format_func=lambda t: f"{t}: {ruler.TASKS[t]['description']}")
c = st.columns([2, 2, 1, 1])
c[0].text_input("Target lengths (tokens, comma-separated)", key="sw_lengths", help=S.TARGET_LENGTHS_HELP)
c[1].text_input("Ranks r (comma-separated)", key="sw_ranks",
                help=f"directions kept per chosen head, each in 1..{rmax}; r = {rmax} (untouched) always runs as "
                     "the baseline of the paired differences")
c[2].number_input("Samples n", min_value=1, max_value=10_000, step=1, key="sw_n",
                  help="samples per task and length (seeds first seed … first seed + n − 1)")
c[3].number_input("Batch size", min_value=1, max_value=512, step=1, key="sw_batch", placeholder="auto",
                  help="samples answered per forward pass; empty (auto): chosen from the GPU's free memory and the "
                       "prompt length (8 on CPU); a batch that runs out of memory is answered in halves")
with st.expander("More settings"):
    c = st.columns(3)
    c[0].number_input("First seed", min_value=0, step=1, key="sw_seed0")
    c[1].number_input("New tokens (0 = each task's own)", min_value=0, max_value=4096, step=8, key="sw_max_new")
    c[2].checkbox("Chat template", key="sw_chat", help="wrap each task as one user message when the tokenizer has "
                                                       "a chat template (instruction-tuned models)")

tasks = list(st.session_state["sw_tasks"])
seed0, chat = int(st.session_state["sw_seed0"]), ("auto" if st.session_state["sw_chat"] else False)
if not tasks:
    errors.append("No tasks chosen: pick at least one RULER task.")
lengths, ranks = [], []
token_limit = C.token_limit()
try:
    lengths = S.parse_lengths(st.session_state["sw_lengths"])
except ValueError as e:
    errors.append(str(e))
too_long = S.token_limit_error(lengths, token_limit)
if too_long:  # before any prompt is built: a 99,999,999-token haystack would take minutes and the worker's memory
    errors.append(too_long)
    lengths = [L for L in lengths if L <= token_limit]
try:
    ranks = S.parse_ranks(st.session_state["sw_ranks"], rmax)
except (GDNVizError, ValueError) as e:
    errors.append(f"Ranks: {e}")
tok = C.hf_tokenizer(info)
if tok is None:
    errors.append(f"{info.get('path') or model_name} has no tokenizer files beside its weights: the RULER prompts "
                  "need the model's tokenizer.")
elif tasks and lengths:
    errors += C.seed_checks(tasks, lengths, tok, seed0, int(st.session_state["sw_n"]), chat, info=info)
if lengths and min(lengths) <= L_default:
    st.warning(f"A length of {min(lengths):,} tokens is at most one segment (L = {L_default}): no boundary falls "
               "inside such a prompt, so the truncation cannot act on it.", icon=":material/warning:")

# =============================================================================================================
# 2. heads
# =============================================================================================================
st.subheader("2 · Heads cut to each r")
heads = HP.head_set("sw", info, table, L_default, errors)
rank_maps = HP.rank_maps("sw", info, errors, "samples")

# =============================================================================================================
# 3. run
# =============================================================================================================
st.subheader("3 · Run")
form_spec = None
if not errors:
    from gdnviz.jobs import SweepJob, spec_to_dict, sweep_spec_of
    from gdnviz.probes.sweep import check_prompt_memory

    spec = SweepJob(
        model=model_name, device=device, dtype=dtype, trust_remote_code=trust, tasks=tuple(tasks),
        lengths=tuple(lengths),
        ranks=tuple(r for r in ranks if r != rmax), n=int(st.session_state["sw_n"]), seed0=seed0,
        heads="all" if st.session_state["sw_heads"] == "all" else tuple(heads), rank_maps=rank_maps, segment_len=L_default,
        batch_size=C.batch_value(st.session_state["sw_batch"]), max_new_tokens=int(st.session_state["sw_max_new"]),
        chat_template=chat, fingerprint=str(info.get("fingerprint") or ""), max_tokens=token_limit)
    try:
        sspec = sweep_spec_of(spec)
        check_prompt_memory(sspec)  # before the preview builds any prompt
        with st.spinner("Counting the answers in the memo…"):
            st.caption(S.plan_text(C.sweep_plan(info, sspec), sspec, rmax) + " · "
                       + C.batch_phrase(st.session_state["sw_batch"])
                       + (f". {S.noise_note(sspec.n)}" if S.noise_note(sspec.n) else ""))
        form_spec = spec_to_dict(spec)
    except (GDNVizError, ValueError) as e:
        errors.append(str(e))
for e in errors:
    C.show_error(e)
running = C.job_active(st.session_state.get("sweep_job"))
go = st.button("Run the sweep", type="primary", key="sw_run", icon=":material/play_arrow:",
               disabled=bool(errors) or running, help="one sweep at a time: cancel the running one first" if running
               else None)
if go and form_spec is not None:
    st.session_state["sweep_job"] = C.submit("sweep", form_spec, label="retrieval sweep")
    st.session_state.setdefault("sw_submitted", []).append(st.session_state["sweep_job"])
    st.rerun()  # redraw from the top: the sidebar's worker status and the Run button see the new job

prev = S.previous_sweeps(C.store())
bad_jobs = C.store().read_jobs()[1]
if bad_jobs:
    st.caption(f"{len(bad_jobs)} stored job record{'s' if len(bad_jobs) != 1 else ''} cannot be read and "
               f"{'is' if len(bad_jobs) == 1 else 'are'} skipped (a sweep among them is not listed): "
               + ", ".join(f"`{j}`" for j, _ in bad_jobs[:3]) + (" …" if len(bad_jobs) > 3 else ""))
if prev:
    labels = {p["id"]: p["label"] for p in prev}
    ids = [p["id"] for p in prev]

    def _reopen():
        st.session_state["sweep_job"] = st.session_state["sw_prev"]

    cur = st.session_state.get("sweep_job")
    if cur in labels:
        st.session_state["sw_prev"] = cur
    st.selectbox("Previous sweeps (stored; reopening one is instant)", ids, key="sw_prev", index=None if
                 cur not in labels else ids.index(cur), format_func=labels.get, on_change=_reopen,
                 placeholder=f"{len(prev)} finished sweep(s) in the store: pick one to show it")

rec = C.job_panel("sweep_job", "Sweep", resume="samples")
if rec is not None and rec["status"] == "done":
    from gdnviz import figures as F
    from gdnviz.probes import sweep

    res = rec["result"]
    tab = sweep.table_frame(res["table"])
    rows = sweep.rows_frame(res["rows"])
    spec = res["settings"]
    C.stale_result_note(C.settings_differ(rec["spec"], form_spec, {
        "model": "model", "tasks": "tasks", "lengths": "target lengths", "ranks": "ranks", "n": "samples n",
        "seed0": "first seed", "heads": "heads", "rank_maps": "rank maps", "segment_len": "segment length",
        "max_new_tokens": "new tokens", "chat_template": "chat template"}), "sweep")
    when = C.computed_when(rec, st.session_state.get("sw_submitted", []))
    st.markdown(f"**{res['n_results']:,} answers** ({res['computed']:,} generated {when}, {res['reused']:,} read "
                f"from the store) · {res['n_heads']} heads cut · L = {spec['segment_len']} · {res['dtype']} on "
                f"{res['device']} · {res['kernel_path']} kernels")
    st.markdown("**Score per task, length and r** — RULER string match (%), and in brackets the change vs the "
                "untouched model ± its paired standard error over the same samples (points)")
    st.dataframe(S.seed000_table(tab, int(res["rmax"])), hide_index=True, width="stretch")
    if S.prompt_length_note(rows):
        st.caption(S.prompt_length_note(rows))
    maps_tab = S.rank_map_table(tab)
    if maps_tab is not None:
        st.markdown("**Per-head rank maps** — score (%) with each map, and in brackets the change vs the untouched "
                    "model ± paired SE (points)")
        st.dataframe(maps_tab, hide_index=True, width="stretch")
    floor = S.untouched_at_zero(tab)
    if floor:
        st.warning("The untouched model scores 0 on " + ", ".join(floor) + ": there is no retrieval there for a "
                   "truncation to lose, so those rows say nothing about rank. The model cannot do the task at that "
                   "length (too small, untrained, or the prompt format does not suit it: try the chat-template "
                   "setting).", icon=":material/warning:")
    name = Path(str(res["model_name"])).name
    C.chart(sweep.sweep_figure(tab, title=f"{name}: RULER score vs rank"), tab, "sweep_score_vs_rank",
            key="sw_chart", fixed_size=True)
    st.download_button("Per-sample answers (CSV)", data=F.to_csv(sweep.csv_frame(rows)),
                       file_name="sweep_rows.csv", mime="text/csv", on_click="ignore", key="sw_rows_csv",
                       icon=":material/table:")
    with st.expander("The table in long form (the CSV download)"):
        st.dataframe(S.long_table(tab), hide_index=True, width="stretch")
