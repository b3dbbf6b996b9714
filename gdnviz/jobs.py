"""Jobs: small frozen specs (what to run) → pure functions calling the library (how) → results (what pages draw).

A spec is a frozen dataclass of plain values (texts, ints, tuples), so it pickles into the queue, hashes into a
cache key and round-trips through ``spec_to_dict`` / ``spec_from_dict``. Every spec names its model with
``model``, ``device``, ``dtype`` and ``trust_remote_code`` (run the checkpoint's own code; off unless the user
ticked it), which ``JobContext.model(spec)`` loads. ``run(spec, ctx)`` executes one spec with
a ``JobContext`` that provides the loaded model, progress reporting (which raises ``JobCancelled`` when the user
cancelled) and the store for memoised results. The worker (``python -m gdnviz.worker``) is the only caller in the
app; the CLI and tests can call ``run`` directly.

=====================  ==========================================================================================
spec                   result (a JSON-able dict; big arrays live in the memo)
=====================  ==========================================================================================
InspectModelJob        what ``gdnviz.models.inspect_model`` finds + fingerprint, resolved device/dtype, kernel path,
                       the checkpoint's own code files that loading it runs (``remote_code``; [] untrusted)
CaptureJob             ``run_id`` of a "previous runs" entry; one memo entry per document (CaptureResult bytes)
TruncateCompareJob     untouched vs truncated greedy answers, RULER scores, next-token loss change on documents
                       (mean of per-document means; none when no documents are given)
LossJob                loss vs r over documents (``gdnviz.probes.loss_sweep``): per-document rows and seed 000's
                       table (records) + settings; every (document, setting)'s per-token losses are one memo entry
                       (key: ``gdnviz.probes.loss_sweep.doc_key``), so the job resumes and shares the untouched
                       losses across head sets
SweepJob               RULER score vs r (``gdnviz.probes.sweep``): rows and seed 000's table (records) + settings;
                       every (task, length, setting, sample) result is its own memo entry (key:
                       ``gdnviz.probes.sweep.cell_key``), so a cancelled or crashed sweep resumes where it
                       stopped and a repeated one recomputes nothing
ScanJob                a head sensitivity scan (``gdnviz.probes.scan``): its table (records), untouched / all-cut
                       scores, plan; answers memoised per sample under the sweep's cell keys (shared with sweeps)
PatchJob               prompt B with chosen heads' states at one boundary patched from prompt A
                       (``gdnviz.patching``): the comparison of answers, scores and the continuation loss; the
                       whole result memoised under ``gdnviz.patching.patch_key``
HoldsJob               what one head's state holds at one position of a run's document
                       (``gdnviz.attribution.holds.what_it_holds``): per-token norms and shares, the part from
                       beyond one segment, the rewrite rate along the document; memoised under ``holds_key``
AttnMapJob             the exact attention map of one GDN head over a window of query positions of a run's
                       document, and a full-attention layer's softmax weights there
                       (``gdnviz.attribution.exact_map`` / ``softmax_map``); two memo entries (``attnmap_keys``)
BudgetJob              a per-head rank budget (``gdnviz.probes.budget``), optionally for several tolerances: each
                       budget's summary (ranks, scores, held-out check, state bytes) and the score-vs-memory curve
=====================  ==========================================================================================

Memo keys (``cache_key``) hash what determines a result: the computation version, the model fingerprint, the
token ids, the segment length, the resolved dtype and device type (``ModelInfo.memo_device``: for a model spread
over several devices by a ``device_map``, the map), and the job's parameters. A sweep's cells are
keyed by ``gdnviz.probes.sweep.cell_key`` alone, a loss sweep's per-document entries by
``gdnviz.probes.loss_sweep.doc_key``.

With ``GDNVIZ_CLUSTER`` set, LossJob, SweepJob, ScanJob and BudgetJob answer on that Dask cluster's workers
(``gdnviz.cluster``; the worker writes the memo, the progress text gives the answers per worker, the result its
``cluster`` and ``per_worker``).
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

import numpy as np

from gdnviz.documents import check_length, check_text, tokenize
from gdnviz.errors import CorruptStoreEntry, DocumentTooLong, EmptyDocumentSet, GDNVizError, JobCancelled
from gdnviz.probes import rates
from gdnviz.probes.memo import MemoStore
from gdnviz.probes.rates import is_record as is_rate_record
from gdnviz.store import Store, content_hash

#: Version strings of the computations keyed by ``cache_key``; bump one to invalidate its memo entries (a sweep's
#: cells: ``gdnviz.probes.sweep.VERSION``).
VERSIONS = {
    "capture": "capture-v1/jobs-1",
    "truncate": "truncate-compare-v3",
    "holds": "holds-v1",
    "attnmap": "attnmap-v1",
    "softmax": "softmax-v1",
}


# --- specs ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class InspectModelJob:
    """Describe a checkpoint without loading its weights (family, layers, heads, widths, kernel path)."""

    kind: ClassVar[str] = "inspect"
    model: str = "demo"
    device: str = "auto"
    dtype: str = "auto"
    trust_remote_code: bool = False


@dataclass(frozen=True)
class CaptureJob:
    """Capture every GDN head along each document of a set. ``documents``: ((name, text), ...)."""

    kind: ClassVar[str] = "capture"
    model: str
    documents: tuple
    segment_len: int = 256
    device: str = "auto"
    dtype: str = "auto"
    device_map: str = ""
    trust_remote_code: bool = False
    max_tokens: int = 32768


@dataclass(frozen=True)
class TruncateCompareJob:
    """Greedy answers of the untouched and the truncated model, and the loss change on documents.

    ranks: ((layer, head, r), ...). The prompt is ``prompt`` (typed text) unless ``task`` names a RULER task, in
    which case a sample of ``target_len`` tokens with ``seed`` is generated with the model's tokenizer.
    loss_documents: ((name, text), ...) whose mean next-token loss is measured both ways (empty: no loss is
    computed, and the result's ``loss`` is None and ``losses`` empty).
    """

    kind: ClassVar[str] = "truncate"
    model: str
    ranks: tuple
    prompt: str = ""
    task: str = ""
    target_len: int = 1024
    seed: int = 0
    max_new_tokens: int = 32
    segment_len: int = 256
    loss_documents: tuple = ()
    chat_template: bool = True
    device: str = "auto"
    dtype: str = "auto"
    device_map: str = ""
    trust_remote_code: bool = False


@dataclass(frozen=True)
class LossJob:
    """Loss vs rank over a document set (``gdnviz.probes.loss_sweep``). documents: ((name, text), ...).

    ranks: () = 1, 4, 12, 32 below min(d_k, d_v); the untouched r always runs. heads: "all", "layers:0,1",
    "L:H,L:H" or ((layer, head), ...). rank_maps: ((name, ((layer, head, r), ...)), ...). min_distance: d of the
    copy subsets (tokens). fingerprint: when given, the loaded model must have it.
    """

    kind: ClassVar[str] = "loss"
    model: str
    documents: tuple
    ranks: tuple = ()
    heads: Any = "all"
    rank_maps: tuple = ()
    segment_len: int = 256
    min_distance: int = 512
    fingerprint: str = ""
    device: str = "auto"
    dtype: str = "auto"
    device_map: str = ""
    trust_remote_code: bool = False


@dataclass(frozen=True)
class SweepJob:
    """A retrieval sweep: RULER ``tasks`` x ``lengths`` (tokens) x ``ranks`` x ``n`` samples (seeds ``seed0 ..``).

    ranks: () = 1, 4, 12, 32, 128 clipped to min(d_k, d_v); the untouched r = min(d_k, d_v) always runs (the
    baseline of the paired differences). heads: "all", "layers:0,1", "L:H,L:H" or ((layer, head), ...): the heads
    cut to each r. rank_maps: ((name, ((layer, head, r), ...)), ...) extra per-head settings. max_new_tokens:
    0 = RULER's per task. chat_template: "auto" | True | False. fingerprint: when given, the loaded model must
    have it (the page passes the inspected model's, so a checkpoint changed on disk is refused). max_tokens: the
    longest length allowed (the app's per-document token limit); a longer one fails before anything is built.
    """

    kind: ClassVar[str] = "sweep"
    model: str
    tasks: tuple
    lengths: tuple
    ranks: tuple = ()
    n: int = 20
    seed0: int = 0
    heads: Any = "all"
    rank_maps: tuple = ()
    segment_len: int = 256
    batch_size: int | None = None
    max_new_tokens: int = 0
    chat_template: Any = "auto"
    chat_template_kwargs: tuple = ()
    fingerprint: str = ""
    device: str = "auto"
    dtype: str = "auto"
    device_map: str = ""
    trust_remote_code: bool = False
    max_tokens: int = 32768


@dataclass(frozen=True)
class ScanJob:
    """A head sensitivity scan (``gdnviz.probes.scan.ScanSpec``): ``task`` at ``length`` tokens, ``n`` samples, one
    ``by`` ("layer" | "head") unit cut to ``r`` at a time (or, with ``keep``, kept whole with every other head at
    r); ``layers`` = () for every GDN layer. max_new_tokens: 0 = RULER's per task. max_prompts: the most new
    answers it may generate (TooManyPrompts otherwise, before running). max_tokens: as ``SweepJob``'s."""

    kind: ClassVar[str] = "scan"
    model: str
    task: str
    length: int
    r: int = 1
    by: str = "layer"
    keep: bool = False
    layers: tuple = ()
    n: int = 20
    seed0: int = 0
    segment_len: int = 256
    batch_size: int | None = None
    max_new_tokens: int = 0
    chat_template: Any = "auto"
    max_prompts: int = 2000
    fingerprint: str = ""
    device: str = "auto"
    dtype: str = "auto"
    device_map: str = ""
    trust_remote_code: bool = False
    max_tokens: int = 32768


@dataclass(frozen=True)
class BudgetJob:
    """A per-head rank budget (``gdnviz.probes.budget.BudgetSpec``) at each of ``tolerances`` (points; the first is
    the budget, the others add points to the score-vs-memory curve). ladder: () = 32, 12, 4, 1 below
    min(d_k, d_v). n_heldout: -1 = n, 0 = no held-out check.
    max_prompts: per tolerance. max_tokens: as ``SweepJob``'s."""

    kind: ClassVar[str] = "budget"
    model: str
    tasks: tuple
    lengths: tuple
    n: int = 20
    tolerances: tuple = (1.0,)
    alpha: float = 0.05
    ladder: tuple = ()
    seed0: int = 0
    n_heldout: int = -1
    segment_len: int = 256
    batch_size: int | None = None
    max_new_tokens: int = 0
    chat_template: Any = "auto"
    max_prompts: int = 2000
    fingerprint: str = ""
    device: str = "auto"
    dtype: str = "auto"
    device_map: str = ""
    trust_remote_code: bool = False
    max_tokens: int = 32768


@dataclass(frozen=True)
class PatchJob:
    """State patching (``gdnviz.patching.patch_prompts``): prompts ``prompt_a`` (the donor) and ``prompt_b`` (typed
    texts), unless ``task`` names a noise-haystack NIAH task: then A is its sample of ``target_len`` tokens with
    ``seed`` and B the same prompt without the needle (``gdnviz.patching.needle_pair``). heads: "all",
    "layers:0,1", "L:H,L:H" or ((layer, head), ...). boundary: 0 = the last boundary before B's question (task) or
    B's end (texts); source: 0 = the same position in A. continuation: text whose loss after B is measured ("" =
    the needle value (task) or B's unpatched answer). fingerprint: when given, the loaded model must have it."""

    kind: ClassVar[str] = "patch"
    model: str
    prompt_a: str = ""
    prompt_b: str = ""
    task: str = ""
    target_len: int = 1024
    seed: int = 0
    heads: Any = "all"
    boundary: int = 0
    source: int = 0
    continuation: str = ""
    max_new_tokens: int = 32
    segment_len: int = 256
    chat_template: bool = True
    fingerprint: str = ""
    device: str = "auto"
    dtype: str = "auto"
    device_map: str = ""
    trust_remote_code: bool = False


@dataclass(frozen=True)
class HoldsJob:
    """What ``(layer, head)``'s state holds after ``position`` tokens (1..T) of ``document`` ((name, text)) of a
    run: ``doc_key`` is the run's capture key of that document, which the job recomputes from the loaded model and
    the tokens (ModelMismatch when they differ, so a changed checkpoint or text is refused). ``top``: singular
    directions reported."""

    kind: ClassVar[str] = "holds"
    model: str
    document: tuple
    doc_key: str
    layer: int
    head: int
    position: int
    top: int = 4
    segment_len: int = 256
    device: str = "auto"
    dtype: str = "auto"
    device_map: str = ""
    trust_remote_code: bool = False


# --- AttnMapJob (issue 31: the exact attention map on the Head page) ------------------------------------------
@dataclass(frozen=True)
class AttnMapJob:
    """The exact map of GDN ``(layer, head)`` at query positions ``start..end−1`` (0-based) over keys ``0..end−1`` of
    ``document`` ((name, text)) of a run (``doc_key``: the run's capture key, checked as in HoldsJob), and the
    softmax weights of full-attention layer ``attn_layer`` (None: none asked for) at the same positions, of query
    head ``attn_head`` (None: the mean over the layer's heads)."""

    kind: ClassVar[str] = "attnmap"
    model: str
    document: tuple
    doc_key: str
    layer: int
    head: int
    start: int
    end: int
    attn_layer: int | None = None
    attn_head: int | None = None
    segment_len: int = 256
    device: str = "auto"
    dtype: str = "auto"
    device_map: str = ""
    trust_remote_code: bool = False
# --- end AttnMapJob ----------------------------------------------------------------------------------------------


SPECS = {c.kind: c for c in (InspectModelJob, CaptureJob, TruncateCompareJob, LossJob, SweepJob, ScanJob, BudgetJob,
                             PatchJob, HoldsJob, AttnMapJob)}


def _tuplify(x):
    if isinstance(x, (list, tuple)):
        return tuple(_tuplify(v) for v in x)
    return x


def spec_to_dict(spec) -> dict:
    d = asdict(spec)
    d["kind"] = spec.kind
    return d


def spec_from_dict(d: dict):
    d = dict(d)
    kind = d.pop("kind")
    cls = SPECS[kind]
    names = {f.name for f in fields(cls)}
    return cls(**{k: _tuplify(v) for k, v in d.items() if k in names})


# --- keys ----------------------------------------------------------------------------------------------------
def ids_hash(ids) -> str:
    return hashlib.sha256(np.asarray(list(ids), dtype=np.int64).tobytes()).hexdigest()[:32]


def cache_key(kind: str, fingerprint: str, params: dict | None = None, token_ids=()) -> str:
    """Memo key of a result: ``<kind>:<hash>`` of the version, model fingerprint, parameters and token ids."""
    payload = dict(version=VERSIONS[kind], fingerprint=fingerprint, params=params or {},
                   ids=[ids_hash(t) for t in token_ids])
    return f"{kind}:{content_hash(payload)}"


def capture_key(fingerprint: str, ids, segment_len: int, dtype: str, device_type: str) -> str:
    return cache_key("capture", fingerprint, dict(segment_len=int(segment_len), dtype=dtype, device=device_type),
                     [ids])


def holds_key(doc_key: str, layer: int, head: int, position: int, top: int, segment_len: int) -> str:
    """Memo key of a HoldsJob's result: the document's capture key (model fingerprint, tokens, L, dtype, device
    type) and the head, position and number of directions. The app computes it without the model."""
    return cache_key("holds", doc_key.split(":", 1)[-1], dict(layer=int(layer), head=int(head),
                                                              position=int(position), top=int(top),
                                                              L=int(segment_len)))


# --- AttnMapJob keys and payloads ---------------------------------------------------------------------------------
MAX_STORED_MAP_BYTES = 256 * 2**20  # one stored map, float64 [end − start, end]: e.g. 2,048 queries × 16,384 keys


def attnmap_keys(doc_key: str, layer: int, head: int, start: int, end: int, attn_layer: int | None,
                 attn_head: int | None) -> tuple[str, str | None]:
    """Memo keys of an AttnMapJob's two results: the GDN map (the document's capture key, which names the model,
    tokens, L, dtype and device type; the head; the window) and the softmax weights (the same document key, the
    attention layer, its head or None for the mean, the window; None when no attention layer is asked for). The
    app computes them without the model."""
    fp = doc_key.split(":", 1)[-1]
    win = dict(start=int(start), end=int(end))
    gdn = cache_key("attnmap", fp, dict(layer=int(layer), head=int(head), **win))
    if attn_layer is None:
        return gdn, None
    return gdn, cache_key("softmax", fp, dict(layer=int(attn_layer), head=None if attn_head is None else int(attn_head),
                                              **win))


def pack_map(w: np.ndarray, meta: dict) -> bytes:
    """A stored map: ``w`` (float64 ``[end − start, end]``) and a JSON-able ``meta`` dict, as npz bytes."""
    import io
    import json

    buf = io.BytesIO()
    np.savez(buf, w=np.asarray(w, dtype=np.float64), meta=np.array(json.dumps(meta)))
    return buf.getvalue()


def unpack_map(data: bytes) -> tuple[np.ndarray, dict]:
    """``(w, meta)`` of :func:`pack_map` bytes."""
    import io
    import json

    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        return z["w"], json.loads(str(z["meta"]))
# --- end AttnMapJob keys ---------------------------------------------------------------------------------------


def run_id_for(fingerprint: str, doc_keys, segment_len: int, dtype: str, device_type: str) -> str:
    return "run-" + content_hash(dict(fp=fingerprint, docs=list(doc_keys), L=segment_len, dtype=dtype,
                                      device=device_type))[:16]


# --- context -------------------------------------------------------------------------------------------------
class JobContext:
    """What a job function may use: the store, a model loader, progress (raises JobCancelled on cancel)."""

    def __init__(self, store: Store, job_id: str = "", model_loader=None, progress=None, cancelled=None):
        self.store = store
        self.job_id = job_id
        self._loader = model_loader
        self._progress = progress
        self._cancelled = cancelled

    def model(self, spec):
        """The loaded model of ``spec`` (its model, device, dtype, device_map, trust_remote_code); ``device_map``: ""
        (none), "auto" or a JSON object (``gdnviz.models.placement``)."""
        args = (spec.model, spec.device, spec.dtype, spec.device_map, bool(spec.trust_remote_code))
        if self._loader is not None:
            return self._loader(*args)
        from gdnviz.models import load

        return load(args[0], device=args[1], dtype=args[2], device_map=args[3] or None, trust_remote_code=args[4])

    def cancelled(self) -> bool:
        return bool(self._cancelled and self._cancelled())

    def progress(self, done: float, total: float, text: str = "") -> None:
        if self._progress is not None:
            self._progress(done, total, text)
        if self.cancelled():
            raise JobCancelled("cancelled by the user")


# --- runners -------------------------------------------------------------------------------------------------
def run(spec, ctx: JobContext) -> dict:
    """Execute one job spec; returns its JSON-able result dict."""
    fn = {"inspect": run_inspect, "capture": run_capture, "truncate": run_truncate, "loss": run_loss,
          "sweep": run_sweep_job, "scan": run_scan_job, "budget": run_budget_job, "patch": run_patch_job,
          "holds": run_holds_job, "attnmap": run_attnmap_job}[spec.kind]
    return fn(spec, ctx)


def run_inspect(spec: InspectModelJob, ctx: JobContext) -> dict:
    from pathlib import Path

    from gdnviz.gdn.kernels import backend_for
    from gdnviz.models import inspect_model
    from gdnviz.models.loader import fingerprint, parse_device, parse_dtype, read_raw_config, remote_code, weight_files
    import torch

    desc = inspect_model(spec.model, spec.trust_remote_code)
    path = Path(desc["path"])
    dev = parse_device(spec.device)
    dt = parse_dtype(spec.dtype, dev)
    wf = weight_files(path)
    out = dict(desc)
    out.update(
        name=spec.model, requested_device=spec.device, requested_dtype=spec.dtype,
        device=str(dev), device_type=dev.type, dtype=str(dt).replace("torch.", ""),
        kernel_path=backend_for(dev), cuda_available=bool(torch.cuda.is_available()),
        fingerprint=fingerprint(path, spec.trust_remote_code), has_tokenizer_json=(path / "tokenizer.json").exists(),
        weight_bytes=int(sum(f.stat().st_size for f in wf)), weight_files=[f.name for f in wf],
        remote_code=sorted(f.name for f in path.glob("*.py"))
        if spec.trust_remote_code and remote_code(read_raw_config(path)) else [],
    )
    out["gdn_layers"], out["attn_layers"] = list(out["gdn_layers"]), list(out["attn_layers"])
    return out


def _tokenize_docs(lm, documents, max_tokens: int | None) -> list:
    if lm.tokenizer is None:
        raise GDNVizError(f"{lm.info.path or lm.info.name} has no tokenizer files beside its weights "
                          "(tokenizer.json / tokenizer_config.json): save the model's tokenizer into that folder")
    out = []
    for name, text in documents:
        ids = tokenize(lm.tokenizer, check_text(name, text))
        if max_tokens:
            check_length(name, len(ids), int(max_tokens))
        out.append((name, ids))
    return out


def run_capture(spec: CaptureJob, ctx: JobContext) -> dict:
    from gdnviz.capture import capture_document

    if not spec.documents:
        raise EmptyDocumentSet("no documents to capture: paste text, upload files or pick a sample document")
    ctx.progress(0, 1, "loading the model")
    lm = ctx.model(spec)
    info = lm.info
    docs = _tokenize_docs(lm, spec.documents, spec.max_tokens)
    dev_type = info.memo_device
    keys = [capture_key(info.fingerprint, ids, spec.segment_len, info.dtype, dev_type) for _, ids in docs]
    todo = [i for i, k in enumerate(keys) if not ctx.store.memo_has(k)]
    n_layers = len(info.gdn_layers)
    total = max(1, len(todo) * n_layers)
    backends: set = set()
    seconds, tokens = 0.0, 0
    try:
        for j, i in enumerate(todo):
            name, ids = docs[i]
            base = j * n_layers

            def prog(done, n, _base=base, _name=name, _j=j):
                ctx.progress(_base + done, total, f"document {_j + 1}/{len(todo)} '{_name}' ({len(docs[i][1]):,} "
                                                  f"tokens): GDN layer {done}/{n}")

            ctx.progress(base, total, f"document {j + 1}/{len(todo)} '{name}' ({len(ids):,} tokens)")
            cap = capture_document(lm, ids, spec.segment_len, name=name, progress=prog, cancel=ctx.cancelled)
            backends |= set(cap.meta.get("backends", []))
            seconds += float(cap.meta.get("seconds", 0.0))
            tokens += len(ids)
            ctx.store.memo_put(keys[i], cap.to_bytes())
    finally:  # the documents a cancelled capture finished were measured too
        rates.record_job(MemoStore(MemoMapping(ctx.store)), info, "capture", spec.segment_len, seconds, tokens)
    rid = run_id_for(info.fingerprint, keys, spec.segment_len, info.dtype, dev_type)
    entry = dict(
        run_id=rid, created=time.time(), model=info.to_dict(), model_name=spec.model, segment_len=spec.segment_len,
        dtype=info.dtype, device=info.device, kernel_path=info.kernel_path, backends=sorted(backends),
        documents=[dict(name=n, n_tokens=len(ids), key=k) for (n, ids), k in zip(docs, keys)],
        spec=spec_to_dict(spec), seconds=round(seconds, 3),
    )
    try:
        old = ctx.store.run(rid)
    except CorruptStoreEntry:  # a damaged entry of the same run: this capture replaces it
        old = None
    if old is not None:
        entry["created"] = old.get("created", entry["created"])
        entry["backends"] = sorted(set(old.get("backends", [])) | backends)
    ctx.store.add_run(entry)
    ctx.progress(total, total, "done")
    return dict(run_id=rid, computed=len(todo), reused=len(docs) - len(todo), n_documents=len(docs),
                n_tokens=[len(ids) for _, ids in docs])


def _summary_nll(nll0: np.ndarray, nll1: np.ndarray, max_points: int = 256) -> dict:
    """Mean losses and a block-averaged per-token difference (at most ``max_points`` points) for plotting."""
    d = nll1 - nll0
    n = len(d)
    block = max(1, int(np.ceil(n / max_points)))
    m = (n // block) * block
    pos = (np.arange(0, m, block) + block / 2.0 + 1).tolist()
    avg = d[:m].reshape(-1, block).mean(1).tolist() if m else []
    if m < n:
        pos.append(float(m + (n - m) / 2.0 + 1))
        avg.append(float(d[m:].mean()))
    return dict(loss_untouched=float(nll0.mean()), loss_truncated=float(nll1.mean()),
                delta=float(nll1.mean() - nll0.mean()), n_predictions=int(n), block=block,
                positions=pos, delta_along=avg)


def run_truncate(spec: TruncateCompareJob, ctx: JobContext) -> dict:
    from gdnviz.generate import greedy_generate
    from gdnviz.truncation import TruncationSpec
    from gdnviz.probes import ruler
    from gdnviz.probes.loss import token_nll

    ctx.progress(0, 1, "loading the model")
    lm = ctx.model(spec)
    info = lm.info
    tspec = TruncationSpec.from_dict({(int(l), int(h)): int(r) for l, h, r in spec.ranks})
    if not len(tspec):
        raise GDNVizError("no heads chosen: pick heads on the heatmap, whole layers, a horizon filter, or all heads")
    tspec.validate(info)
    if lm.tokenizer is None:
        raise GDNVizError(f"{info.path or info.name} has no tokenizer: save the model's tokenizer beside it")
    refs: list = []
    if spec.task:
        ctx.progress(0, 1, f"generating a {spec.task} sample of {spec.target_len} tokens")
        sample = ruler.generate(spec.task, lm.tokenizer, int(spec.target_len), int(spec.seed),
                                chat_template="auto" if spec.chat_template else False)
        prompt_ids, prompt_text, refs = list(sample.input_ids), sample.prompt, list(sample.answers)
        max_new = int(spec.max_new_tokens) or int(sample.tokens_to_generate)
    else:
        prompt_text = check_text("the prompt", spec.prompt)
        prompt_ids = tokenize(lm.tokenizer, prompt_text)
        max_new = int(spec.max_new_tokens)
    loss_docs = _tokenize_docs(lm, spec.loss_documents, None) if spec.loss_documents else []
    dev_type = info.memo_device
    params = dict(ranks=[list(x) for x in tspec.to_list()], max_new=max_new, L=spec.segment_len, dtype=info.dtype,
                  device=dev_type, task=spec.task, refs=refs, loss_docs=[n for n, _ in loss_docs])
    key = cache_key("truncate", info.fingerprint, params, [prompt_ids] + [ids for _, ids in loss_docs])
    hit = ctx.store.memo_get_json(key)
    if hit is not None:
        hit["memo_hit"] = True
        return hit
    steps = 2 + 2 * len(loss_docs)
    spent = [0.0]  # seconds of the model calls below

    def timed(fn, *a, **kw):
        t = time.perf_counter()
        out = fn(*a, **kw)
        spent[0] += time.perf_counter() - t
        return out

    ctx.progress(0, steps, "untouched model: generating")
    g0 = timed(greedy_generate, lm, prompt_ids, max_new, segment_len=spec.segment_len, spec=None)
    ctx.progress(1, steps, f"truncated model ({len(tspec)} heads): generating")
    g1 = timed(greedy_generate, lm, prompt_ids, max_new, segment_len=spec.segment_len, spec=tspec)
    losses = []
    for j, (name, ids) in enumerate(loss_docs):
        ctx.progress(2 + 2 * j, steps, f"loss on '{name}' ({len(ids):,} tokens): untouched")
        nll0 = timed(token_nll, lm, ids, segment_len=spec.segment_len)
        ctx.progress(3 + 2 * j, steps, f"loss on '{name}' ({len(ids):,} tokens): truncated")
        nll1 = timed(token_nll, lm, ids, segment_len=spec.segment_len, spec=tspec)
        losses.append(dict(document=name, n_tokens=len(ids), **_summary_nll(nll0, nll1)))
    tokens = 2 * len(prompt_ids) + len(g0.tokens) + len(g1.tokens) + 2 * sum(len(ids) for _, ids in loss_docs)
    rates.record_job(MemoStore(MemoMapping(ctx.store)), info, "truncate", spec.segment_len, spent[0], tokens)
    scores = {}
    if refs:
        scores = dict(untouched=ruler.score(spec.task, [g0.text], [refs]),
                      truncated=ruler.score(spec.task, [g1.text], [refs]))
    loss = None
    if losses:  # documents weighted equally, as in gdnviz.probes.loss_sweep: the mean of per-document means
        tot0 = float(np.mean([l["loss_untouched"] for l in losses]))
        tot1 = float(np.mean([l["loss_truncated"] for l in losses]))
        loss = dict(untouched=tot0, truncated=tot1, delta=tot1 - tot0,
                    n_predictions=sum(l["n_predictions"] for l in losses), n_documents=len(losses))
    result = dict(
        prompt=prompt_text, prompt_tokens=len(prompt_ids), task=spec.task, references=refs,
        untouched=dict(text=g0.text, tokens=g0.tokens), truncated=dict(text=g1.text, tokens=g1.tokens),
        scores=scores, losses=losses,
        loss=loss,
        n_heads=len(tspec), ranks=tspec.to_list(), segment_len=spec.segment_len, max_new_tokens=max_new,
        boundaries_in_prompt=len(prompt_ids) // spec.segment_len, model=info.name, fingerprint=info.fingerprint,
        dtype=info.dtype, device=info.device, kernel_path=info.kernel_path, memo_key=key,
        readouts=dict(untouched=list(g0.readouts), truncated=list(g1.readouts)),
    )
    ctx.store.memo_put_json(key, result)
    ctx.progress(steps, steps, "done")
    result["memo_hit"] = False
    return result


class _LossMemo:
    """The store's memo as the mapping ``run_loss_sweep`` keeps its per-document losses in (bytes entries, checksummed
    by the store); counts the entries it computed."""

    def __init__(self, store: Store):
        self.store, self.puts = store, 0

    def get(self, key: str):
        return self.store.memo_get(key)

    def __setitem__(self, key: str, value: bytes) -> None:
        self.store.memo_put(key, value)
        self.puts += 1


def loss_spec_of(spec: LossJob):
    """The library's ``LossSweepSpec`` of a job spec."""
    from gdnviz.probes.loss_sweep import LossSweepSpec

    heads = spec.heads if isinstance(spec.heads, str) else tuple(tuple(int(x) for x in lh) for lh in spec.heads)
    return LossSweepSpec(
        model=spec.model, ranks=tuple(int(r) for r in spec.ranks) or None, heads=heads or "all",
        rank_maps=tuple((name, tuple(tuple(int(x) for x in e) for e in m)) for name, m in spec.rank_maps),
        segment_len=int(spec.segment_len), min_distance=spec.min_distance, fingerprint=spec.fingerprint or None)


def _model_or_cluster(spec, ctx: JobContext, what: str) -> tuple:
    """(lm, executor, workers) of a probe job: on the Dask cluster named by GDNVIZ_CLUSTER when it is set (``lm`` the
    workers' model view, the executor a ``gdnviz.cluster.ClusterExecutor``), else the model loaded here and None.
    ``workers["text"]``: " · workers: PORT N, ..." after each unit a worker answered ("" here), for the progress.
    BadDeviceMap for a device_map on a cluster; ClusterError when the cluster cannot serve the model."""
    from gdnviz import settings

    address = settings.get("GDNVIZ_CLUSTER")
    workers = {"text": "", "address": address or None}
    if not address:
        ctx.progress(0, 1, "loading the model")
        return ctx.model(spec), None, workers
    if spec.device_map:
        from gdnviz.errors import BadDeviceMap

        raise BadDeviceMap(f"a {what} with a device_map runs in this process: the Dask cluster's workers each hold the "
                           f"whole model on one GPU (unset GDNVIZ_CLUSTER, or drop device_map {spec.device_map!r})")
    from gdnviz import cluster

    ctx.progress(0, 1, f"connecting to the Dask cluster {address} and loading the model on its workers")

    def on_result(addr, per_worker):
        workers["text"] = " · workers: " + ", ".join(f"{a.rsplit(':', 1)[-1]} {n}" for a, n in
                                                     sorted(per_worker.items()))

    ex = cluster.executor(address, spec.model, spec.device, spec.dtype, spec.trust_remote_code, on_result=on_result)
    return ex.model_view(), ex, workers


def _cluster_result(ex, workers: dict) -> dict:
    """What a probe job's result says of where it ran: cluster (its address or None), per_worker (answers per worker
    address, or None in this process)."""
    return dict(cluster=workers["address"], per_worker=dict(ex.per_worker) if ex is not None else None)


def run_loss(spec: LossJob, ctx: JobContext) -> dict:
    from gdnviz.probes import loss_sweep
    from gdnviz.probes.sweep import records, resolve_heads, resolve_ranks

    if not spec.documents:
        raise EmptyDocumentSet("loss vs rank needs at least one document: capture a document set first")
    lm, ex, workers = _model_or_cluster(spec, ctx, "loss sweep")
    info = lm.info
    docs = _tokenize_docs(lm, spec.documents, None)
    lspec = loss_spec_of(spec)
    memo = _LossMemo(ctx.store)
    n = len(docs) * (len(resolve_ranks(lspec.ranks, min(info.d_k, info.d_v))) + len(lspec.rank_maps))
    done = {"n": 0}
    t0 = time.time()

    def describe(text):  # before each (document, setting): say what runs now (and honour a cancel)
        ctx.progress(done["n"], n, f"{done['n']:,}/{n:,} (document × setting) done · running {text}"
                                   f"{workers['text']}")

    def progress(d, total):
        done["n"] = d
        ctx.progress(d, total, f"{d:,}/{total:,} (document × setting) done{workers['text']}")

    spent = {"untouched": [0.0, 0], "truncated": [0.0, 0]}  # part -> [seconds of its passes, their tokens]

    def timed(units):  # this process's executor, timing each pass (a cluster's units overlap: not timed)
        for u in units:
            t = time.perf_counter()
            nll = u.answer(lm)
            acc = spent["untouched" if u.trunc is None else "truncated"]
            acc[0], acc[1] = acc[0] + time.perf_counter() - t, acc[1] + len(u.ids)
            yield u, nll

    try:
        rows = loss_sweep.run_loss_sweep(lm, docs, lspec, store=memo, describe=describe, progress=progress,
                                         executor=ex if ex is not None else timed)
    finally:  # the passes a cancelled run finished were measured too
        mem = MemoStore(MemoMapping(ctx.store))
        for part, (secs, k) in spent.items():
            rates.record_job(mem, info, "loss", lspec.segment_len, secs, k, part)
    rmax = min(info.d_k, info.d_v)
    table = loss_sweep.loss_table(rows, rmax=rmax)
    n_total = len(rows)
    ctx.progress(n_total, n_total, "done")
    return dict(
        rows=records(rows), table=records(table), settings=dict(lspec.to_dict(), fingerprint=info.fingerprint),
        version=loss_sweep.VERSION, model=info.to_dict(), model_name=spec.model, rmax=rmax,
        ranks=sorted({int(r) for r in rows["r"].dropna()}), n_heads=len(resolve_heads(lspec.heads, info)),
        documents=[dict(name=n, n_tokens=len(ids)) for n, ids in docs], computed=memo.puts,
        reused=n_total - memo.puts, n_results=n_total, seconds=round(time.time() - t0, 3), dtype=info.dtype,
        device=info.device, kernel_path=info.kernel_path, **_cluster_result(ex, workers))


class MemoMapping:
    """The store's memo as the mapping ``run_sweep`` memoises its cells in (one checksummed JSON entry per cell,
    under its ``gdnviz.probes.sweep.cell_key``); counts the cells it computed (not the throughput records,
    ``gdnviz.probes.rates``)."""

    def __init__(self, store: Store):
        self.store, self.puts = store, 0

    def get(self, key: str):
        return self.store.memo_get_json(key)

    def __setitem__(self, key: str, value) -> None:
        self.store.memo_put_json(key, value)
        self.puts += not is_rate_record(key)


def sweep_spec_of(spec: SweepJob):
    """The library's ``SweepSpec`` of a job spec."""
    from gdnviz.probes.sweep import SweepSpec

    heads = spec.heads if isinstance(spec.heads, str) else tuple(tuple(int(x) for x in lh) for lh in spec.heads)
    return SweepSpec(
        model=spec.model, tasks=tuple(spec.tasks), lengths=tuple(int(x) for x in spec.lengths),
        ranks=tuple(int(r) for r in spec.ranks) or None, n=int(spec.n), seed0=int(spec.seed0), heads=heads,
        rank_maps=tuple((name, {(int(l), int(h)): int(r) for l, h, r in m}) for name, m in spec.rank_maps),
        segment_len=int(spec.segment_len), batch_size=_rows(spec.batch_size),
        max_new_tokens=int(spec.max_new_tokens) or None, chat_template=spec.chat_template,
        chat_template_kwargs=tuple(tuple(kv) for kv in spec.chat_template_kwargs),
        fingerprint=spec.fingerprint or None)


def check_lengths(what: str, lengths, max_tokens: int) -> None:
    """DocumentTooLong for the first of a job's RULER ``lengths`` over ``max_tokens``, before any prompt is built."""
    for L in lengths:
        if int(L) > int(max_tokens):
            raise DocumentTooLong(f"{what} length {int(L):,} is over the token limit of {int(max_tokens):,} "
                                  "tokens: lower it, or raise the token limit.")


def run_sweep_job(spec: SweepJob, ctx: JobContext) -> dict:
    from gdnviz.probes import sweep

    check_lengths("Sweep", spec.lengths, spec.max_tokens)
    lm, ex, workers = _model_or_cluster(spec, ctx, "sweep")
    info = lm.info
    sspec = sweep_spec_of(spec)
    cells = len(spec.tasks) * len(spec.lengths) * int(spec.n)
    ctx.progress(0, 1, f"generating {cells:,} RULER prompts ({len(spec.tasks)} task(s) x {len(spec.lengths)} "
                       "length(s)) and checking the settings")
    memo = MemoMapping(ctx.store)
    now = {"text": "", "shown": 0.0}
    t0 = time.time()

    def progress(done, total):
        ctx.progress(done, total, f"answer {done:,}/{total:,} · {now['text']}{workers['text']}")

    def preparing(built, total):  # a cancel is checked after every prompt, the progress shown twice a second
        if time.time() - now["shown"] > 0.5 or built == total:
            now["shown"] = time.time()
            ctx.progress(0, 1, f"generating RULER prompts: {built:,}/{total:,}")
        elif ctx.cancelled():
            raise JobCancelled("cancelled by the user")

    rows = sweep.run_sweep(lm, sspec, store=memo, progress=progress, describe=lambda t: now.update(text=t),
                           preparing=preparing, executor=ex)
    rmax = min(info.d_k, info.d_v)
    table = sweep.sweep_table(rows, rmax=rmax)
    n_total = len(rows)
    ctx.progress(n_total, n_total, "done")
    return dict(
        rows=sweep.records(rows), table=sweep.records(table), settings=dict(sspec.to_dict(), fingerprint=info.fingerprint), version=sweep.VERSION,
        model=info.to_dict(), model_name=spec.model, rmax=rmax, ranks=sorted({int(r) for r in rows["r"].dropna()}),
        n_heads=len(sweep.resolve_heads(sspec.heads, info)), computed=memo.puts, reused=n_total - memo.puts,
        n_results=n_total, seconds=round(time.time() - t0, 3), dtype=info.dtype, device=info.device,
        kernel_path=info.kernel_path, **_cluster_result(ex, workers))


def scan_spec_of(spec: ScanJob):
    """The library's ``ScanSpec`` of a job spec."""
    from gdnviz.probes.scan import ScanSpec

    return ScanSpec(model=spec.model, task=spec.task, length=int(spec.length), r=int(spec.r), by=spec.by,
                    keep=bool(spec.keep), layers=tuple(int(l) for l in spec.layers) or None, n=int(spec.n),
                    seed0=int(spec.seed0), segment_len=int(spec.segment_len), batch_size=_rows(spec.batch_size),
                    max_new_tokens=int(spec.max_new_tokens) or None, chat_template=spec.chat_template,
                    fingerprint=spec.fingerprint or None, max_prompts=int(spec.max_prompts))


def run_scan_job(spec: ScanJob, ctx: JobContext) -> dict:
    from gdnviz.probes import scan, sweep

    check_lengths("Scan", (spec.length,), spec.max_tokens)
    lm, ex, workers = _model_or_cluster(spec, ctx, "scan")
    info = lm.info
    sspec = scan_spec_of(spec)
    ctx.progress(0, 1, f"generating {spec.n} {spec.task} prompts and counting the memo")
    memo = MemoMapping(ctx.store)
    plan = scan.plan_scan(info, lm.tokenizer, sspec, memo)
    now = {"text": ""}

    def progress(done, total):
        ctx.progress(done, total, f"answer {done:,}/{total:,} · {now['text']}{workers['text']}")

    res = scan.run_scan(lm, sspec, store=memo, progress=progress, describe=lambda t: now.update(text=t), executor=ex)
    ctx.progress(plan["answers"], plan["answers"], "done")
    samples = res.rows.drop_duplicates(["task", "length", "seed"])
    return dict(table=scan.table_records(res.table), settings=dict(sspec.to_dict(), fingerprint=info.fingerprint),
                prompt_tokens=[dict(task=str(t), length=int(n), seed=int(s), n_tokens=int(k)) for t, n, s, k in
                               zip(samples["task"], samples["length"], samples["seed"], samples["n_tokens"])],
                untouched=res.untouched, all_cut=res.all_cut, computed=res.computed,
                reused=plan["answers"] - res.computed, n_results=plan["answers"], seconds=round(res.seconds, 3),
                model=info.to_dict(), model_name=spec.model, rmax=min(info.d_k, info.d_v), dtype=info.dtype,
                device=info.device, kernel_path=info.kernel_path, version=sweep.VERSION,
                **_cluster_result(ex, workers))


def run_budget_job(spec: BudgetJob, ctx: JobContext) -> dict:
    from gdnviz.probes import budget, sweep

    check_lengths("Budget", spec.lengths, spec.max_tokens)
    if not spec.tolerances:
        raise GDNVizError("no tolerance given: set δ (points), e.g. 1")
    lm, ex, workers = _model_or_cluster(spec, ctx, "budget")
    info = lm.info
    memo = MemoMapping(ctx.store)
    out, results = [], []
    t0 = time.time()
    for i, tol in enumerate(spec.tolerances):
        bspec = budget.BudgetSpec(
            model=spec.model, tasks=tuple(spec.tasks), lengths=tuple(int(x) for x in spec.lengths), n=int(spec.n),
            tolerance=float(tol), alpha=float(spec.alpha), ladder=tuple(int(r) for r in spec.ladder) or None,
            seed0=int(spec.seed0), n_heldout=None if spec.n_heldout < 0 else int(spec.n_heldout),
            segment_len=int(spec.segment_len), batch_size=_rows(spec.batch_size),
            max_new_tokens=int(spec.max_new_tokens) or None, chat_template=spec.chat_template,
            fingerprint=spec.fingerprint or None, max_prompts=int(spec.max_prompts))
        tag = f"δ = {float(tol):g} ({i + 1}/{len(spec.tolerances)})"
        res = budget.find_budget(lm, bspec, store=memo, executor=ex,
                                 progress=lambda d, n, text, _t=tag: ctx.progress(d, n, f"{_t} · {text}"
                                                                                        f"{workers['text']}"))
        results.append(res)
        out.append(budget.summary(res, info))
    curve = budget.curve_frame(results, info)
    ctx.progress(1, 1, "done")
    return dict(budgets=out, curve=sweep.records(curve), model=info.to_dict(), model_name=spec.model,
                rmax=min(info.d_k, info.d_v), computed=memo.puts, seconds=round(time.time() - t0, 3),
                dtype=info.dtype, device=info.device, kernel_path=info.kernel_path, **_cluster_result(ex, workers))


def patch_tokens(res: dict) -> int:
    """Tokens a ``patch_prompts`` comparison ran through the model: A's and twice B's prompt with the three answers
    generated, then B and the scored continuation twice (when there is a loss)."""
    p, ans = res["prompt_tokens"], res["answers"]
    loss = 2 * (p["B"] + len(res["continuation"]["tokens"])) if res.get("loss") else 0
    return p["A"] + 2 * p["B"] + sum(len(a["tokens"]) for a in ans.values()) + loss


def run_patch_job(spec: PatchJob, ctx: JobContext) -> dict:
    from gdnviz import patching

    ctx.progress(0, 1, "loading the model")
    lm = ctx.model(spec)
    if lm.tokenizer is None:
        raise GDNVizError(f"{lm.info.path or lm.info.name} has no tokenizer: save the model's tokenizer beside it")
    L = int(spec.segment_len)
    if spec.task:
        ctx.progress(0, 1, f"generating a {spec.task} pair of {spec.target_len} tokens")
        pair = patching.needle_pair(lm.tokenizer, int(spec.target_len), int(spec.seed), spec.task,
                                    chat_template="auto" if spec.chat_template else False)
        x = patching.pair_inputs(pair, lm.tokenizer, L)
        texts = dict(A=pair.a.prompt, B=pair.b_prompt)
    else:
        texts = dict(A=check_text("prompt A", spec.prompt_a), B=check_text("prompt B", spec.prompt_b))
        a, b = tokenize(lm.tokenizer, texts["A"]), tokenize(lm.tokenizer, texts["B"])
        x = dict(a_ids=a, b_ids=b, boundary=patching.last_boundary(len(b), L), continuation=None, references=None,
                 meta={})
    heads = spec.heads if isinstance(spec.heads, str) else tuple(tuple(int(v) for v in lh) for lh in spec.heads)
    pspec = patching.PatchSpec(heads=heads, boundary=int(spec.boundary) or x["boundary"],
                               source=int(spec.source) or None, segment_len=L,
                               max_new_tokens=int(spec.max_new_tokens), fingerprint=spec.fingerprint or None)
    cont = (patching.continuation_ids(lm.tokenizer, spec.continuation) if spec.continuation else x["continuation"])
    t0 = time.perf_counter()
    res = patching.patch_prompts(lm, x["a_ids"], x["b_ids"], pspec, continuation=cont, references=x["references"],
                                 store=MemoMapping(ctx.store), progress=ctx.progress)
    if not res.get("memo_hit"):
        rates.record_job(MemoStore(MemoMapping(ctx.store)), lm.info, "patch", L, time.perf_counter() - t0,
                         patch_tokens(res))
    tok = lm.tokenizer
    res.update(meta=x["meta"], task=spec.task, kernel_path=lm.info.kernel_path,
               around={k: dict(before=tok.decode(ids[max(0, p - 48):p]), after=tok.decode(ids[p:p + 24]))
                       for k, ids, p in (("A", x["a_ids"], res["source"]), ("B", x["b_ids"], res["boundary"]))},
               continuation_text=tok.decode(res["continuation"]["tokens"]),
               prompt_chars={k: len(v) for k, v in texts.items()})
    return res


def run_holds_job(spec: HoldsJob, ctx: JobContext) -> dict:
    from gdnviz.attribution.holds import what_it_holds
    from gdnviz.attribution.inputs import check_head, check_position, head_inputs
    from gdnviz.errors import ModelMismatch
    from gdnviz.probes.memo import MemoStore

    L = int(spec.segment_len)
    key = holds_key(spec.doc_key, spec.layer, spec.head, spec.position, spec.top, L)
    memo = MemoStore(MemoMapping(ctx.store))
    hit = memo.get(key)
    if hit is not None:
        return dict(hit, memo_hit=True)
    ctx.progress(0, 3, "loading the model")
    lm = ctx.model(spec)
    info = lm.info
    (name, ids), = _tokenize_docs(lm, [tuple(spec.document)], None)
    got = capture_key(info.fingerprint, ids, L, info.dtype, info.memo_device)
    if got != spec.doc_key:
        raise ModelMismatch(f"'{name}' with {info.name} ({info.dtype} on {info.device}) is not the document the run "
                            "captured: the checkpoint or the text changed since. Capture the document set again.")
    check_head(info, int(spec.layer), int(spec.head))
    check_position(int(spec.position), len(ids))
    ctx.progress(1, 3, f"running the model over '{name}' ({len(ids):,} tokens) for layer {spec.layer} head "
                       f"{spec.head}'s q, k, v, g, β")
    inp = head_inputs(lm, ids, int(spec.layer), int(spec.head), len(ids), segment_len=L)
    ctx.progress(2, 3, f"decomposing the state after {int(spec.position):,} tokens (float64)")
    from gdnviz.attribution.exact_map import fast_path

    res = what_it_holds(inp, int(spec.position), L, int(spec.top), *fast_path(lm))
    tok = lm.tokenizer
    res.update(document=name, layer=int(spec.layer), head=int(spec.head), tokens=[tok.decode([i]) for i in ids],
               model=info.name, fingerprint=info.fingerprint, dtype=info.dtype, device=info.device,
               doc_key=spec.doc_key, memo_key=key, version=VERSIONS["holds"])
    memo.set(key, res)
    ctx.progress(3, 3, "done")
    return dict(res, memo_hit=False)


# --- AttnMapJob runner ----------------------------------------------------------------------------------------
def run_attnmap_job(spec: AttnMapJob, ctx: JobContext) -> dict:
    """Compute what is not yet in the memo of the two maps (``attnmap_keys``): every request is checked (head,
    layers, window against the document and ``MAX_STORED_MAP_BYTES``) before the model runs. The GDN map is computed
    by ``exact_map.weights`` on ``exact_map.fast_path(lm)`` (its meta's ``output_check``: ‖w v − o‖_F / ‖o‖_F over
    the window, o the float64 reference recurrence's outputs), the softmax weights by ``softmax_map``. Returns the
    keys, the window, the seconds each part took and ``memo_hit`` (both parts were stored)."""
    from gdnviz.attribution import recurrence
    from gdnviz.attribution.exact_map import check_window, fast_path, weights
    from gdnviz.attribution.inputs import check_head, head_inputs
    from gdnviz.attribution.softmax_map import check_attention_layer, num_heads, softmax_weights
    from gdnviz.errors import HeadOutOfRange, ModelMismatch

    L, start, end = int(spec.segment_len), spec.start, spec.end
    al, ah = spec.attn_layer, spec.attn_head
    gkey, skey = attnmap_keys(spec.doc_key, spec.layer, spec.head, start, end, al, ah)
    todo = [k for k in (gkey, skey) if k is not None and not ctx.store.memo_has(k)]
    out = dict(gdn_key=gkey, softmax_key=skey, start=start, end=end, layer=spec.layer, head=spec.head,
               attn_layer=al, attn_head=ah, seconds={})
    if not todo:
        return dict(out, memo_hit=True)
    ctx.progress(0, 3, "loading the model")
    lm = ctx.model(spec)
    info = lm.info
    (name, ids), = _tokenize_docs(lm, [tuple(spec.document)], None)
    if capture_key(info.fingerprint, ids, L, info.dtype, info.memo_device) != spec.doc_key:
        raise ModelMismatch(f"'{name}' with {info.name} ({info.dtype} on {info.device}) is not the document the run "
                            "captured: the checkpoint or the text changed since. Capture the document set again.")
    check_head(info, spec.layer, spec.head)
    check_window(start, end, len(ids), MAX_STORED_MAP_BYTES)
    if al is not None:
        check_attention_layer(info, al)
        H = num_heads(lm, al)
        if ah is not None and (isinstance(ah, bool) or not isinstance(ah, int) or not 0 <= ah < H):
            raise HeadOutOfRange(f"attention head {ah!r} is out of range: layer {al} has query heads 0..{H - 1}")
    tok = lm.tokenizer
    meta = dict(document=name, T=len(ids), start=start, end=end, model=info.name, fingerprint=info.fingerprint,
                dtype=info.dtype, device=info.device, doc_key=spec.doc_key)
    if gkey in todo:
        ctx.progress(1, 3, f"running the model over '{name}' (the first {end:,} tokens) for layer {spec.layer} head "
                           f"{spec.head}'s q, k, v, g, β, then its exact map of {end - start:,} queries")
        t0 = time.perf_counter()
        inp = head_inputs(lm, ids, spec.layer, spec.head, end, segment_len=L)
        dev, dt = fast_path(lm)
        w = weights(inp, start, end, dev, dt).cpu().numpy()
        o = recurrence.outputs(inp, end)[start:end].numpy()   # the float64 reference recurrence's outputs
        check = float(np.linalg.norm(w @ inp.v.numpy() - o) / max(np.linalg.norm(o), 1e-300))
        out["seconds"]["gdn"] = time.perf_counter() - t0
        ctx.store.memo_put(gkey, pack_map(w, dict(meta, kind="gdn", layer=spec.layer, head=spec.head,
                                                  map_device=str(dev), map_dtype=str(dt).replace("torch.", ""),
                                                  output_check=check,
                                                  tokens=[tok.decode([i]) for i in ids[:end]])))
    if skey in todo:
        ctx.progress(2, 3, f"running the model for the softmax weights of attention layer {al}")
        t0 = time.perf_counter()
        p = softmax_weights(lm, ids, al, start, end, ah).numpy()
        out["seconds"]["softmax"] = time.perf_counter() - t0
        ctx.store.memo_put(skey, pack_map(p, dict(meta, kind="softmax", layer=al, head=ah, heads=H)))
    ctx.progress(3, 3, "done")
    return dict(out, memo_hit=False)
# --- end AttnMapJob runner -------------------------------------------------------------------------------------


# --- reading results back (app side, no torch) -----------------------------------------------------------------
class MissingResult(GDNVizError):
    """A stored result is missing or failed its checksum (it was deleted and must be recomputed)."""

    def __init__(self, message: str, missing: list | None = None):
        super().__init__(message)
        self.missing = missing or []


def load_run_captures(store: Store, run: dict) -> list:
    """CaptureResults of a run's documents, in order; ``MissingResult`` naming the documents whose stored capture
    is gone or corrupt (the corrupt entries are deleted by the store)."""
    from gdnviz.capture import CaptureResult

    caps, missing = [], []
    for d in run["documents"]:
        data = store.memo_get(d["key"])
        if data is None:
            missing.append(d["name"])
            continue
        try:
            caps.append(CaptureResult.from_bytes(data))
        except Exception:  # intact bytes this version cannot read: recompute (the new result overwrites them)
            missing.append(d["name"])
    if missing:
        raise MissingResult(f"the stored capture of {', '.join(repr(m) for m in missing)} is missing or corrupt",
                            missing)
    return caps


def _rows(batch_size) -> int | None:
    """A job's batch size as the sweeps take it: an int, or None (chosen from free memory)."""
    return None if batch_size is None else int(batch_size)
