"""Head scans & budgets: which layers / heads a RULER task needs, and per-head rank budgets, in the worker."""
from __future__ import annotations

from pathlib import Path

import streamlit as st

from gdnviz.errors import GDNVizError
from gdnviz.ui import common as C

C.ensure_entrypoint()
from gdnviz import figures as F  # noqa: E402
from gdnviz.jobs import BudgetJob, MemoMapping, ScanJob, spec_to_dict  # noqa: E402
from gdnviz.plotstyle import human_bytes  # noqa: E402
from gdnviz.probes import budget, ruler, scan, sweep  # noqa: E402
from gdnviz.ui import head_panel  # noqa: E402
from gdnviz.ui import scans as S  # noqa: E402
from gdnviz.ui import sweeps as SW  # noqa: E402

st.title("Head scans & budgets")
st.caption("A **scan** runs one RULER task with one layer or one head cut to rank r at every segment boundary (the "
           "others untouched), or in *keep-one* mode with every head cut to r except one layer or head kept whole; "
           "each setting's score is paired with its baseline over the same samples. A **budget** finds per-head "
           "ranks as small as possible with every task within δ points of the untouched model. Every answer is "
           "stored as it finishes and shared with the Retrieval sweeps page.")

run, info, model_name, device, dtype, L, table, src, trust = C.page_model("scans and budgets run on it here.")
gl, H = list(info["gdn_layers"]), int(info["num_heads"])
rmax = min(int(info["d_k"]), int(info["d_v"]))
ns = S.model_ns(info)
st.markdown(f"Model: {src} · {len(gl)} GDN layers × {H} heads of {info['d_k']}×{info['d_v']} · segment length "
            f"**L = {L}** · r = {rmax} keeps a state untouched")
tok = C.hf_tokenizer(info)
if tok is None:
    C.show_error(f"{info.get('path') or model_name} has no tokenizer files beside its weights: the RULER prompts "
                 "need the model's tokenizer.")
    st.stop()
memo = MemoMapping(C.store())
fp = str(info.get("fingerprint") or "")
planner = C.sweep_planner(info)  # the scan's and the budget's previews build at most PREVIEW_TOKENS of prompts

# =============================================================================================================
# scan
# =============================================================================================================
st.subheader("1 · Sensitivity scan")
for k, v in (("sc_task", "niah_single_1"), ("sc_length", max(4 * L, 1024)), ("sc_n", 20), ("sc_r", 1),
             ("sc_by", "layer"), ("sc_keep", False), ("sc_layers", []), ("sc_limit", scan.DEFAULT_MAX_PROMPTS),
             ("sc_batch", None), ("sc_seed0", 0), ("sc_max_new", 0)):
    st.session_state.setdefault(k, v)
c = st.columns([3, 2, 1, 1, 1])
c[0].selectbox("RULER task", list(ruler.TASK_NAMES), key="sc_task",
               format_func=lambda t: f"{t}: {ruler.TASKS[t]['description']}")
c[1].number_input("Target length (tokens)", min_value=1, step=256, key="sc_length", help=SW.TARGET_LENGTH_HELP)
c[2].number_input("Samples n", min_value=1, max_value=10_000, key="sc_n")
c[3].number_input("r", min_value=1, max_value=rmax, key="sc_r", help=f"the rank a cut head keeps, 1..{rmax - 1}")
c[4].number_input("Batch", min_value=1, max_value=512, key="sc_batch", placeholder="auto",
                  help="samples per forward pass; empty (auto): from the GPU's free memory and the prompt length "
                       "(8 on CPU)")
c = st.columns([2, 2, 3, 1])
c[0].radio("Units", list(S.BY), key="sc_by", format_func=S.BY.get, horizontal=False)
c[1].checkbox("Keep-one", key="sc_keep", help="every GDN head cut to r except the unit, kept whole; the baseline is "
                                              "every head cut to r (the “widen only those” form of seed 000)")
c[2].multiselect("Only these layers (empty: all)", gl, key="sc_layers",
                 help="narrow a head scan to the layers a layer scan found")
c[3].number_input("Prompt limit", min_value=1, step=100, key="sc_limit",
                  help="the most new answers a scan may generate; raise it to run a bigger scan")
with st.expander("More settings"):
    c = st.columns(3)
    c[0].number_input("First seed", min_value=0, step=1, key="sc_seed0")
    c[1].number_input("New tokens (0 = the task's own)", min_value=0, max_value=4096, step=8, key="sc_max_new")
errors = []
token_limit = C.token_limit()
too_long = SW.token_limit_error([st.session_state["sc_length"]], token_limit)
if too_long:  # before its prompts are built (the preview builds them)
    errors.append(too_long)
sspec = scan.ScanSpec(model=model_name, task=st.session_state["sc_task"], length=int(st.session_state["sc_length"]),
                      r=int(st.session_state["sc_r"]), by=st.session_state["sc_by"],
                      keep=bool(st.session_state["sc_keep"]),
                      layers=tuple(int(x) for x in st.session_state["sc_layers"]) or None,
                      n=int(st.session_state["sc_n"]), seed0=int(st.session_state["sc_seed0"]), segment_len=L,
                      batch_size=C.batch_value(st.session_state["sc_batch"]), fingerprint=fp or None,
                      max_new_tokens=int(st.session_state["sc_max_new"]) or None,
                      max_prompts=int(st.session_state["sc_limit"]))
if not errors:  # every sample's smallest prompt, within the preview bound (the job checks the seeds left)
    errors += C.seed_checks([sspec.task], [sspec.length], tok, sspec.seed0, sspec.n, sspec.chat_template, info=info)
plan = None
if not errors:
    try:  # the prompts' memory is checked before any is built
        with st.spinner("Counting the answers in the memo…"):
            plan = scan.plan_scan(ns, tok, sspec, memo, plan=planner)
    except (GDNVizError, ValueError) as e:
        errors.append(str(e))
if plan is not None:
    noise = SW.noise_note(sspec.n)
    st.caption(S.scan_plan_text(plan, sspec.n) + "." + (f" {noise}" if noise else "") + " "
               + SW.target_note(sspec.task, sspec.length, shown_after=False))
    lim = S.over_limit(plan["to_run"], sspec.max_prompts, "scan", counted=plan["cached"] is not None)
    if lim:
        errors.append(lim)
for e in errors:
    C.show_error(e)
scan_form = spec_to_dict(ScanJob(
    model=model_name, device=device, dtype=dtype, trust_remote_code=trust, task=sspec.task, length=sspec.length,
    r=sspec.r, by=sspec.by,
    keep=sspec.keep, layers=tuple(sspec.layers or ()), n=sspec.n, seed0=sspec.seed0, segment_len=L,
    batch_size=sspec.batch_size, max_new_tokens=int(st.session_state["sc_max_new"]), max_prompts=sspec.max_prompts,
    fingerprint=fp, max_tokens=token_limit))
running = C.job_active(st.session_state.get("scan_job"))
if st.button("Run the scan", type="primary", key="sc_run", icon=":material/play_arrow:",
             disabled=bool(errors) or running, help="one scan at a time" if running else None) and not errors:
    st.session_state["scan_job"] = C.submit("scan", scan_form, label="head scan")
    st.rerun()

rec = C.job_panel("scan_job", "Scan", resume="answers")
if rec is not None and rec["status"] == "done":
    C.stale_result_note(C.settings_differ(rec["spec"], None if plan is None else scan_form, {
        "model": "model", "task": "task", "length": "length", "r": "r", "by": "units", "keep": "keep-one",
        "layers": "layers", "n": "samples n", "seed0": "first seed", "max_new_tokens": "new tokens",
        "segment_len": "segment length"}), "scan")
    res = rec["result"]
    tab = scan.table_frame(res["table"])
    sp = res["settings"]
    keep = bool(sp["keep"])
    base = (f"every head at r = {sp['r']}: **{res['all_cut']:.1f}**" if keep else "")
    st.markdown(f"**{sp['task']} @ {int(sp['length']):,}-token target**, n = {sp['n']} · untouched "
                f"**{res['untouched']:.1f}**"
                + (f" · {base}" if base else "") + f" · {res['computed']:,} answers generated now, "
                f"{res['reused']:,} from the memo · {res['dtype']} on {res['device']}")
    if SW.noise_note(int(sp["n"])):
        st.caption(SW.noise_note(int(sp["n"])))
    if SW.prompt_length_note(res.get("prompt_tokens")):
        st.caption(SW.prompt_length_note(res["prompt_tokens"]))
    what = "kept whole, every other head at" if keep else "cut to"
    title = f"{Path(str(res['model_name'])).name}: one {sp['by']} {what} r = {sp['r']}"
    hdf = F.scan_heatmap_frame(tab, gl, H)
    heat = st.container()

    def draw_heat(lh):  # the scan heatmap, framing the panel's open head lh, above the head panel (head_panel.panel)
        with heat:
            C.chart(F.scan_heatmap(hdf, keep=keep, title=title, selected=lh), hdf, "scan_heatmap", key="sc_heat",
                    on_select="rerun", selection_mode="cell", fixed_size=True,
                    export=F.scan_heatmap(hdf, keep=keep, title=title, interactive=False))

    # a click on a cell was handled by app.py (common.HEAD_CLICKS): its head is shown in the panel under the
    # heatmap, with the numbers of this session's run when that run is of the scanned model
    scanned = str(rec["spec"].get("fingerprint") or "")
    same = run is not None and scanned != "" and scanned == str(run["model"].get("fingerprint") or "")
    head_panel.panel(info, run if same else None, table if same else None, draw_heat)
    st.markdown("**Ranked** — " + ("largest gain from keeping the unit whole first" if keep else
                                   "largest drop from cutting the unit first"))
    st.dataframe(S.ranked_view(tab, keep), hide_index=True, width="stretch",
                 column_config={k: st.column_config.NumberColumn(format="%.1f") for k in
                                ("score (%)", "baseline (%)", "Δ (points)", "paired SE (points)")})
    st.download_button("scan.csv", data=F.to_csv(sweep.csv_frame(tab)), file_name="scan.csv", mime="text/csv",
                       on_click="ignore", key="sc_csv", icon=":material/table:")
    if sp["by"] == "layer":
        hot = S.layers_that_matter(tab)

        def _narrow(layers=tuple(hot)):
            st.session_state["sc_by"], st.session_state["sc_layers"] = "head", list(layers)

        st.button(f"Head scan inside the layers that matter ({', '.join(map(str, hot)) or 'none'})", key="sc_narrow",
                  on_click=_narrow, disabled=not hot, icon=":material/zoom_in:",
                  help="layers whose |Δ| is at least 5 points and two paired SEs")

# =============================================================================================================
# budget
# =============================================================================================================
st.subheader("2 · Per-head rank budget")
for k, v in (("bg_tasks", ["niah_single_1", "vt"]), ("bg_lengths", str(max(4 * L, 1024))), ("bg_n", 20),
             ("bg_tol", 1.0), ("bg_curve", ""), ("bg_ladder", ", ".join(str(r) for r in budget.DEFAULT_LADDER if r < rmax)), ("bg_max_new", 0),
             ("bg_limit", scan.DEFAULT_MAX_PROMPTS)):
    st.session_state.setdefault(k, v)
st.multiselect("Task set", list(ruler.TASK_NAMES), key="bg_tasks")
c = st.columns([2, 1, 1, 2, 2, 1])
c[0].text_input("Target lengths (tokens)", key="bg_lengths", help=SW.TARGET_LENGTHS_HELP)
c[1].number_input("Samples n", min_value=2, max_value=10_000, key="bg_n",
                  help="per task and length; the held-out check uses as many samples of other seeds")
c[2].number_input("Tolerance δ (points)", min_value=0.0, step=0.5, key="bg_tol")
c[3].text_input("More δ for the curve", key="bg_curve", placeholder="e.g. 2, 5, 10",
                help="each adds one budget to the score-vs-state-memory figure (answers are shared)")
c[4].text_input("Rank ladder", key="bg_ladder", help="ranks tried, largest first")
c[5].number_input("Prompt limit", min_value=1, step=100, key="bg_limit", help="per budget")
with st.expander("More settings"):
    st.number_input("New tokens (0 = each task's own)", min_value=0, max_value=4096, step=8, key="bg_max_new")
st.caption("Test: a budget passes a (task, length) when the one-sided paired t bound mean(budget − untouched) − "
           "t₀.₉₅,ₙ₋₁·SE is at least −δ (docs/scans.md); the search shrinks the least sensitive heads first.")
berrors = []
tasks = list(st.session_state["bg_tasks"])
lengths, ladder, tols = [], [], []
try:
    lengths = SW.parse_lengths(st.session_state["bg_lengths"])
except ValueError as e:
    berrors.append(str(e))
try:
    ladder = SW.parse_ints(st.session_state["bg_ladder"], "Ladder ranks")
except ValueError as e:
    berrors.append(str(e))
try:
    tols = S.parse_tolerances(f"{st.session_state['bg_tol']}, {st.session_state['bg_curve']}")
except ValueError as e:
    berrors.append(str(e))
if not tasks:
    berrors.append("No tasks chosen: pick at least one RULER task.")
elif tols:  # what the test can accept at this n and the first δ, and seed 000's small-n warning
    bn = int(st.session_state["bg_n"])
    st.caption(budget.acceptance_text(tasks, bn, tols[0], BudgetJob.alpha)
               + (f" {SW.noise_note(bn)}" if SW.noise_note(bn) else ""))
too_long = SW.token_limit_error(lengths, token_limit)
if too_long:
    berrors.append(too_long)
bplan = budget_form = None
if not berrors:
    budget_form = spec_to_dict(BudgetJob(
        model=model_name, device=device, dtype=dtype, trust_remote_code=trust, tasks=tuple(tasks),
        lengths=tuple(lengths),
        n=int(st.session_state["bg_n"]), tolerances=tuple(tols), ladder=tuple(ladder), segment_len=L,
        max_new_tokens=int(st.session_state["bg_max_new"]), max_prompts=int(st.session_state["bg_limit"]),
        fingerprint=fp, max_tokens=token_limit))
    bspec = budget.BudgetSpec(model=model_name, tasks=tuple(tasks), lengths=tuple(lengths),
                              n=int(st.session_state["bg_n"]), tolerance=tols[0], ladder=tuple(ladder), segment_len=L,
                              max_new_tokens=int(st.session_state["bg_max_new"]) or None,
                              fingerprint=fp or None, max_prompts=int(st.session_state["bg_limit"]))
    # the search's seeds and the held-out ones after them
    berrors += C.seed_checks(tasks, lengths, tok, bspec.seed0, bspec.n + bspec.heldout_n, bspec.chat_template,
                             info=info)
if not berrors:
    try:  # the prompts' memory is checked before any is built
        with st.spinner("Counting the answers in the memo…"):
            bplan = budget.plan_budget(ns, tok, bspec, memo, plan=planner)
    except (GDNVizError, ValueError) as e:
        berrors.append(str(e))
if bplan is not None:
    st.caption(S.budget_plan_text(bplan) + (f" (for δ = {tols[0]:g}; the other δ reuse most answers)"
                                            if len(tols) > 1 else ""))
    lim = S.over_limit(bplan["max_to_run"], int(st.session_state["bg_limit"]), "budget (at most)")
    if lim:
        berrors.append(lim)
for e in berrors:
    C.show_error(e)
brunning = C.job_active(st.session_state.get("budget_job"))
if st.button("Find the budget", type="primary", key="bg_run", icon=":material/play_arrow:",
             disabled=bool(berrors) or brunning) and not berrors:
    st.session_state["budget_job"] = C.submit("budget", budget_form, label="rank budget")
    st.rerun()

brec = C.job_panel("budget_job", "Budget", resume="answers")
if brec is not None and brec["status"] == "done":
    C.stale_result_note(C.settings_differ(brec["spec"], None if bplan is None else budget_form, {
        "model": "model", "tasks": "tasks", "lengths": "lengths", "n": "samples n", "tolerances": "tolerances",
        "ladder": "rank ladder", "max_new_tokens": "new tokens", "segment_len": "segment length"}), "budget")
    res = brec["result"]
    summ = res["budgets"][0]
    kv = summ["kv_bytes_bfloat16"]
    m = st.columns(4)
    m[0].metric("Recurrent state, full rank", human_bytes(summ["state_bytes_full"]),
                help=f"per sequence, all GDN heads, {summ['state_dtype']}")
    m[1].metric(f"With the δ = {summ['tolerance']:g} budget", human_bytes(summ["state_bytes_budget"]),
                delta=S.saved_text(summ), delta_color="inverse",
                help="a rank-r head kept as its factors: r·(d_k + d_v) numbers instead of d_k·d_v")
    for i, ctx in enumerate(list(kv)[:2]):
        m[2 + i].metric(f"Attention KV at {int(ctx) // 1024}K tokens", human_bytes(kv[ctx]),
                        help="bfloat16, the Cache budget page's accounting")
    st.markdown("**Scores** — every (task, length) on the search's samples and on held-out seeds "
                f"({summ['heldout_seeds'][0]}…{summ['heldout_seeds'][1]})" if summ["heldout_seeds"] else "**Scores**")
    st.dataframe(S.tests_view(summ), hide_index=True, width="stretch")
    st.markdown("**State memory per layer** (KiB per sequence)")
    st.dataframe(S.memory_view(summ), hide_index=True, width="stretch")
    curve = budget.curve_frame_from_records(res["curve"])
    C.chart(budget.curve_figure(curve, title=f"{Path(str(res['model_name'])).name}: score vs recurrent-state memory"),
            curve, "budget_curve", key="bg_chart", fixed_size=True)
    import json as _json

    rank_json = _json.dumps(dict(format="gdnviz-rank-map-v1", model=res["model"]["name"],
                                 fingerprint=res["model"]["fingerprint"], d_k=res["model"]["d_k"],
                                 d_v=res["model"]["d_v"], ranks=summ["rank_map"], tolerance=summ["tolerance"]),
                            indent=2)
    b = st.columns(4)
    b[0].download_button("rank_map.json", data=rank_json, file_name="rank_map.json", mime="application/json",
                         on_click="ignore", key="bg_json", icon=":material/download:")
    b[1].download_button("summary.json", data=_json.dumps(summ, indent=2), file_name="summary.json",
                         mime="application/json", on_click="ignore", key="bg_summary", icon=":material/download:")
    line = S.sweeps_line(S.budget_name(summ), summ)

    def _to_sweeps():
        cur = st.session_state.get("sw_rank_maps", "").rstrip("\n")
        st.session_state["sw_rank_maps"] = (cur + "\n" if cur else "") + line
        st.session_state["sw_tasks"] = list(summ["settings"]["tasks"])
        st.session_state["sw_lengths"] = ", ".join(str(x) for x in summ["settings"]["lengths"])

    if b[2].button("Use this rank map on Retrieval sweeps", key="bg_to_sweeps", on_click=_to_sweeps,
                   disabled=not line, icon=":material/query_stats:"):
        st.switch_page(C.PAGES["sweeps"])
    budget_ranks = {(int(l), int(h)): int(r) for l, h, r in summ["rank_map"]}
    if b[3].button("Open it on Truncate & compare", key="bg_to_truncate", on_click=C.send_rank_map_to_truncate,
                   args=(budget_ranks,), disabled=not budget_ranks, icon=":material/content_cut:"):
        st.switch_page(C.PAGES["truncate"])

with st.expander("Import a rank map (JSON)"):
    up = st.file_uploader("rank_map.json", type=["json"], key="bg_import")
    if up is not None:
        try:
            ranks = budget.rank_map_from_json(up.getvalue().decode("utf-8", "replace"), ns)
        except (GDNVizError, ValueError) as e:
            C.show_error(f"{up.name}: {e}")
        else:
            mem = S.budget_memory(info, ranks)
            st.markdown(f"**{len(ranks)} heads** below full rank · state "
                        f"{human_bytes(int(mem['budget_bytes'].sum()))} "
                        f"instead of {human_bytes(int(mem['full_bytes'].sum()))} per sequence")
            imported = dict(rank_map=[[l, h, r] for (l, h), r in sorted(ranks.items())])

            def _imp_to_sweeps(_line=S.sweeps_line(S.map_name(up.name), imported)):
                cur = st.session_state.get("sw_rank_maps", "").rstrip("\n")
                st.session_state["sw_rank_maps"] = (cur + "\n" if cur else "") + _line

            if st.button("Use it on Retrieval sweeps", key="bg_imp_sweeps", on_click=_imp_to_sweeps,
                         disabled=not ranks):
                st.switch_page(C.PAGES["sweeps"])
            if st.button("Open it on Truncate & compare", key="bg_imp_truncate", on_click=C.send_rank_map_to_truncate,
                         args=(dict(ranks),), disabled=not ranks):
                st.switch_page(C.PAGES["truncate"])
