"""Truncate & compare: cut chosen heads to rank r at every segment boundary and compare the answers."""
from __future__ import annotations


import pandas as pd
import streamlit as st

from gdnviz import figures as F
from gdnviz.errors import GDNVizError
from gdnviz.ui import common as C

C.ensure_entrypoint()
from gdnviz.ui import sweeps as SW
from gdnviz.ui import truncation as T

st.title("Truncate & compare")
st.caption("At every segment boundary the chosen heads' states are replaced by their projection onto their top-r "
           "left singular directions; the next segment reads and writes the truncated state, so the cut compounds "
           "(seed 000 §3). Full-attention layers are never touched. The same prompt runs untouched and truncated.")

run, info, model_name, device, dtype, L_default, table, src, trust = C.page_model(
    "the truncation runs on it here (ideally run a capture too, so that heads can be chosen by horizon, or open a "
    "stored run in the sidebar under *Previous runs*).")
gl, H = list(info["gdn_layers"]), int(info["num_heads"])
rmax = min(int(info["d_k"]), int(info["d_v"]))
L = L_default
st.markdown(f"Model: {src} · {len(gl)} GDN layers × {H} heads of {info['d_k']}×{info['d_v']} · segment length "
            f"**L = {L}** · r = {rmax} keeps a state untouched")

# =============================================================================================================
# 1. heads and ranks
# =============================================================================================================
st.subheader("1 · Heads and ranks")
st.session_state.setdefault("tr_groups", [0])
all_labels = [C.head_label(l, h) for l in gl for h in range(H)]

# a rank map opened as JSON replaces the groups (before their widgets exist in this run), once per uploaded file
map_error = None
with st.expander("Open a rank map (JSON)"):
    up = st.file_uploader("rank_map.json, as *Head scans & budgets* saves it, or a bare [[layer, head, r], …] list: "
                          "its heads replace the groups below, one head list per rank", type=["json"],
                          key="tr_map_file")
    if up is not None:
        try:
            map_ranks, map_note = T.rank_map_from_text(up.getvalue().decode("utf-8", "replace"), info)
        except (GDNVizError, ValueError) as e:
            map_error = f"Cannot open {up.name}: {e}"
        else:
            if st.session_state.get("tr_map_opened") != up.file_id:
                C.send_rank_map_to_truncate(map_ranks)
                st.session_state["tr_map_opened"] = up.file_id
            st.caption(f"{up.name}: {len(map_ranks)} heads at r = "
                       + ", ".join(str(r) for r in sorted(set(map_ranks.values()))) + ", now the groups below.")
            if map_note:
                st.warning(map_note, icon=":material/warning:")
if map_error:
    C.show_error(map_error, "The groups below are unchanged; Run is off until the file is fixed or removed.")


def _add_group():
    g = st.session_state["tr_groups"]
    st.session_state["tr_groups"] = g + [max(g) + 1]


def _drop_group(gid):
    st.session_state["tr_groups"] = [g for g in st.session_state["tr_groups"] if g != gid]


def _sync_picked(gid):
    st.session_state["picked_heads"] = [list(C.parse_head_label(s)) for s in st.session_state[f"tr_g{gid}_heads"]]


groups = []
for i, gid in enumerate(st.session_state["tr_groups"]):
    with st.container(border=True):
        c = st.columns([2, 4, 1, 1])
        kmode, kr = f"tr_g{gid}_mode", f"tr_g{gid}_r"
        st.session_state.setdefault(kmode, "picked" if (i == 0 and C.picked_heads()) else "all")
        st.session_state.setdefault(kr, float(min(4, rmax)))
        mode = c[0].selectbox(f"Group {i + 1}: truncate", list(T.MODES), key=kmode, format_func=T.MODES.get)
        g = dict(mode=mode)
        with c[1]:
            if mode == "picked":
                kh = f"tr_g{gid}_heads"
                st.session_state[kh] = [C.head_label(*p) for p in C.picked_heads() if C.head_label(*p) in all_labels]
                st.multiselect("Heads (click cells on the heatmap, or add here)", all_labels, key=kh,
                               on_change=_sync_picked, args=(gid,))
                g["heads"] = [list(C.parse_head_label(s)) for s in st.session_state[kh]]
                if not g["heads"]:
                    st.caption("No heads picked yet: on the **Heatmap**, set *Clicking a cell* to “adds / removes "
                               "it in the truncation set” and click cells, or add heads here.")
            elif mode == "heads":
                kl = f"tr_g{gid}_list"
                st.multiselect("Heads", all_labels, key=kl, help="a list of its own (the heatmap's truncation "
                               "set is the other mode); a rank budget sent here fills one group per rank")
                g["heads"] = [list(C.parse_head_label(s)) for s in st.session_state[kl]]
            elif mode == "layers":
                g["layers"] = st.multiselect("GDN layers", gl, key=f"tr_g{gid}_layers",
                                             help="every head of these layers")
            elif mode == "horizon":
                f = st.selectbox("Filter", list(T.HORIZON_FILTERS), key=f"tr_g{gid}_filter",
                                 format_func=T.HORIZON_FILTERS.get)
                g["filter"] = f
                if f == "range":
                    a, b = st.columns(2)
                    g["lo"] = a.number_input("from (tokens)", min_value=0.0, value=0.0, key=f"tr_g{gid}_lo")
                    g["hi"] = b.number_input("to (tokens)", min_value=0.0, value=float(L), key=f"tr_g{gid}_hi")
            else:
                st.caption(f"all {len(gl) * H} heads of every GDN layer")
        # a float field: an integer field would turn a typed 2.5 into 2 without a word; resolve() refuses it
        g["r"] = c[2].number_input("r", step=1.0, format="%g", key=kr, help=f"directions kept per head, 1..{rmax}")
        if len(st.session_state["tr_groups"]) > 1:
            c[3].button("Remove", key=f"tr_g{gid}_rm", on_click=_drop_group, args=(gid,), icon=":material/delete:")
        groups.append(g)
st.button("Add another group", key="tr_add_group", on_click=_add_group, icon=":material/add:",
          help="e.g. r = 1 for the heads forgetting within a segment and r = 12 for one layer; later groups win")

ranks, spec_error = {}, None
try:
    ranks, counts = T.resolve(groups, info, table, L)
except (GDNVizError, ValueError) as e:
    spec_error = str(e)
if spec_error:
    C.show_error(f"Cannot build the truncation: {spec_error}")
elif not ranks:
    st.warning("No heads selected: choose heads in a group above.", icon=":material/warning:")
else:
    st.session_state["tr_rank_map"] = {f"{l}:{h}": int(r) for (l, h), r in sorted(ranks.items())}  # for Sweeps
    by_r = pd.Series(ranks).value_counts().sort_index()
    c = st.columns([5, 1])
    c[0].caption(f"**{len(ranks)} of {len(gl) * H} heads** will be truncated: " +
                 ", ".join(f"{n} at r = {r}" for r, n in by_r.items()) +
                 (f" ({sum(1 for r in ranks.values() if r >= rmax)} with r = {rmax} are left untouched)"
                  if any(r >= rmax for r in ranks.values()) else ""))
    c[1].download_button("rank_map.json", data=T.rank_map_text(ranks, info), file_name="rank_map.json",
                         mime="application/json", on_click="ignore", key="tr_map_json", icon=":material/download:",
                         disabled=all(r >= rmax for r in ranks.values()),
                         help="these groups as one per-head rank map (heads below r = "
                              f"{rmax}), the format Head scans & budgets and this page open")

# =============================================================================================================
# 2. prompt
# =============================================================================================================
st.subheader("2 · Prompt")
from gdnviz.probes import ruler  # noqa: E402

st.session_state.setdefault("tr_prompt_mode", "ruler")
st.session_state.setdefault("tr_task", "niah_single_1")
st.session_state.setdefault("tr_target_len", max(4 * L, 1024))
st.session_state.setdefault("tr_seed", 0)
st.session_state.setdefault("tr_max_new", 0)
st.session_state.setdefault("tr_chat", True)
st.session_state.setdefault("tr_prompt", "")
st.session_state.setdefault("tr_loss_docs", run is not None)
st.radio("Prompt", ["ruler", "typed"], key="tr_prompt_mode", horizontal=True,
         format_func={"ruler": "a generated retrieval sample (RULER)", "typed": "typed"}.get)
prompt_tokens = None
if st.session_state["tr_prompt_mode"] == "ruler":
    c = st.columns([3, 1, 1, 1])
    c[0].selectbox("Task", list(ruler.TASK_NAMES), key="tr_task",
                   format_func=lambda t: f"{t}: {ruler.TASKS[t]['description']}")
    c[1].number_input("Target length (tokens)", min_value=64, max_value=1 << 20, step=256, key="tr_target_len",
                      help=SW.TARGET_LENGTH_HELP)
    c[2].number_input("Seed", min_value=0, step=1, key="tr_seed")
    c[3].checkbox("Chat template", key="tr_chat", help="wrap the task as one user message when the tokenizer has "
                                                       "a chat template (instruction-tuned models)")
    ttg = int(ruler.TASKS[st.session_state["tr_task"]]["tokens_to_generate"])
    tl = int(st.session_state["tr_target_len"])
    st.caption(SW.target_note(st.session_state["tr_task"], tl))
    prompt_tokens = max(tl - ttg, 0)
else:
    st.text_area("Prompt", key="tr_prompt", height=140, placeholder="Type a prompt; the model continues it.")
    tok = C.fast_tokenizer(info)
    if tok is not None and st.session_state["tr_prompt"].strip():
        from gdnviz.documents import tokenize

        prompt_tokens = len(tokenize(tok, st.session_state["tr_prompt"]))
c = st.columns([1, 3])
c[0].number_input("New tokens (0 = the task's own)", min_value=0, max_value=4096, step=8, key="tr_max_new")
if run is not None:
    c[1].checkbox(f"Also measure the next-token loss change on the run's {len(run['documents'])} document(s)",
                  key="tr_loss_docs", help="mean next-token loss of the untouched and the truncated model over the "
                                           "documents of the current capture (documents weighted equally); "
                                           "unticked, no loss is computed")
if prompt_tokens is not None and prompt_tokens <= L:
    st.warning(f"The prompt is about {prompt_tokens:,} tokens, not more than one segment (L = {L}): no boundary "
               "falls inside it, so the truncation can only act once generation crosses a boundary. Use a longer "
               "prompt or a shorter segment length.", icon=":material/warning:")

# =============================================================================================================
# 3. run
# =============================================================================================================
st.subheader("3 · Run")
typed_empty = st.session_state["tr_prompt_mode"] == "typed" and not st.session_state["tr_prompt"].strip()
if not typed_empty:
    new_tok = int(st.session_state["tr_max_new"]) or (ttg if st.session_state["tr_prompt_mode"] == "ruler" else 32)
    doc_tok = sum(int(d["n_tokens"]) for d in run["documents"]) if run is not None and \
        st.session_state.get("tr_loss_docs") else 0
    n_tok = None if prompt_tokens is None else 2 * (prompt_tokens + new_tok + doc_tok)
    st.caption("Each of the two runs (untouched, truncated): " + ("the prompt" if prompt_tokens is None else
                                                                  f"about {prompt_tokens:,} prompt tokens")
               + f", up to {new_tok:,} new tokens" + (f" and the run's documents ({doc_tok:,} tokens)" if doc_tok
                                                      else "")
               + (f", so **up to about {n_tok:,} tokens** through the model" if n_tok is not None else "")
               + " (none when this exact comparison is stored): " + C.job_eta(info, "truncate", n_tok, L))
go = st.button("Run untouched and truncated", type="primary", key="tr_run", icon=":material/play_arrow:",
               disabled=bool(spec_error or map_error) or not ranks)


def _form_spec() -> dict:
    """The job spec the form's settings make now."""
    from gdnviz.jobs import TruncateCompareJob, spec_to_dict

    loss_docs = ()
    if run is not None and st.session_state.get("tr_loss_docs"):
        loss_docs = tuple(tuple(d) for d in run["spec"]["documents"])
    ruler_mode = st.session_state["tr_prompt_mode"] == "ruler"
    spec = TruncateCompareJob(
        model=model_name, device=device, dtype=dtype, trust_remote_code=trust, segment_len=L,
        ranks=tuple((l, h, r) for (l, h), r in sorted(ranks.items())),
        prompt="" if ruler_mode else st.session_state["tr_prompt"],
        task=st.session_state["tr_task"] if ruler_mode else "",
        target_len=int(st.session_state["tr_target_len"]), seed=int(st.session_state["tr_seed"]),
        max_new_tokens=int(st.session_state["tr_max_new"]) or (0 if ruler_mode else 32),
        loss_documents=loss_docs, chat_template=bool(st.session_state["tr_chat"]))
    return spec_to_dict(spec)


try:
    form_spec = _form_spec() if ranks and not (spec_error or map_error) else None
except (GDNVizError, ValueError):  # the job refuses these settings: it says why when Run is clicked
    form_spec = None
if go and typed_empty:
    C.show_error("The prompt is empty: type a prompt, or use a generated retrieval sample.")
elif go:
    st.session_state["truncate_job"] = C.submit("truncate", form_spec, label="truncate & compare")
    st.rerun()  # redraw from the top: the sidebar's worker status sees the new job

rec = C.job_panel("truncate_job", "Truncate & compare")
if rec is not None and rec["status"] == "done":
    res = rec["result"]
    C.stale_result_note(C.settings_differ(rec["spec"], form_spec, {
        "ranks": "heads or ranks", "prompt": "prompt", "task": "task", "target_len": "target length",
        "seed": "seed", "max_new_tokens": "new tokens", "loss_documents": "loss documents",
        "chat_template": "chat template", "model": "model", "segment_len": "segment length"}), "comparison")
    rs = sorted({r for _, _, r in res["ranks"]})
    tgt = rec["spec"].get("target_len") if rec["spec"].get("task") else None
    st.markdown(f"**{res['n_heads']} heads truncated** (r = {', '.join(map(str, rs))}) · {res['prompt_tokens']:,} "
                "prompt tokens" + (f" (target length {int(tgt):,})" if tgt else "")
                + f", {res['boundaries_in_prompt']} boundar{'y' if res['boundaries_in_prompt'] == 1 else 'ies'}"
                f" inside the prompt · up to {res['max_new_tokens']} new tokens · {res['kernel_path']} kernels"
                + T.readout_note(res.get("readouts", {}).get("truncated"))
                + (" · reopened from the store" if res.get("memo_hit") else ""))
    a, b = st.columns(2)
    for col, key, title in ((a, "untouched", "Untouched model"), (b, "truncated", "Truncated model")):
        with col, st.container(border=True):
            st.markdown(f"**{title}**")
            if res["scores"]:
                delta = None if key == "untouched" else res["scores"]["truncated"] - res["scores"]["untouched"]
                st.metric("RULER score (string match, %)", f"{res['scores'][key]:.0f}",
                          delta=None if not delta else f"{delta:+.0f}",
                          help="RULER's string_match_all: share of the expected answers found in the output")
            st.code(res[key]["text"] or "(no tokens generated)", language=None, wrap_lines=True)
    if res["references"]:
        st.caption("Expected answer(s): " + ", ".join(f"`{r}`" for r in res["references"]))
    st.caption("One prompt (n = 1): a changed answer or score here is an anecdote, not an effect size. For a score "
               "difference with a standard error, run n samples per rank on **Retrieval sweeps** (paired over the "
               "same samples).")
    lo = res["loss"]
    if lo is None:
        st.caption("Next-token loss: not measured" + (" (tick *Also measure the next-token loss change* above to "
                                                       "measure it on the run's documents)." if run is not None
                                                       else " (it is measured on the documents of a capture)."))
    else:
        st.markdown(f"**Next-token loss** on the run's {lo['n_documents']} document(s) (mean of the per-document "
                    "means)")
        m = st.columns(3)
        m[0].metric("Untouched (nats / token)", f"{lo['untouched']:.4f}")
        m[1].metric("Truncated (nats / token)", f"{lo['truncated']:.4f}", delta=f"{lo['delta']:+.4f}",
                    delta_color="inverse")
        m[2].metric("Relative change", f"{100 * lo['delta'] / lo['untouched']:+.2f}%" if lo["untouched"] else "n/a")
        ld = pd.DataFrame([{k: v for k, v in l.items() if k not in ("positions", "delta_along")}
                           for l in res["losses"]])
        st.dataframe(ld.rename(columns={"loss_untouched": "loss untouched (nats)",
                                        "loss_truncated": "loss truncated (nats)", "delta": "Δ loss (nats)",
                                        "n_predictions": "predictions", "n_tokens": "tokens"}).drop(columns=["block"]),
                     hide_index=True, width="stretch")
        along = pd.DataFrame([dict(document=l["document"], position=p, delta=d) for l in res["losses"]
                              for p, d in zip(l["positions"], l["delta_along"])])
        if len(along):
            C.chart(F.loss_delta_chart(along), along, "loss_change_along", key="tr_loss_chart")
    with st.expander(f"The prompt ({res['prompt_tokens']:,} tokens)"):
        st.code(res["prompt"], language=None, wrap_lines=True, height=300)
