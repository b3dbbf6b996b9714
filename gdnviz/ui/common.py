"""Streamlit helpers shared by the pages: the store and worker singletons, session state, the current run, job
panels that poll, charts with PNG/SVG/CSV downloads, error and empty states, and the sidebar.

Session keys (``st.session_state``):

==================  ==========================================================================================
model_source        "demo" | "path" | "hf"  (widget, persisted across pages)
model_path          local checkpoint folder (widget)      model_hf: org/name in the HF cache (widget)
device, dtype       "auto" | ... (widgets)
trust_remote_code   the "Trust remote code" box (widget; off by default, unticked whenever another model is chosen,
                    never applied to the demo)
inspect             {"key": (model, device, dtype, trust_remote_code), "job": id, "result": dict | None,
                    "error": str | None, "error_type": str | None}
user_docs           [{"name", "text", "source"}] pasted / uploaded documents
sample_docs         names of bundled samples in the set (widget)
segment_len         tokens per segment (widget)          max_tokens: per-document token limit (widget)
capture_job         id of the capture job of this session (capture_handled: the one whose run was adopted)
run_id              the run shown on every page: this session's last capture or the run the user picked (None:
                    no run; a page never falls back to another session's run)
layer, head         the open head
head_panel          True while the pages with a chart of heads show the open head in a panel under it
                    (``gdnviz.ui.head_panel``; head_panel_url: the layer and head it last wrote to the URL;
                    head_panel_reveal: a click opened it in this run, so the page scrolls its numbers into view)
picked_heads        [[layer, head], ...] the truncation set built by clicks
truncate_job        id of the truncation job of this session
sweep_job           id of the sweep job of this session (the Sweeps page's widgets are ``sw_*``)
loss_job            id of the loss-vs-rank job of this session (the Loss vs rank page's widgets are ``ls_*``)
==================  ==========================================================================================
"""
from __future__ import annotations

import os
import re
import threading
import time
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import pandas as pd
import streamlit as st

from gdnviz import settings
from gdnviz.store import Store, TERMINAL, default_cache_dir
from gdnviz.ui.worker_client import WorkerHandle, make_handle

PAGES = {
    "documents": "pages/documents.py",
    "heatmap": "pages/heatmap.py",
    "head": "pages/head.py",
    "overview": "pages/overview.py",
    "truncate": "pages/truncate.py",
    "budget": "pages/budget.py",
    "sweeps": "pages/sweeps.py",
    "loss": "pages/loss.py",
    "scans": "pages/scans.py",
    "patching": "pages/patching.py",
    "compare": "pages/compare.py",
}
def _poll_seconds() -> float | None:
    """Seconds between polls of a running job (``$GDNVIZ_POLL_SECONDS``, default 0.5; 0 turns polling off, as the
    AppTest suite does: it reruns pages itself)."""
    v = settings.get("GDNVIZ_POLL_SECONDS")
    return v if v > 0 else None

#: seconds between polls of the sidebar's worker status while nothing runs
IDLE_POLL_SECONDS = 5.0
DEMO_DIR = Path(__file__).resolve().parent.parent / "assets" / "demo"
APP_PATH = Path(__file__).resolve().parent.parent.parent / "app.py"
#: Widget keys kept when the user moves between pages (Streamlit drops the state of widgets not drawn).
PERSISTED = ("model_source", "model_path", "model_hf", "device", "dtype", "trust_remote_code", "sample_docs", "segment_len",
             "max_tokens", "heat_metric", "click_action", "tr_prompt_mode", "tr_task", "tr_target_len", "tr_seed",
             "tr_max_new", "tr_prompt", "tr_loss_docs", "tr_chat", "bud_batch", "bud_state_dtype", "bud_kv_dtype",
             "bud_max_ctx", "head_doc", "head_tab", "holds_doc", "holds_pos", "holds_top", "am_doc", "am_start",
             "am_end", "am_attn_layer", "am_attn_head", "am_row", "am_keys", "cmp_a", "cmp_b", "cmp_metric",
             "cmp_sw_a", "cmp_sw_b", "sw_tasks", "sw_lengths", "sw_ranks", "sw_n", "sw_batch", "sw_seed0",
             "sw_max_new", "sw_chat", "sw_heads", "sw_layers", "sw_rank_maps", "ls_ranks", "ls_dist", "ls_heads",
             "ls_layers", "ls_rank_maps", "sc_task", "sc_length", "sc_n", "sc_r", "sc_by", "sc_keep", "sc_layers", "sc_limit",
             "sc_batch", "sc_seed0", "sc_max_new", "bg_max_new", "bg_tasks", "bg_lengths", "bg_n", "bg_tol", "bg_curve",
             "bg_ladder", "bg_limit", "pt_source", "pt_len", "pt_seed", "pt_a", "pt_b", "pt_heads", "pt_boundary",
             "pt_from", "pt_new", "pt_cont")


# =============================================================================================================
# singletons
# =============================================================================================================
@st.cache_resource(show_spinner=False)
def _store(cache_dir: str) -> Store:
    return Store(cache_dir)


def store() -> Store:
    return _store(str(default_cache_dir()))


@st.cache_resource(show_spinner=False)
def _handle(cache_dir: str) -> WorkerHandle:
    return make_handle(_store(cache_dir))


def ensure_worker() -> WorkerHandle:
    """The worker of this Streamlit server (started on first use, restarted when it died)."""
    h = _handle(str(default_cache_dir()))
    h.check()
    return h


def submit(kind: str, spec: dict, label: str = "") -> str:
    ensure_worker()
    return store().submit(kind, spec, label=label)


_TLS = threading.local()


def entrypoint_running(flag: bool) -> None:
    """app.py marks the span of ``pg.run()`` so that pages can tell they were run through it."""
    _TLS.in_app = flag


def ensure_entrypoint() -> None:
    """First line of every page.

    Streamlit runs ``pages/*.py`` directly (its legacy multipage mode, because the folder is called ``pages``)
    until some session has called ``st.navigation``: the first session of a fresh server that opens a deep link
    such as ``/head?layer=3&head=5`` would get the bare page without app.py (and AppTest resets that mode before
    every run). Here the page notices it was not started by app.py and runs app.py in its place: app.py's
    ``st.navigation`` call switches the server to that mode for every session (Streamlit's documented behaviour)
    and opens the same page with the same query parameters, in the same run, so no click is lost; then it stops.
    """
    if getattr(_TLS, "in_app", False):
        return
    import runpy

    runpy.run_path(str(APP_PATH), run_name="__main__")
    st.stop()


#: Widget keys made per group on Truncate & compare (``tr_g<id>_<field>``), kept like ``PERSISTED`` (not its buttons).
PERSISTED_GROUP_KEY = re.compile(r"tr_g\d+_(mode|r|heads|list|layers|filter|lo|hi)")
#: Widget keys made per model on Cache budget (``bud_<field>_<fingerprint>``), kept like ``PERSISTED``.
PERSISTED_MODEL_KEY = re.compile(r"bud_(ngdn|hv|hk|dk|dv|nattn|hkv|dh)_.+")
#: Every pattern of persisted widget keys made at run time (``persist_widgets`` keeps each key one matches whole).
PERSISTED_PATTERNS = (PERSISTED_GROUP_KEY, PERSISTED_MODEL_KEY)


def persist_widgets() -> None:
    """Re-assign persisted widget keys (``PERSISTED`` and the keys ``PERSISTED_PATTERNS`` match) so their values
    survive page switches (call before ``pg.run()``)."""
    for k in PERSISTED:
        if k in st.session_state:
            st.session_state[k] = st.session_state[k]
    for k in [k for k in st.session_state if isinstance(k, str) and any(p.fullmatch(k) for p in PERSISTED_PATTERNS)]:
        st.session_state[k] = st.session_state[k]


# =============================================================================================================
# model choice
# =============================================================================================================
def default_model() -> str:
    """``$GDNVIZ_DEFAULT_MODEL`` (a local folder, an org/name in the HF cache, or "demo"), else "demo"."""
    return settings.get("GDNVIZ_DEFAULT_MODEL")


def demo_installed() -> bool:
    return (DEMO_DIR / "config.json").exists()


def init_model_state() -> None:
    if "model_source" in st.session_state:
        return
    d = default_model()
    if d == "demo":
        st.session_state["model_source"] = "demo"
    elif Path(os.path.expanduser(d)).exists() or d.startswith((".", "/", "~")):
        st.session_state["model_source"] = "path"
        st.session_state["model_path"] = d
    else:
        st.session_state["model_source"] = "hf"
        st.session_state["model_hf"] = d
    st.session_state.setdefault("device", "auto")
    st.session_state.setdefault("dtype", "auto")
    st.session_state.setdefault("trust_remote_code", False)


def model_choice() -> dict:
    """{"model", "device", "dtype", "trust_remote_code"} as chosen on the Model & documents page (or the defaults;
    the bundled demo is never trusted: it has no code of its own)."""
    init_model_state()
    src = st.session_state.get("model_source", "demo")
    if src == "path":
        model = (st.session_state.get("model_path") or "").strip()
    elif src == "hf":
        model = (st.session_state.get("model_hf") or "").strip()
    else:
        model = "demo"
    return dict(model=model, device=st.session_state.get("device", "auto"),
                dtype=st.session_state.get("dtype", "auto"),
                trust_remote_code=src != "demo" and st.session_state.get("trust_remote_code") is True)


def untrust() -> None:
    """Untick "Trust remote code" (the on_change of every model input: a tick trusts only the model it was given
    for)."""
    st.session_state["trust_remote_code"] = False


def _choice_key(ch: dict) -> tuple:
    return ch["model"], ch["device"], ch["dtype"], ch["trust_remote_code"]


def inspected() -> dict | None:
    """The inspection result of the current model choice, if it has finished successfully."""
    ins = st.session_state.get("inspect")
    ch = model_choice()
    if ins and tuple(ins.get("key", ())) == _choice_key(ch):
        return ins.get("result")
    return None


def request_inspection() -> dict:
    """Submit (once per model choice) and poll the inspection of the chosen model; returns the session entry."""
    ch = model_choice()
    key = _choice_key(ch)
    ins = st.session_state.get("inspect")
    if not ch["model"]:
        return {}
    if not ins or tuple(ins.get("key", ())) != key:
        from gdnviz.jobs import InspectModelJob, spec_to_dict

        jid = submit("inspect", spec_to_dict(InspectModelJob(**ch)), label=f"inspect {ch['model']}")
        ins = dict(key=key, job=jid, result=None, error=None, error_type=None)
        st.session_state["inspect"] = ins
    if ins.get("result") is None and ins.get("error") is None:
        rec = store().job(ins["job"])
        if rec is not None and rec["status"] == "done":
            ins["result"] = rec["result"]
        elif rec is not None and rec["status"] in TERMINAL:
            ins["error"] = rec.get("error") or rec["status"]
            ins["error_type"] = rec.get("error_type")
    return ins


def inspection_next_step(ins: dict) -> str:
    """What to do after the inspection failed with ``ins['error']``."""
    if ins.get("error_type") == "NeedsRemoteCode":  # the message says to tick the box
        return "Or pick another model."
    return ("Pick another model: a folder with config.json + *.safetensors of a Qwen3.5, Qwen3.5-MoE, Qwen3-Next "
            "or fla GatedDeltaNet checkpoint.")


def require_inspected_model(what: str) -> dict | None:
    """The inspection result of the chosen model, requesting it when this session has none yet (a deep link into
    a page): None after drawing what happens instead (the empty state when no model is chosen or the demo is not
    installed, the inspection's progress, or why the model cannot be used)."""
    info = inspected()
    if info is not None:
        return info
    ch = model_choice()
    if not ch["model"] or (ch["model"] == "demo" and not demo_installed()):
        empty_state("No model yet.", f"Pick a model on the **Model & documents** page; {what}")
        return None
    ins = request_inspection()
    if ins.get("error"):
        show_error(f"Cannot use **{ch['model']}**: {ins['error']}", inspection_next_step(ins))
        page_link("documents", "Go to Model & documents", icon=":material/arrow_forward:")
        return None
    if ins.get("result") is not None:
        return ins["result"]
    st.session_state["_inspect_job"] = ins["job"]
    job_panel("_inspect_job", f"Inspecting {Path(ch['model']).name or ch['model']}")
    return None


@st.cache_resource(show_spinner=False, max_entries=4)
def _fast_tokenizer(path: str, mtime: float):
    from gdnviz.documents import load_fast_tokenizer

    return load_fast_tokenizer(path)


def fast_tokenizer(info: dict | None):
    """The model's tokenizer.json as a ``tokenizers.Tokenizer`` (token counts in the app), or None."""
    path = (info or {}).get("path")
    if not path:
        return None
    p = Path(path) / "tokenizer.json"
    return _fast_tokenizer(str(path), p.stat().st_mtime) if p.exists() else None


@st.cache_resource(show_spinner=False, max_entries=2)
def _hf_tokenizer(path: str, mtime: float):
    from gdnviz.models.loader import load_tokenizer_for

    return load_tokenizer_for(Path(path))


@st.cache_resource(show_spinner=False, max_entries=4)
def _max_token_bytes(path: str, mtime: float) -> int:
    from gdnviz.documents import max_token_bytes

    return max_token_bytes(_fast_tokenizer(path, mtime))


def max_token_bytes(info: dict | None) -> int | None:
    """``documents.max_token_bytes`` of the model's tokenizer.json (cached), or None without one."""
    path = (info or {}).get("path")
    p = Path(path) / "tokenizer.json" if path else None
    return _max_token_bytes(str(path), p.stat().st_mtime) if p is not None and p.exists() else None


def token_count(info: dict | None, tok, text: str) -> int:
    """len(``documents.tokenize``) of ``text``, computed once per (tokenizer, text) in this session: a rerun does
    not tokenise a 45 MB upload again."""
    import hashlib

    from gdnviz.documents import tokenize

    cache = st.session_state.setdefault("_token_counts", {})
    key = ((info or {}).get("path"), (info or {}).get("fingerprint"),
           hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest())
    if key not in cache:
        cache[key] = len(tokenize(tok, text))
    return cache[key]


def _tokenizer_key(info: dict | None) -> tuple[str, float] | None:
    """(checkpoint folder, newest tokenizer file mtime) or None when the model has no folder."""
    path = (info or {}).get("path")
    if not path or not Path(path).exists():
        return None
    files = [Path(path) / n for n in ("tokenizer.json", "tokenizer_config.json")]
    return str(path), max((p.stat().st_mtime for p in files if p.exists()), default=0.0)


def hf_tokenizer(info: dict | None):
    """The model's transformers tokenizer (chat template included; what the worker builds RULER prompts with),
    or None when the checkpoint has none."""
    key = _tokenizer_key(info)
    return None if key is None else _hf_tokenizer(*key)


@st.cache_data(show_spinner=False, max_entries=256)
def _task_minimum(path: str, mtime: float, task: str, seed0: int, chat) -> int:
    from gdnviz.ui.sweeps import task_minimum as minimum

    return minimum(task, _hf_tokenizer(path, mtime), seed0, chat)


def task_minimum(task: str, tokenizer, seed0: int, chat, *, info: dict) -> int:
    """``gdnviz.ui.sweeps.task_minimum`` cached per (model tokenizer, task, seed, chat template)."""
    key = _tokenizer_key(info)
    if key is None:
        from gdnviz.ui.sweeps import task_minimum as minimum

        return minimum(task, tokenizer, seed0, chat)
    return _task_minimum(*key, task, int(seed0), chat)


@st.cache_data(show_spinner=False, max_entries=256)
def _seed_minima(path: str, mtime: float, task: str, seed0: int, n: int, target_class: int, chat,
                 budget: int) -> dict | None:
    from gdnviz.ui.sweeps import seed_minima as minima

    return minima(task, _hf_tokenizer(path, mtime), seed0, n, target_class, chat, budget)


def seed_minima(task: str, tokenizer, seed0: int, n: int, target_class: int, chat, *, info: dict,
                n_tasks: int) -> dict | None:
    """``gdnviz.ui.sweeps.seed_minima`` cached per (model tokenizer, task, seeds, target class, chat template);
    the smallest prompts it builds for one task stay within ``PREVIEW_TOKENS / n_tasks`` tokens."""
    from gdnviz.ui.sweeps import seed_minima as minima

    budget = PREVIEW_TOKENS // max(1, int(n_tasks))
    key = _tokenizer_key(info)
    if key is None:
        return minima(task, tokenizer, seed0, n, target_class, chat, budget)
    return _seed_minima(*key, task, int(seed0), int(n), int(target_class), chat, budget)


def token_limit() -> int:
    """The session's per-document token limit (the Model & documents page's field, else ``GDNVIZ_MAX_TOKENS``): the
    longest document, sweep, scan or budget length the pages accept."""
    from gdnviz.documents import max_tokens_default

    return int(st.session_state.get("max_tokens") or max_tokens_default())


# prompts a sweep preview builds on the page, in tokens (tasks × lengths × n, summed target lengths): a RULER prompt
# costs ~10 µs per token to build on this project's 2-core CPU (2026-12-03), so ~4 s; beyond it the page says how
# many answers the job needs without reading the memo (the job itself builds and checks every prompt first)
PREVIEW_TOKENS = 400_000


def preview_tokens(spec) -> int:
    """The tokens of prompts a sweep preview of ``spec`` would build (each sample counted at its target length)."""
    return int(spec.n) * len(spec.tasks) * sum(int(x) for x in spec.lengths)


@st.cache_data(show_spinner=False, max_entries=32)
def _sweep_samples(path: str, mtime: float, tasks: tuple, lengths: tuple, n: int, seed0: int, chat,
                   chat_kwargs: tuple) -> dict:
    from gdnviz.probes.sweep import SweepSpec, samples_for

    spec = SweepSpec(model="", tasks=tasks, lengths=lengths, n=n, seed0=seed0, chat_template=chat,
                     chat_template_kwargs=chat_kwargs)
    return samples_for(_hf_tokenizer(path, mtime), spec)


def sweep_samples(info: dict):
    """A callable of a ``SweepSpec`` returning ``sweep.samples_for``'s prompts on the model ``info``'s tokenizer,
    built once per (tokenizer files, tasks, lengths, n, seed0, chat template): a changed form gets new prompts;
    the memo's share is not part of it. ValueError when the model has no tokenizer."""
    key = _tokenizer_key(info)
    if key is None:
        raise ValueError(f"{info.get('path') or info.get('name')} has no tokenizer files beside its weights")

    def samples(spec) -> dict:
        return _sweep_samples(*key, tuple(spec.tasks), tuple(int(x) for x in spec.lengths), int(spec.n),
                              int(spec.seed0), spec.chat_template, tuple(spec.chat_template_kwargs))

    return samples


def sweep_planner(info: dict, budget: int = PREVIEW_TOKENS):
    """A callable of a ``SweepSpec`` returning ``gdnviz.probes.sweep.plan_from_keys``'s dict for it on the model
    ``info`` with the app's memo (the answers it needs, how many the memo holds, the time at the measured rates),
    for one page run: the specs it is called with build their prompts while their ``preview_tokens`` summed stay
    within ``budget``; a spec past it builds none (``sweep.plan_unbuilt``: the counts without the memo's share,
    its cells' cached None; the job builds and checks every prompt before any model call). Prompts are built once
    per (tokenizer, tasks, lengths, n, seed0, chat template), so other ranks or heads cost only their keys; the
    memo is read on every call. Raises what the sweep raises for bad input; ValueError when the model has no
    tokenizer."""
    from gdnviz.jobs import MemoMapping
    from gdnviz.probes.sweep import check_spec, keys_of, plan_from_keys, plan_unbuilt

    samples = sweep_samples(info)
    ns = info_ns(info)
    left = [int(budget)]

    def plan(spec) -> dict:
        check_spec(spec, ns)  # bad settings raise before any prompt is built
        need = preview_tokens(spec)
        if need > left[0]:
            return plan_unbuilt(ns, spec, MemoMapping(store()))
        left[0] -= need
        return plan_from_keys(ns, keys_of(ns, samples(spec), spec), spec.segment_len, MemoMapping(store()),
                              batch_size=spec.batch_size)

    return plan


def sweep_plan(info: dict, spec) -> dict:
    """``sweep_planner(info)(spec)``: one sweep's preview, its prompts built up to ``PREVIEW_TOKENS``."""
    return sweep_planner(info)(spec)


def job_eta(info: dict | None, job: str, tokens, segment_len: int) -> str:
    """``gdnviz.probes.rates.job_eta_text`` for ``tokens`` (an int, or {part: tokens}: ``rates.JOBS``) of ``job`` at
    ``segment_len`` on the model ``info`` (an inspection's or a run's dict) at the rates in the app's memo; None
    info (no model inspected yet) or tokens: no estimate, and it says why."""
    from gdnviz.jobs import MemoMapping
    from gdnviz.probes import rates

    if info is None or not info.get("fingerprint"):
        return "no estimate yet (the model is not inspected yet)"
    if tokens is None:
        return "no estimate yet (the token count is not known here: the worker counts the tokens)"
    return rates.job_eta_text(rates.estimate_job(MemoMapping(store()), info_ns(info), job, tokens, segment_len))


def seed_checks(tasks, lengths, tokenizer, seed0: int, n: int, chat, *, info: dict) -> list[str]:
    """The messages of ``gdnviz.ui.sweeps.length_errors`` for the samples of seeds ``seed0 .. seed0 + n - 1`` of
    ``tasks`` at ``lengths``, with the cached minima (``task_minimum``, ``seed_minima``: their smallest prompts stay
    within ``PREVIEW_TOKENS``); ``seed_check_note`` (the seeds left to the job) is shown here as a caption. Called
    before a preview builds any prompt."""
    from gdnviz.ui.sweeps import length_errors, seed_check_note

    def minima(task, target_class):
        return seed_minima(task, tokenizer, seed0, n, target_class, chat, info=info, n_tasks=len(tasks))

    with st.spinner("Checking the lengths against every sample's smallest prompt…"):
        errs = length_errors(tasks, lengths, tokenizer, seed0, chat,
                             minimum=lambda t, k, s, c: task_minimum(t, k, s, c, info=info), minima=minima)
        note = seed_check_note(tasks, lengths, seed0, n, minima)
    if note:
        st.caption(note)
    return errs


def info_ns(info: dict) -> SimpleNamespace:
    """A ModelInfo-like object (gdn_layers, num_heads, d_k, d_v) from an info dict, for validation."""
    return SimpleNamespace(**{**info, "gdn_layers": tuple(info["gdn_layers"])})


# =============================================================================================================
# runs
# =============================================================================================================
def run_label(run: dict) -> str:
    when = datetime.fromtimestamp(run.get("created", 0)).strftime("%Y-%m-%d %H:%M")
    docs = run.get("documents", [])
    ntok = sum(d.get("n_tokens", 0) for d in docs)
    model = Path(str(run.get("model_name", "?"))).name or run.get("model_name", "?")
    return (f"{when} · {model} · {len(docs)} doc{'s' if len(docs) != 1 else ''} · {ntok:,} tokens · "
            f"L={run.get('segment_len')} · {run.get('dtype')}/{run.get('device')}")


def adopt_finished_capture() -> None:
    """Make this session's finished capture its current run, once per capture job. app.py calls it before the
    sidebar and the page, so that nothing drawn in the run that sees the job done shows another run."""
    jid = st.session_state.get("capture_job")
    if not jid or st.session_state.get("capture_handled") == jid:
        return
    rec = store().job(jid)
    if rec is not None and rec["status"] == "done":
        st.session_state["run_id"] = rec["result"]["run_id"]
        st.session_state["capture_handled"] = jid


def current_run() -> dict | None:
    """The run of this session (its last capture, or the one the user picked), else None. Never another session's
    run that the user did not pick: the store is shared by every browser session of the server. A run that was
    deleted from the store or cannot be read is None, after an error saying so."""
    from gdnviz.errors import CorruptStoreEntry

    rid = st.session_state.get("run_id")
    if not rid:
        return None
    try:
        run = store().run(rid)
    except CorruptStoreEntry as e:
        show_error(f"This session's run cannot be opened: {e}.", "Pick another run in the sidebar under *Previous "
                   "runs*, or run the capture again on the Model & documents page (it replaces the damaged entry).")
        return None
    if run is None:
        show_error(f"This session's run {rid} is no longer in the store (its entry was deleted from the cache "
                   f"directory {store().dir}).", "Pick another run in the sidebar, or run the capture again.")
    return run


def unreadable_runs_warning(bad: list[tuple[str, str]]) -> None:
    """Say which stored runs cannot be read (they are not listed)."""
    if not bad:
        return
    n = len(bad)
    st.warning(f"{n} stored run{'s' if n != 1 else ''} cannot be read and {'is' if n == 1 else 'are'} not listed: "
               + "; ".join(f"`{rid}` ({why})" for rid, why in bad[:3]) + (" …" if n > 3 else ""),
               icon=":material/warning:")


def no_run_text() -> tuple[str, str]:
    """(title, text) of the empty state of a page that needs a run."""
    n = len(store().list_runs())
    if not n:
        return "No capture yet.", ("Pick a model and documents and run a capture on the **Model & documents** page; "
                                   "its results appear here.")
    which = "the stored run" if n == 1 else f"one of the {n} stored runs"
    return "No run chosen in this session.", (
        f"Run a capture on the **Model & documents** page, or open {which} in the sidebar under *Previous runs*.")


@st.cache_resource(show_spinner=False, max_entries=4)
def _load_captures(cache_dir: str, run_id: str, keys: tuple):
    from gdnviz.jobs import load_run_captures

    return load_run_captures(_store(cache_dir), _store(cache_dir).run(run_id))


def run_captures(run: dict):
    """The run's CaptureResults, or None after showing what happens instead: a missing or corrupt stored result
    is deleted and recomputed by the worker (never shown), with a progress panel."""
    from gdnviz.jobs import MissingResult

    keys = tuple(d["key"] for d in run["documents"])
    try:
        return _load_captures(str(store().dir), run["run_id"], keys)
    except MissingResult as e:
        st.warning(f"{e}: it was discarded and is being recomputed from the run's settings. The page fills in "
                   "when the worker is done.")
        rk = f"recompute:{run['run_id']}"
        jid = st.session_state.get(rk)
        rec = store().job(jid) if jid else None
        if rec is None:
            st.session_state[rk] = submit("capture", run["spec"], label="recompute capture")
        elif rec["status"] in ("failed", "cancelled"):
            st.button("Try the recomputation again", key=f"{rk}_retry", on_click=st.session_state.pop, args=(rk,))
        elif rec["status"] == "done":
            show_error("The capture was recomputed but still cannot be read by this version of gdnviz.",
                       f"Run the capture again on the Model & documents page; details in {store().log_path}.")
        job_panel(rk, "Recomputing the capture")
        return None


@st.cache_data(show_spinner=False, max_entries=8)
def _run_table(cache_dir: str, run_id: str, keys: tuple) -> pd.DataFrame:
    from gdnviz.summary import document_set_table

    return document_set_table(_load_captures(cache_dir, run_id, keys))


@st.cache_data(show_spinner=False, max_entries=8)
def _run_overview(cache_dir: str, run_id: str, keys: tuple, segment_len: int) -> dict:
    from gdnviz.summary import overview

    return overview(_run_table(cache_dir, run_id, keys), segment_len)


def run_overview(run: dict) -> dict:
    """``summary.overview`` of the run's head table (memoised: its bootstrap interval takes a few hundred ms)."""
    return _run_overview(str(store().dir), run["run_id"], tuple(d["key"] for d in run["documents"]),
                         int(run["segment_len"]))


def run_model(run: dict) -> tuple:
    """What a page that runs the model of ``run`` needs: (info, model name, device, dtype, segment length L, head
    table or None, a phrase naming the model for the page, trust_remote_code as the run was captured)."""
    spec = run["spec"]
    name = run["model_name"]
    return (run["model"], name, spec.get("device", "auto"), spec.get("dtype", "auto"), int(run["segment_len"]),
            run_table(run), f"the model of the current run ({Path(str(name)).name})",
            spec.get("trust_remote_code") is True)


def inspected_model(info: dict) -> tuple:
    """The same tuple as ``run_model`` for the model inspected on the first page (no run yet: no head table), with
    the segment length set there; when that is not a positive integer, an error says so and the page stops."""
    from gdnviz.errors import BadSegmentLength
    from gdnviz.runner import check_segment_len

    ch = model_choice()
    name = ch["model"]
    try:
        L = check_segment_len(st.session_state.get("segment_len", 256))
    except BadSegmentLength as e:
        show_error(f"The {e} (set on the Model & documents page).", "Set a positive segment length there.")
        page_link("documents", "Go to Model & documents", icon=":material/arrow_forward:")
        st.stop()
    return (info, name, ch["device"], ch["dtype"], L, None,
            f"the inspected model ({Path(str(name)).name})", ch["trust_remote_code"])


class PageModel(NamedTuple):
    """The model a page runs jobs on: ``run`` (the current run, or None), then ``run_model``'s tuple."""
    run: dict | None
    info: dict
    name: str
    device: str
    dtype: str
    L: int
    table: pd.DataFrame | None
    src: str
    trust_remote_code: bool


def page_model(purpose: str) -> PageModel:
    """The current run's model, else the model inspected on Model & documents (requested here on a deep link).
    With neither, the page shows the empty state "No model yet. Pick a model on the Model & documents page;
    ``purpose``" (or the inspection's progress, or why the model cannot be used) and stops."""
    run = current_run()
    if run is not None:
        return PageModel(run, *run_model(run))
    info = require_inspected_model(purpose)
    if info is None:
        st.stop()
    return PageModel(None, *inspected_model(info))


def run_table(run: dict) -> pd.DataFrame | None:
    """Median / min / max per head over the run's documents (``summary.document_set_table``)."""
    caps = run_captures(run)
    if caps is None:
        return None
    return _run_table(str(store().dir), run["run_id"], tuple(d["key"] for d in run["documents"]))


def require_run() -> tuple[dict, pd.DataFrame] | None:
    """The current run and its head table, or None after drawing the empty state."""
    run = current_run()
    if run is None:
        empty_state(*no_run_text())
        return None
    table = run_table(run)
    if table is None:
        return None
    return run, table


# =============================================================================================================
# heads
# =============================================================================================================
def head_label(layer: int, head: int) -> str:
    return f"L{int(layer)}·H{int(head)}"


#: The charts of heads whose click opens (or picks) a head, per page (``PAGES`` key): (the chart's session key, its
#: selection param, whether the page offers pick mode, the "Clicking a head" choice). A click that opens a head shows
#: it in the head panel under the chart, in the same script run (``gdnviz.ui.head_panel``). app.py handles these
#: clicks (``handle_head_click``) before it draws anything else.
HEAD_CLICKS = {"heatmap": ("heat", "cell", True), "overview": ("ov_evh", "head", True),
               "scans": ("sc_heat", "cell", False)}


def handle_head_click(page: str) -> None:
    """``click_opens_or_picks`` for the chart of heads of ``page`` (``HEAD_CLICKS``; other pages: nothing). Called
    before the sidebar and the page, so that the page draws the click's head panel (or pick) in this run."""
    if page in HEAD_CLICKS:
        click_opens_or_picks(*HEAD_CLICKS[page])


def click_opens_or_picks(state_key: str, param: str, picks: bool) -> None:
    """Handle a click on a chart of heads (selection param ``param`` with fields layer, head, drawn under the key
    ``state_key``) before the page draws anything: in pick mode ("click_action" = "pick", on a page that offers it:
    ``picks``) the head is added to / removed from the truncation set; otherwise the head becomes the open head
    ("layer", "head") and the head panel is opened ("head_panel"). A selection is handled once (it stays the chart's
    value until another click)."""
    cell = parse_cell(st.session_state.get(state_key), param)
    handled = f"{state_key}_handled"
    if cell is None:
        st.session_state.pop(handled, None)
        return
    if st.session_state.get(handled) == cell:
        return
    st.session_state[handled] = cell
    layer, head = cell
    if picks and st.session_state.get("click_action") == "pick":
        toggle_pick(layer, head)
        return
    st.session_state["layer"], st.session_state["head"] = layer, head
    st.session_state["head_panel"] = True
    st.session_state["head_panel_reveal"] = True


def click_action_radio(opens: str) -> None:
    """The "Clicking a head" choice (session key "click_action", shared by the Heatmap and Overview); ``opens``:
    what the choice "open" does on this page, in words."""
    st.session_state.setdefault("click_action", "open")
    st.radio("Clicking a head", ["open", "pick"], key="click_action", horizontal=True,
             format_func={"open": opens, "pick": "adds / removes it in the truncation set"}.get)


def parse_head_label(s: str) -> tuple[int, int]:
    a, b = s.replace("L", "").split("·H")
    return int(a), int(b)


def picked_heads() -> list:
    return [tuple(x) for x in st.session_state.get("picked_heads", [])]


def toggle_pick(layer: int, head: int) -> None:
    cur = picked_heads()
    lh = (int(layer), int(head))
    cur = [x for x in cur if x != lh] if lh in cur else cur + [lh]
    st.session_state["picked_heads"] = [list(x) for x in sorted(cur)]


def parse_cell(state, param: str = "cell") -> tuple[int, int] | None:
    """(layer, head) of the clicked heatmap cell (or point of selection param ``param``) from a chart's selection
    state (a dict in AppTest)."""
    if not state:
        return None
    try:
        sel = state["selection"]
    except (KeyError, TypeError):
        return None
    pts = sel.get(param) if hasattr(sel, "get") else None
    if not pts:
        return None
    p = pts[0] if isinstance(pts, (list, tuple)) else pts
    try:
        return int(p["layer"]), int(p["head"])
    except (KeyError, TypeError, ValueError):
        return None


# =============================================================================================================
# rendering
# =============================================================================================================
def page_link(page: str, label: str, icon: str | None = None, query_params: dict | None = None) -> None:
    kw = {"query_params": query_params} if query_params else {}
    st.page_link(PAGES[page], label=label, icon=icon, **kw)


def empty_state(title: str, text: str) -> None:
    st.info(f"**{title}** {text}", icon=":material/info:")
    page_link("documents", "Go to Model & documents", icon=":material/arrow_forward:")


def show_error(message: str, what_next: str | None = None) -> None:
    st.error(message + (f"\n\n{what_next}" if what_next else ""), icon=":material/error:")


def chart(ch, df: pd.DataFrame | bytes | None, name: str, key: str, *, on_select=None, selection_mode=None,
          downloads: bool = True, fixed_size: bool = False, export=None):
    """Draw a chart (an Altair chart, or its ``specs.spec`` dict) with PNG / SVG / CSV download buttons under it;
    ``df``: the chart's data for the CSV (a frame, or its CSV bytes). Returns the selection event. The downloads are
    ``export`` (the figure without on-screen hints, e.g. ``heatmap(..., interactive=False)``, or a function that builds
    it when a download is clicked) or else ``ch``, at the
    sidebar's export size and scale (``gdnviz.ui.export``); the PNG, SVG and CSV are made only when their button is
    clicked."""
    from gdnviz import figures
    from gdnviz.ui import specs
    from gdnviz.ui.export import export_kwargs

    spec = specs.spec(ch)
    kw = {}
    if on_select is not None:
        kw = dict(on_select=on_select, selection_mode=selection_mode)
    # theme=None and the chart's own size: what is on screen is exactly what the PNG / SVG downloads contain
    if fixed_size:  # grids and facets keep their own size (cells of a fixed step)
        kw["width"] = "content"
    ev = st.vega_lite_chart(spec=specs.for_page(spec), key=key, theme=None, **kw)
    if downloads:
        def out():
            return spec if export is None else specs.spec(export() if callable(export) else export)

        ex = export_kwargs()
        size = dict(width=ex["width"], height=ex["height"])
        with st.container(horizontal=True, gap="small"):
            st.download_button("PNG", data=lambda: figures.to_png(out(), ex["scale"], **size), file_name=f"{name}.png",
                               mime="image/png", on_click="ignore", key=f"{key}_png", icon=":material/image:")
            st.download_button("SVG", data=lambda: figures.to_svg(out(), **size), file_name=f"{name}.svg",
                               mime="image/svg+xml", on_click="ignore", key=f"{key}_svg", icon=":material/draw:")
            if df is not None:
                csv = df if isinstance(df, bytes) else None
                st.download_button("CSV", data=(lambda: csv) if csv is not None else (lambda: figures.to_csv(df)),
                                   file_name=f"{name}.csv", mime="text/csv", on_click="ignore", key=f"{key}_csv",
                                   icon=":material/table:")
    return ev


def settings_differ(shown: dict, form: dict | None, labels: dict[str, str]) -> list[str]:
    """Labels of the job settings (the fields named in ``labels``) in which the spec of a shown result differs from
    the spec the page's form would submit now (``form``; None: the form cannot build one, so nothing is said)."""
    if form is None:
        return []
    import json

    def norm(v):
        return json.loads(json.dumps(v, default=str))

    return [lab for k, lab in labels.items() if norm(shown.get(k)) != norm(form.get(k))]


def stale_result_note(differ: list[str], what: str) -> None:
    """Say that the result shown below was run with other settings than the form's (``differ``: their labels)."""
    if differ:
        st.warning(f"The {what} below was run with other settings than the form shows now ({', '.join(differ)} "
                   "changed): it is not the result of these settings. Run it again to get theirs.",
                   icon=":material/history:")


def computed_when(rec: dict, submitted) -> str:
    """When a shown job's result was computed: "now" for a job this session submitted (``submitted``: their ids),
    else "when it ran (YYYY-MM-DD HH:MM)" from the job record's ``finished`` time (a result reopened from the
    store)."""
    from datetime import datetime

    if rec["id"] in submitted:
        return "now"
    return "when it ran" + (f" ({datetime.fromtimestamp(rec['finished']).strftime('%Y-%m-%d %H:%M')})"
                            if rec.get("finished") else "")


def _fmt_secs(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


STOPPED_ERRORS = ("WorkerCrashed", "WorkerStopped", "GPUOutOfMemory")


def job_panel(session_key: str, title: str, resume: str | None = None) -> dict | None:
    """Progress of the session's job under ``session_key``: a progress bar and a cancel button while it runs,
    polling with a fragment; the failure message when it failed. ``resume`` (e.g. "answers"): what a job stores as
    it goes; a cancelled, crashed or out-of-memory job then says that those are kept and how to resume. Returns the
    job record."""
    jid = st.session_state.get(session_key)
    if not jid:
        return None
    s = store()
    rec = s.job(jid)
    if rec is None:
        return None
    active = rec["status"] in ("queued", "running")

    def body():
        h = ensure_worker()
        r = s.job(jid)
        if r is None:
            return
        status = r["status"]
        if status in ("queued", "running"):
            prog = r.get("progress") or {}
            frac = float(prog.get("fraction", 0.0))
            ws = h.status()
            if not prog:
                frac = 0.0
            if status == "queued":
                wait = {"starting": "the worker is starting (loading PyTorch; the first start takes a while)",
                        "busy": "the worker is busy with another job", "disabled": "no worker is running "
                        "(GDNVIZ_NO_WORKER is set)", "not responding": "the worker is not responding",
                        "stopped": "the worker is not running"}.get(ws["state"], "waiting for the worker")
                text = f"{title}: queued — {wait}"
            else:
                el = time.time() - (r.get("started") or time.time())
                text = (f"{title}: {prog.get('text')} · {int(100 * frac)}% · {_fmt_secs(el)}" if prog
                        else f"{title}: running · {_fmt_secs(el)}")
            st.progress(frac, text=text)
            st.button("Cancel", key=f"{session_key}_cancel", on_click=s.cancel, args=(jid,),
                      icon=":material/cancel:", disabled=r.get("cancel_requested", False))
            if r.get("cancel_requested"):
                st.caption("Cancelling at the next step; a step that takes longer than a few seconds is stopped by "
                           "restarting the worker (what finished stays stored)…")
        elif active:  # it just finished while we were polling: redraw the whole page with the result
            st.rerun()
        elif status == "failed":
            show_error(f"{title} failed: {r.get('error')}")
        elif status == "cancelled":
            st.info(f"{title} was cancelled" + (f": {r['error']}" if r.get("error") and
                                                 r["error"] != "cancelled by the user" else "."),
                    icon=":material/cancel:")

    st.fragment(body, run_every=_poll_seconds() if active else None)()
    rec = s.job(jid)
    if resume and rec is not None and (rec["status"] == "cancelled" or rec.get("error_type") in STOPPED_ERRORS):
        st.caption(f"The {resume} finished before it stopped are stored: run it again with the same settings to "
                   "resume from there.")
    return rec


def worker_status_line() -> None:
    h = ensure_worker()
    ws = h.status()
    state = ws["state"]
    color = {"idle": "green", "busy": "orange", "starting": "gray", "disabled": "gray", "not responding": "red",
             "stopped": "red"}.get(state, "gray")
    line = f":{color}[●] **Worker** {state}"
    if ws.get("pid"):
        line += f" · pid {ws['pid']}"
    st.markdown(line)
    m = ws.get("model")
    bits = []
    if state == "busy" and ws.get("detail"):
        bits.append(ws["detail"])
    if m:
        bits.append(f"model {Path(str(m.get('name'))).name} ({m.get('device')}, {m.get('dtype')}, "
                    f"{m.get('kernel_path')} kernels)")
        wu = m.get("warm_up") or {}
        if wu.get("error"):
            bits.append(f"kernel warm-up failed ({wu['error'][:120]})")
        elif wu:
            bits.append(f"kernels compiled and tuned at load in {sum(wu.values()):.1f} s")
    if ws.get("queued"):
        bits.append(f"{ws['queued']} queued")
    if ws.get("restarts"):
        bits.append(f"restarted {ws['restarts']}× (last: {ws.get('last_exit')})")
    if state == "disabled":
        bits.append("GDNVIZ_NO_WORKER is set: jobs wait in the queue")
    if bits:
        st.caption(" · ".join(bits))


def sidebar() -> None:
    """Worker status, the current run (previous runs) and the whole-run download."""
    with st.sidebar:
        active = any(_active(st.session_state.get(k)) for k in ("capture_job", "truncate_job", "sweep_job", "loss_job"))
        ws = ensure_worker().status()
        # polled while idle too (more slowly): a worker that died is noticed and restarted without a click
        busy = active or ws["state"] in ("starting", "busy")
        poll = (2.0 if busy else IDLE_POLL_SECONDS) if _poll_seconds() else None
        st.fragment(worker_status_line, run_every=poll)()
        from gdnviz.ui.export import export_kwargs, export_options

        export_options()
        runs, bad = store().read_runs()
        st.markdown("**Previous runs**")
        unreadable_runs_warning(bad)
        if not runs:
            st.caption(("No readable run" if bad else "None yet") + ": run a capture on *Model & documents*.")
            return
        ids = [r["run_id"] for r in runs]
        labels = {r["run_id"]: run_label(r) for r in runs}
        cur = st.session_state.get("run_id")
        st.session_state["sb_run"] = cur if cur in ids else None
        st.selectbox("Run shown on every page", ids, key="sb_run", format_func=lambda r: labels.get(r, r),
                     on_change=_pick_run, label_visibility="collapsed", placeholder="Pick a run to open it",
                     help="Every capture is stored on disk; picking one reopens it instantly. A page shows only "
                          "this session's capture or the run picked here.")
        run = next((r for r in runs if r["run_id"] == cur), None)
        if run is not None:
            from gdnviz.jobs import MissingResult

            try:  # the zip is built on click, where a failure could not be shown: check that it can be built
                _load_captures(str(store().dir), run["run_id"], tuple(d["key"] for d in run["documents"]))
            except MissingResult as e:
                st.caption(f"This run cannot be exported now: {e}. Open it on a page to recompute it.")
                return
            lh = (st.session_state.get("layer"), st.session_state.get("head"))
            ex = export_kwargs()  # read here: the zip is built on click, outside this session's script run
            st.download_button("Download this run (zip)", data=lambda: run_zip_bytes(run, *lh, ex), file_name=
                               f"gdnviz-{run['run_id']}.zip", mime="application/zip", on_click="ignore",
                               key="dl_run_zip", icon=":material/folder_zip:",
                               help="All figures (PNG + SVG), their data (CSV), the head table and the settings, "
                                    "the run's truncations, sweeps, scans, budgets and loss results (CSV / JSON), "
                                    "a README of every file and redraw.py")


def _pick_run() -> None:
    st.session_state["run_id"] = st.session_state.get("sb_run")


def job_active(jid) -> bool:
    """True while the job ``jid`` is queued or running."""
    return _active(jid)


def _active(jid) -> bool:
    if not jid:
        return False
    rec = store().job(jid)
    return rec is not None and rec["status"] in ("queued", "running")


def run_zip_bytes(run: dict, layer: int | None = None, head: int | None = None, export: dict | None = None) -> bytes:
    """Figures (PNG + SVG), their CSV, the head table and the settings of a run, as one zip; with ``layer`` and
    ``head`` also that head's figures; and the results of the jobs that belong to the run with a README and a
    redraw script (``gdnviz.run_export``). ``export``: ``ui.export.export_kwargs()`` (the figures' size and PNG
    scale); None: each figure's own size at 2×."""
    from gdnviz import figures as F
    from gdnviz.summary import document_set_table

    caps = _load_captures(str(store().dir), run["run_id"], tuple(d["key"] for d in run["documents"]))
    names = [d["name"] for d in run["documents"]]
    table = document_set_table(caps)
    L = int(run["segment_len"])
    ov = run_overview(run)
    figs = {}
    for m in F.HEATMAP_METRICS:
        df = F.heatmap_frame(table, m)
        figs[f"heatmap_{m}"] = (F.heatmap(df, m, interactive=False), df)
    rmax = min(int(run["model"]["d_k"]), int(run["model"]["d_v"]))
    figs["erank_vs_horizon"] = (F.erank_vs_horizon_chart(table, ov["spearman_erank_horizon"], rmax,
                                                         ov["spearman_ci95"]),
                                table[["layer", "head", "erank", "horizon"]])
    figs["keycone_ceiling"] = (F.keycone_ceiling_chart(table),
                               table[["layer", "head", "erank", "horizon", "mean_key_norm", "key_cov_erank"]])
    figs["horizon_histogram"] = (F.horizon_hist_chart(table, L), table[["layer", "head", "horizon"]])
    fl = F.forgetting_by_layer_frame(table, L)
    figs["forgetting_by_layer"] = (F.forgetting_chart(fl, L), fl)
    gl = list(run["model"]["gdn_layers"])
    if layer in gl and head is not None:
        li = gl.index(layer)
        tag = f"L{layer}H{head}"
        sp = F.spectrum_frame(caps, names, li, head)
        figs[f"{tag}_spectrum"] = (F.spectrum_chart(sp, names[0]), sp)
        en = F.energy_frame(caps, names, li, head)
        figs[f"{tag}_energy_kept"] = (F.energy_chart(en), en)
        al = F.erank_along_frame(caps, names, li, head)
        figs[f"{tag}_erank_along"] = (F.erank_along_chart(al, L), al)
        hist, stats = F.alpha_frame(caps, names, li, head)
        figs[f"{tag}_alpha"] = (F.alpha_chart(hist, stats, L), hist)
        kdf, kinfo = F.keycone_frame(caps[0], li, head)
        figs[f"{tag}_keycone"] = (F.keycone_chart(kdf, kinfo, names[0]), kdf)
    settings = {k: v for k, v in run.items() if k != "spec"}
    settings["spec"] = {k: v for k, v in run["spec"].items() if k != "documents"}
    settings["overview"] = ov
    from gdnviz.run_export import run_files

    return F.run_zip(figs, settings, {"heads": table}, **(export or {}), files=run_files(store(), run))


def batch_value(v) -> int | None:
    """A page's batch-size field as the sweeps take it: empty → None (chosen from free memory), else the int."""
    return None if v is None else int(v)


def batch_phrase(v) -> str:
    """How a run's batch size reads on a page: "8 per forward pass" or "batch size chosen from free memory"."""
    return "batch size chosen from free memory" if v is None else f"{int(v)} per forward pass"


def send_rank_map_to_truncate(ranks: dict) -> None:
    """Replace Truncate & compare's groups by a per-head rank map (``truncation.groups_from_rank_map``: one head
    list per rank). Call from a button's ``on_click``; then ``st.switch_page(PAGES["truncate"])``."""
    from gdnviz.ui.truncation import groups_from_rank_map

    for k in [k for k in st.session_state if isinstance(k, str) and PERSISTED_GROUP_KEY.fullmatch(k)]:
        del st.session_state[k]
    groups = groups_from_rank_map(ranks)
    st.session_state["tr_groups"] = list(range(len(groups))) or [0]
    for gid, g in enumerate(groups):
        st.session_state[f"tr_g{gid}_mode"] = "heads"
        st.session_state[f"tr_g{gid}_list"] = [head_label(l, h) for l, h in g["heads"]]
        st.session_state[f"tr_g{gid}_r"] = float(g["r"])
