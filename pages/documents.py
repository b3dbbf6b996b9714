"""Model & documents: pick a model, see what was found, build a document set, run the capture."""
from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import streamlit as st

from gdnviz import documents as D
from gdnviz.errors import GDNVizError
from gdnviz.runner import check_segment_len
from gdnviz.ui import common as C

C.ensure_entrypoint()

st.title("Model & documents")
st.caption("Choose a Gated DeltaNet hybrid and a set of documents, then capture every GDN head's state along "
           "each document. The capture runs in the worker process; results are stored and reopen instantly.")

# =============================================================================================================
# 1. model
# =============================================================================================================
st.subheader("1 · Model")
SOURCES = {"demo": "Bundled demo model", "path": "Local checkpoint folder", "hf": "Local Hugging Face cache"}


@st.cache_data(ttl=30, show_spinner=False)
def hf_cached_models() -> list[tuple[str, str]]:
    """(org/name, model_type) of the models in the local HF cache that have a config.json."""
    import json

    try:
        from huggingface_hub import scan_cache_dir

        info = scan_cache_dir()
    except Exception:
        return []
    out = []
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        mt = "?"
        for rev in repo.revisions:
            cfg = Path(rev.snapshot_path) / "config.json"
            if cfg.exists():
                try:
                    raw = json.loads(cfg.read_text())
                    mt = raw.get("model_type") or (raw.get("text_config") or {}).get("model_type") or "?"
                except Exception:
                    pass
                break
        out.append((repo.repo_id, mt))
    return sorted(out)


c1, c2, c3 = st.columns([3, 1, 1])
with c1:
    st.radio("Source", list(SOURCES), format_func=SOURCES.get, key="model_source", horizontal=True,
             on_change=C.untrust)
    src = st.session_state["model_source"]
    if src == "demo":
        if not C.demo_installed():
            st.warning("The bundled demo model is not installed (gdnviz/assets/demo/ has no config.json). Pick a "
                       "local checkpoint folder or a model in the local Hugging Face cache above, or set "
                       "GDNVIZ_DEFAULT_MODEL to a checkpoint folder before starting the app.",
                       icon=":material/warning:")
        else:
            st.caption("A 9.3M-parameter Qwen3.5 hybrid trained for gdnviz (6 GDN layers × 2 heads of 128×128, "
                       "2 full-attention layers), shipped in gdnviz/assets/demo/ — see its MODEL_CARD.md. It "
                       "answers single-needle and variable-tracking prompts up to 4K tokens from its GDN states: "
                       "cut every GDN head to rank 1 on the Truncate & compare page and the needle is lost.")
    elif src == "path":
        st.text_input("Checkpoint folder (holds config.json and *.safetensors)", key="model_path",
                      placeholder="/path/to/Qwen3.5-0.8B", on_change=C.untrust)
    else:
        cached = hf_cached_models()
        if not cached:
            st.info("No models in the local Hugging Face cache "
                    f"({os.environ.get('HF_HUB_CACHE') or '~/.cache/huggingface/hub'}). Nothing is downloaded "
                    "here: fetch a model on a machine with internet (`hf download Qwen/Qwen3.5-0.8B`) and copy "
                    "the cache over, or give the checkpoint folder.")
        else:
            ids = [r for r, _ in cached]
            types = dict(cached)
            if st.session_state.get("model_hf") not in ids:
                st.session_state["model_hf"] = ids[0]
            st.selectbox("Model in the local cache", ids, key="model_hf", on_change=C.untrust,
                         format_func=lambda r: f"{r}  ({types.get(r, '?')})")
    if src != "demo":
        st.checkbox("Trust remote code", key="trust_remote_code",
                    help="Off: a checkpoint's own Python code is never run. On: transformers' "
                         "trust_remote_code=True for this model only (choosing another model unticks it).")
        if st.session_state.get("trust_remote_code"):
            st.warning("**Remote code is trusted for this model.** If its config.json names code of its own "
                       "(`auto_map`), the worker imports and runs those `.py` files from the model folder on this "
                       "machine, with your user's permissions: files, network, anything. Keep it ticked only for "
                       "a folder whose code you have read or whose source you trust.", icon=":material/warning:")
        else:
            st.caption("Only for a checkpoint whose model type is defined by Python code in its folder: ticking "
                       "it runs that code on this machine.")
with c2:
    st.selectbox("Device", ["auto", "cpu", "cuda"], key="device",
                 help="auto: the GPU when the worker sees one, else the CPU")
with c3:
    st.selectbox("dtype", ["auto", "float32", "bfloat16", "float16"], key="dtype",
                 help="auto: bfloat16 on a GPU, float32 on the CPU. States and statistics are always float32/64.")

choice = C.model_choice()
info = None
if not choice["model"]:
    st.info("Enter a checkpoint folder to inspect it.")
elif choice["model"] == "demo" and not C.demo_installed():
    pass
else:
    ins = C.request_inspection()
    if ins.get("error"):
        C.show_error(f"Cannot use **{choice['model']}**: {ins['error']}", C.inspection_next_step(ins))
    elif ins.get("result") is None:
        st.session_state["_inspect_job"] = ins["job"]
        C.job_panel("_inspect_job", f"Inspecting {Path(choice['model']).name or choice['model']}")
    else:
        info = ins["result"]

if info is not None:
    gl, al = info["gdn_layers"], info["attn_layers"]
    st.markdown(
        "| Family | GDN layers | Heads per GDN layer | State d_k × d_v | Kernel path | Device · dtype |\n"
        "|---|---|---|---|---|---|\n"
        f"| {info['family']} (`{info['model_type']}`) | {len(gl)} of {info['num_layers']} | {info['num_heads']} value "
        f"({info['num_key_heads']} key) | {info['d_k']} × {info['d_v']} | **{info['kernel_path']}** "
        f"({'Triton kernels on CUDA' if info['kernel_path'] == 'fla' else 'PyTorch'}) | {info['device']} · "
        f"{info['dtype']} |")
    st.caption(f"`{info['path']}` · GDN layers {gl} · full-attention layers {al} · "
               f"{info['num_heads'] * len(gl)} GDN heads · {info['weight_bytes'] / 2 ** 20:,.1f} MiB of weights · "
               f"fingerprint `{info['fingerprint']}`"
               + ("" if info.get("has_tokenizer_json") else " · no tokenizer.json: token counts come from the "
                                                            "worker")
               + (f" · runs the checkpoint's own code ({', '.join(info['remote_code'])})"
                  if info.get("remote_code") else ""))

# =============================================================================================================
# 2. documents
# =============================================================================================================
st.subheader("2 · Documents")
st.session_state.setdefault("user_docs", [])
st.session_state.setdefault("segment_len", 256)
st.session_state.setdefault("max_tokens", D.max_tokens_default())
st.session_state.setdefault("sample_docs", [])
samples = {d.name: d for d in D.sample_documents()}


def _add_doc(name: str, text: str, source: str) -> None:
    """Add a document to the set. A name already taken (by another document or a bundled sample) gets a
    suffix, and a note says so; the same name with the same text is not added twice."""
    docs = st.session_state["user_docs"]
    notes = st.session_state.setdefault("doc_notes", [])
    same = [d for d in docs if d["name"] == name or d["name"].startswith(f"{name} (")]
    if any(d["text"] == text for d in same):
        notes.append(f"**{name}** is already in the set with the same text: not added again.")
        return
    new = D.unique_name(name, [d["name"] for d in docs] + list(samples))
    if new != name:
        notes.append(f"A document called **{name}** is already in the set: this one ({source}) was added as "
                     f"**{new}**.")
    st.session_state["user_docs"] = docs + [dict(name=new, text=text, source=source)]


def _on_paste() -> None:
    text = st.session_state.get("paste_text", "")
    name = (st.session_state.get("paste_name") or "").strip() or f"pasted-{len(st.session_state['user_docs']) + 1}"
    try:
        text = D.check_text(name, text)
    except GDNVizError as e:
        st.session_state["paste_error"] = str(e)
        return
    st.session_state.pop("paste_error", None)
    st.session_state["doc_notes"] = []
    _add_doc(name, text, "pasted")
    st.session_state["paste_text"] = ""
    st.session_state["paste_name"] = ""


tab_s, tab_p, tab_u = st.tabs(["Sample documents", "Paste text", "Upload files"])
with tab_s:
    st.multiselect("Bundled public-domain texts", list(samples), key="sample_docs",
                   format_func=lambda n: D.sample_title(samples[n]),
                   help="Shipped in gdnviz/assets/samples/ (see the README there for sources)")
with tab_p:
    st.text_input("Name", key="paste_name", placeholder="my-document")
    st.text_area("Text", key="paste_text", height=160, placeholder="Paste a document here…")
    st.button("Add to the document set", key="paste_add", on_click=_on_paste, icon=":material/add:")
    if st.session_state.get("paste_error"):
        C.show_error(st.session_state["paste_error"])
with tab_u:
    ups = st.file_uploader("Text files (.txt, .md); several at once make a document set", type=["txt", "md"],
                           accept_multiple_files=True, key=f"uploads_{st.session_state.get('upload_gen', 0)}")
    # the browser refuses a file over the server's limit with only a red icon: say the limit in words beforehand
    st.caption(f"UTF-8 text, at most {st.get_option('server.maxUploadSize')} MB per file (a larger file is refused "
               "by the browser, marked with a red icon): split it, or paste part of it.")
    if ups:
        errs = []
        st.session_state["doc_notes"] = []
        per_token = C.max_token_bytes(info) if info is not None else None
        lim = st.session_state.get("max_tokens")
        for f in ups:
            try:
                if per_token is not None and isinstance(lim, int) and lim >= 1:  # too large whatever it says:
                    D.check_size(f.name, f.size, lim, per_token)                 # not even decoded
                _add_doc(f.name, D.decode_upload(f.name, f.getvalue()), "uploaded")
            except GDNVizError as e:
                errs.append(str(e))
        st.session_state["upload_errors"] = errs
        st.session_state["upload_gen"] = st.session_state.get("upload_gen", 0) + 1
        st.rerun()
# below the tabs, not in the Upload tab: the rerun that makes a new uploader may show the first tab again
for e in st.session_state.get("upload_errors", []):
    C.show_error(e)
for note in st.session_state.get("doc_notes", []):
    st.info(note, icon=":material/info:")

c1, c2 = st.columns(2)
# no min_value: a browser keeps an out-of-range number in the field without a word; the checks below say why
c1.number_input("Segment length L (tokens)", step=64, key="segment_len",
                help="States are recorded (and truncated) every L tokens. Multiples of 64 keep fla's chunked "
                     "kernels split-invariant; seed 000 uses 256.")
c2.number_input("Token limit per document", step=1024, key="max_tokens",
                help="Longer documents are refused before anything runs (GPU memory grows with length)")
setting_errors = []
for check, key in ((check_segment_len, "segment_len"), (D.check_token_limit, "max_tokens")):
    try:
        check(st.session_state[key])
    except GDNVizError as e:
        setting_errors.append(str(e))
for e in setting_errors:
    C.show_error(e)

# the set, with token counts
doc_set = [dict(name=n, text=samples[n].text, source="sample") for n in st.session_state["sample_docs"]]
doc_set += [d for d in st.session_state["user_docs"] if d["name"] not in st.session_state["sample_docs"]]


tok = C.fast_tokenizer(info) if info is not None else None
limit = int(st.session_state["max_tokens"]) if not setting_errors else 0
rows, problems = [], []
for d in doc_set:
    n = C.token_count(info, tok, d["text"]) if tok is not None else None
    status = "ok"
    if n is not None and not setting_errors:
        try:
            D.check_length(d["name"], n, limit)
        except GDNVizError as e:
            status = "too long"
            problems.append(str(e))
    rows.append(dict(document=d["name"], source=d["source"], characters=len(d["text"]),
                     tokens=n, segments=None if n is None or setting_errors else
                     -(-n // int(st.session_state["segment_len"])),
                     status=status))
if rows:
    st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch",
                 column_config={"tokens": st.column_config.NumberColumn(format="%d"),
                                "characters": st.column_config.NumberColumn(format="%d")})
    removable = [d["name"] for d in st.session_state["user_docs"]]
    if removable:
        rc1, rc2 = st.columns([3, 1])
        rm = rc1.multiselect("Remove pasted / uploaded documents", removable, key="rm_docs",
                             label_visibility="collapsed", placeholder="Remove pasted / uploaded documents…")
        if rc2.button("Remove", key="rm_btn", disabled=not rm):
            st.session_state["user_docs"] = [d for d in st.session_state["user_docs"] if d["name"] not in rm]
            st.rerun()
    for p in problems:
        C.show_error(p)
else:
    st.info("The document set is empty: pick sample documents, paste text or upload .txt / .md files.")

# =============================================================================================================
# 3. capture
# =============================================================================================================
st.subheader("3 · Capture")
ready = info is not None and bool(doc_set) and not problems and not setting_errors
why = ("inspect a model first" if info is None else "add documents first" if not doc_set
       else "fix the documents above first" if problems else "fix the settings above first" if setting_errors
       else "")
if doc_set and not setting_errors:
    n_tok = None if any(r["tokens"] is None for r in rows) else sum(r["tokens"] for r in rows)
    st.caption(f"{len(doc_set)} document{'s' if len(doc_set) != 1 else ''}"
               + (f", **{n_tok:,} tokens** through the model" if n_tok is not None else "")
               + " (none for a document already captured with these settings): "
               + C.job_eta(info, "capture", n_tok, int(st.session_state["segment_len"])))
if st.button("Run capture", type="primary", key="run_capture", disabled=not ready, icon=":material/play_arrow:",
             help=why or "Capture every GDN head along each document"):
    from gdnviz.jobs import CaptureJob, spec_to_dict

    spec = CaptureJob(model=choice["model"], documents=tuple((d["name"], d["text"]) for d in doc_set),
                      segment_len=int(st.session_state["segment_len"]), device=choice["device"],
                      dtype=choice["dtype"], trust_remote_code=choice["trust_remote_code"], max_tokens=limit)
    st.session_state["capture_job"] = C.submit("capture", spec_to_dict(spec), label="capture")
    st.session_state.pop("capture_handled", None)
    st.rerun()  # redraw from the top: the sidebar's worker status and the Run button see the new job
if why:
    st.caption(f"To run a capture: {why}.")

rec = C.job_panel("capture_job", "Capture")
if rec is not None and rec["status"] == "done":
    res = rec["result"]  # app.py made its run the session's run (common.adopt_finished_capture)
    reused = f" ({res['reused']} reused from earlier runs)" if res.get("reused") else ""
    st.success(f"Captured {res['n_documents']} document(s), {sum(res['n_tokens']):,} tokens{reused}.",
               icon=":material/check_circle:")
    l1, l2, l3 = st.columns(3)
    with l1:
        C.page_link("heatmap", "Open the heatmap", icon=":material/grid_on:")
    with l2:
        C.page_link("overview", "Overview figures", icon=":material/scatter_plot:")
    with l3:
        C.page_link("truncate", "Truncate & compare", icon=":material/content_cut:")

# =============================================================================================================
# 4. previous runs
# =============================================================================================================
st.subheader("Previous runs")
runs, bad_runs = C.store().read_runs()
C.unreadable_runs_warning(bad_runs)
if not runs:
    st.caption("No runs yet. Every capture is stored on disk (cache directory "
               f"`{C.store().dir}`) and listed here.")
else:
    df = pd.DataFrame([dict(run=r["run_id"], when=pd.Timestamp.fromtimestamp(r["created"]).strftime("%Y-%m-%d %H:%M"),
                            model=Path(str(r.get("model_name"))).name, documents=len(r["documents"]),
                            tokens=sum(d["n_tokens"] for d in r["documents"]), L=r["segment_len"],
                            dtype=r["dtype"], device=r["device"], kernels=",".join(r.get("backends", [])))
                       for r in runs])
    st.dataframe(df, hide_index=True, width="stretch")
    oc1, oc2 = st.columns([3, 1])
    pick = oc1.selectbox("Open a previous run", [r["run_id"] for r in runs], key="open_run_pick",
                         format_func=lambda rid: C.run_label(next(r for r in runs if r["run_id"] == rid)),
                         label_visibility="collapsed")
    if oc2.button("Open", key="open_run_btn", icon=":material/folder_open:"):
        st.session_state["run_id"] = pick
        st.switch_page(C.PAGES["heatmap"])
