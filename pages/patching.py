"""State patching: run prompt B with chosen heads' states at one boundary replaced by prompt A's, and compare the
answers and the loss (gdnviz.patching), in the worker."""
from __future__ import annotations

import streamlit as st

from gdnviz import figures as F
from gdnviz.errors import GDNVizError
from gdnviz.ui import common as C

C.ensure_entrypoint()
from gdnviz.ui import patching as P  # noqa: E402
from gdnviz.ui import sweeps as SW  # noqa: E402

st.title("State patching")
st.caption("Run prompt B with the chosen heads' states at one segment boundary replaced by prompt A's (the state "
           "after that many tokens of A), then compare greedy answers and the loss of a continuation after B "
           "(mean −log p per token, nats; Δ = patched − unpatched). Every other head, the attention layers and "
           "every other boundary are untouched. Definitions: docs/attribution.md.")

run, info, model_name, device, dtype, L, table, src, trust = C.page_model("state patching runs on the chosen model.")
gl, H = list(info["gdn_layers"]), int(info["num_heads"])
st.markdown(f"Model: {src} · GDN layers {', '.join(map(str, gl))} × {H} heads · segment length **L = {L}** "
            "(boundaries at L, 2L, …)")
errors: list[str] = []

st.subheader("1 · Prompts")
for k, v in (("pt_source", "needle"), ("pt_len", 1024), ("pt_seed", 0), ("pt_a", ""), ("pt_b", ""),
             ("pt_boundary", 0), ("pt_from", 0), ("pt_new", 16), ("pt_cont", "")):
    st.session_state.setdefault(k, v)
# heads name one model's layers: each model keeps its own (its default until edited) when the model changes
by_model = st.session_state.setdefault("pt_heads_by_model", {})
if st.session_state.get("pt_heads_model") != model_name:
    if "pt_heads_model" in st.session_state and "pt_heads" in st.session_state:
        by_model[st.session_state["pt_heads_model"]] = st.session_state["pt_heads"]
    st.session_state["pt_heads"] = by_model.get(model_name, "5:1" if "demo" in str(model_name) else "all")
    st.session_state["pt_heads_model"] = model_name
source = st.radio("Prompts", list(P.SOURCES), format_func=P.SOURCES.get, key="pt_source", horizontal=True,
                  label_visibility="collapsed")
kw: dict = {}
if source == "needle":
    c = st.columns(2)
    kw["target_len"] = c[0].number_input("Target length (tokens)", min_value=64, max_value=1 << 20, step=256,
                                         key="pt_len", help=SW.TARGET_LENGTH_HELP)
    kw["seed"] = c[1].number_input("Sample seed", min_value=0, step=1, key="pt_seed")
    st.caption("A: a RULER niah_single_1 prompt (one 7-digit needle in repeated noise). B: the same prompt with "
               "the needle line replaced by a noise line. The continuation scored is the needle value. "
               + SW.target_note("niah_single_1", int(kw["target_len"])))
else:
    c = st.columns(2)
    kw["prompt_a"] = c[0].text_area("Prompt A (the donor)", key="pt_a", height=160)
    kw["prompt_b"] = c[1].text_area("Prompt B (patched)", key="pt_b", height=160)
    if not (kw["prompt_a"].strip() and kw["prompt_b"].strip()):
        errors.append("Type both prompts, A and B.")

st.subheader("2 · Heads and boundary")
c = st.columns([2, 1, 1, 1])
heads = c[0].text_input("Heads", key="pt_heads", help="all · layer:head,layer:head · layers:4,5 (the model's layer "
                                                      "indices)")
boundary = c[1].number_input("Boundary of B (tokens)", min_value=0, step=L, key="pt_boundary",
                             help="0: the last boundary before B's question (needle) or before B's end")
from_a = c[2].number_input("From A's boundary", min_value=0, step=L, key="pt_from",
                           help="0: the same position as B's boundary")
new = c[3].number_input("Tokens to generate", min_value=1, max_value=512, key="pt_new")
cont = st.text_input("Continuation scored after B (optional)", key="pt_cont",
                     help="empty: the needle value (needle pair) or B's own unpatched answer")
try:
    n_heads = len(P.check_heads(heads, info))
    st.caption(f"{n_heads} head(s) patched")
except (GDNVizError, ValueError) as e:
    errors.append(f"Heads: {e}")
for v, what in ((boundary, "Boundary of B"), (from_a, "A's boundary")):
    try:
        P.check_position(int(v), L, what)
    except ValueError as e:
        errors.append(str(e))

st.subheader("3 · Run")
st.caption(P.run_text(int(new)))
n_tok = P.job_tokens(C.fast_tokenizer(info), source, max_new_tokens=int(new), continuation=cont,
                     target_len=int(kw.get("target_len", 0)), prompt_a=kw.get("prompt_a", ""),
                     prompt_b=kw.get("prompt_b", ""))
st.caption((f"Up to about **{n_tok:,} tokens** through the model: " if n_tok is not None else
            "Tokens through the model: ") + C.job_eta(info, "patch", n_tok, L))
for e in errors:
    C.show_error(e)
form_spec = None if errors else P.job_dict(
    model_name, device, dtype, info, source=source, heads=heads, L=L, boundary=int(boundary), from_a=int(from_a),
    max_new_tokens=int(new), continuation=cont, trust_remote_code=trust, **kw)
running = C.job_active(st.session_state.get("patch_job"))
if st.button("Run the patch", type="primary", key="pt_run", icon=":material/play_arrow:",
             disabled=bool(errors) or running) and form_spec is not None:
    st.session_state["patch_job"] = C.submit("patch", form_spec, label="state patching")
    st.rerun()

rec = C.job_panel("patch_job", "State patching")
if rec is None:
    st.info("**No comparison yet.** Choose the prompts, heads and boundary, then **Run the patch**.",
            icon=":material/info:")
elif rec["status"] == "done":
    res = rec["result"]
    C.stale_result_note(C.settings_differ(rec["spec"], form_spec, {
        "model": "model", "task": "prompts", "prompt_a": "prompt A", "prompt_b": "prompt B",
        "target_len": "target length", "seed": "sample seed", "heads": "heads", "boundary": "boundary of B",
        "source": "A's boundary", "max_new_tokens": "tokens to generate", "continuation": "continuation",
        "segment_len": "segment length"}), "comparison")
    st.markdown(P.settings_line(res))
    st.markdown(f"**{P.verdict(res)}**")
    comp = P.comparison_frame(res)
    st.dataframe(comp, hide_index=True, width="stretch", column_config={
        "prompt_tokens": "prompt tokens", "n_generated": "tokens generated",
        "continuation_tokens": "continuation tokens",
        "score": st.column_config.NumberColumn("score (%)", format="%.0f"),
        "loss": st.column_config.NumberColumn("loss (nats/token)", format="%.4f"),
        "delta_loss": st.column_config.NumberColumn("Δ loss vs B", format="%+.4f")})
    if res["loss"]:
        st.caption(f"Loss on {res['loss']['n']} continuation token(s) {res['continuation_text']!r} after B "
                   f"({'given' if res['continuation']['given'] else 'B’s unpatched answer'}).")
    st.download_button("Comparison (CSV)", data=F.to_csv(comp), file_name="patch_comparison.csv", mime="text/csv",
                       on_click="ignore", key="pt_csv", icon=":material/table:")
    st.markdown("**The replaced states** at the boundary, per patched head (Frobenius norms; A's state after the "
                "source boundary, B's own before the patch)")
    st.dataframe(P.states_frame(res), hide_index=True, width="stretch", column_config={
        "norm_A": st.column_config.NumberColumn("‖S_A‖_F", format="%.4f"),
        "norm_B": st.column_config.NumberColumn("‖S_B‖_F", format="%.4f"),
        "rel_change": st.column_config.NumberColumn("‖S_A − S_B‖_F / ‖S_B‖_F", format="%.4f")})
    with st.expander("The text around the boundary"):
        for k in ("A", "B"):
            a = res["around"][k]
            st.markdown(f"**{k}** (… | boundary | …)")
            st.code(f"{a['before']} ‖ {a['after']}", language=None, wrap_lines=True)
