"""Command line: ``gdnviz capture``, ``gdnviz inspect`` (and ``python -m gdnviz ...``).

    gdnviz inspect MODEL
    gdnviz capture MODEL DOC.txt [DOC2.txt ...] --out runs/ [--segment-len 256] [--device auto] [--dtype auto]
                   [--device-map auto|JSON|FILE.json]
    gdnviz sweep MODEL --tasks niah_single_1,vt --lengths 1024,2048 [--ranks 1,4,12,32,128] [--n 20] --out DIR
                 [--heads all|L:H,...|layers:0,1] [--batch N] [--segment-len 256] [--device] [--dtype]
                 [--via-worker [--cache-dir DIR] | --cluster local|tcp://HOST:PORT [--workers N]]
    gdnviz loss MODEL DOC.txt [DOC2.txt ...] [--ranks 1,4,12,32] --out DIR [--heads ...] [--min-distance 512]
                [--segment-len 256] [--cluster local|tcp://HOST:PORT [--workers N]]
    gdnviz scan MODEL --task T --length L --n N --by layer|head --r R [--keep] [--layers 0,1] [--out DIR]
                [--memo DIR] [--max-prompts 2000] [--cluster local|tcp://HOST:PORT [--workers N]]
    gdnviz budget MODEL --tasks T1,T2 --lengths L --n N --tolerance D [--ladder 32,12,4,1] [--curve 2,5]
                  [--out DIR] [--memo DIR] [--max-prompts 2000] [--cluster local|tcp://HOST:PORT [--workers N]]
    gdnviz attribute MODEL DOC.txt --layer L --head H [--position P] [--start 0] [--top 4] --out DIR
    gdnviz patch MODEL (A.txt B.txt | --needle niah_single_1 --length 1024 [--seed0 0] [--n 1]) [--heads all]
                 [--boundary P] [--source P] [--continuation TEXT] [--max-new-tokens 32] --out DIR [--memo DIR]

``scan`` (``gdnviz.probes.scan``) writes scan.csv (layer, head, r, n, score, baseline, delta, se; head empty for a
layer row), heatmap.png and settings.json; ``budget`` (``gdnviz.probes.budget``) writes budget.csv (layer, head, r),
rank_map.json (for the app's Sweeps page and ``--rank-map``), summary.json, and with ``--curve`` curve.csv and
curve.png (score vs state memory over the tolerances). Both memoise every answer in --memo (default DIR/cache):
point several runs at one memo to share answers, and a rerun resumes. Both print what they will run first and
refuse more new answers than --max-prompts.

``sweep`` (``gdnviz.probes.sweep``) writes rows.csv, table.csv, figure.png and settings.json and memoises every
sample in DIR/cache, so running it again resumes where it stopped (with ``--via-worker`` it runs in the app's
worker and memoises in the app's store instead, so the app's Sweeps page and the CLI share finished samples);
``loss`` (``gdnviz.probes.loss_sweep``) writes loss.csv (per setting, r and subset: all predictions and both copy
subsets), loss_documents.csv, figure.png and settings.json and memoises every (document, setting) in DIR/cache.
With ``--cluster`` (``sweep``, ``scan``, ``budget``, ``loss``) a Dask cluster's workers answer and this process alone
writes the memo, then prints the answers per worker (docs/cluster.md).

``attribute`` (``gdnviz.attribution``) writes contributions.csv (one row per token: position, token text, norm,
share along the state's top singular directions) and attribution.json (the singular values, the carried-in term's
shares, the settings) for one head's state after P tokens (default: the whole document).

``patch`` (``gdnviz.patching``) runs prompt B with the chosen heads' states at one boundary replaced by prompt A's
and writes comparison.csv (per pair, one row per run A, B, B patched: answer, score, continuation loss and its
change), states.csv (per pair and patched head, the relative size of the replacement) and patch.json (the full
results); with ``--needle`` the pairs are RULER needle prompts and their needle-free twins, the boundary defaults to
the last one before B's question and the continuation to the needle value. Memoised in --memo (default DIR/cache).

``capture`` writes one ``<doc>.capture.npz`` per document (``gdnviz.capture.CaptureResult.save``) and a
``summary.csv`` with every head's statistics (median and min–max over the documents), with a progress bar.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gdnviz.errors import GDNVizError


def _progress(desc: str, total: int):
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="layer", file=sys.stderr, leave=False)

    def update(done, n):
        bar.total = n
        bar.n = done
        bar.refresh()
        if done >= n:
            bar.close()

    return update


def cmd_inspect(args) -> int:
    from gdnviz.models import inspect_model

    print(json.dumps(inspect_model(args.model, trust_remote_code=args.trust_remote_code), indent=2, default=str))
    return 0


def _write_capture_outputs(out: Path, captures, segment_len: int) -> None:
    from gdnviz import summary

    table = summary.document_set_table(captures)
    table.to_csv(out / "summary.csv", index=False)
    ov = summary.overview(table, segment_len)
    (out / "overview.json").write_text(json.dumps(ov, indent=2))
    print(json.dumps(ov, indent=2))


def _run_via_worker(spec, cache_dir, label: str, desc: str, unit: str) -> tuple:
    """Submit a job spec to the app's worker through the shared store (starting a worker that exits when idle if
    none is alive on that store), show a progress bar until it ends; returns (store, done job record). Ctrl-C
    cancels the job through the store, as the app's Cancel does, and waits for its answer (at most the worker's
    ``CANCEL_GRACE`` and a few beats; a second Ctrl-C stops waiting); a sweep keeps its finished samples. A failed
    or cancelled job raises GDNVizError (also when the worker exited to stop it: it answered it first)."""
    import signal
    import subprocess
    import threading
    import time

    from tqdm import tqdm

    from gdnviz.jobs import spec_to_dict
    from gdnviz.store import HEARTBEAT_EVERY, Store
    from gdnviz.worker import CANCEL_GRACE

    store = Store(cache_dir)
    jid = store.submit(spec.kind, spec_to_dict(spec), label=label)
    proc = None
    if not store.live_workers():
        cmd = [sys.executable, "-m", "gdnviz.worker", "--exit-when-idle"]
        if cache_dir:
            cmd += ["--cache-dir", str(cache_dir)]
        proc = subprocess.Popen(cmd, start_new_session=True)  # Ctrl-C here cancels through the store, not by signal
    bar = tqdm(total=1, desc=desc, unit=unit, file=sys.stderr, leave=False)
    # Ctrl-C only sets a flag: a KeyboardInterrupt raised inside the store's SQLite calls or tqdm's lock could leave
    # either held and hang the cancel below
    hits: list[int] = []
    main = threading.current_thread() is threading.main_thread()
    prev = signal.signal(signal.SIGINT, lambda *_: hits.append(1)) if main else None
    try:
        while not hits:
            rec = store.job(jid)
            prog = rec.get("progress") or {}
            if prog.get("total"):
                bar.total, bar.n = prog["total"], prog.get("done", 0)
                bar.set_postfix_str(str(prog.get("text", ""))[:60], refresh=False)
                bar.refresh()
            if rec["status"] in ("done", "failed", "cancelled"):
                break
            if proc is not None and proc.poll() is not None and store.job(jid)["status"] not in ("done", "failed",
                                                                                                 "cancelled"):
                raise GDNVizError(f"the worker exited (code {proc.returncode}) before finishing the job; see "
                                  f"{store.log_path}")
            time.sleep(0.2)
        if hits:
            store.cancel(jid)
            bar.close()
            print(f"interrupted: cancelling job {jid} ...", file=sys.stderr)
            n, t0 = len(hits), time.time()
            while (rec := store.job(jid))["status"] not in ("done", "failed", "cancelled"):
                if len(hits) > n or time.time() - t0 > CANCEL_GRACE + 3 * HEARTBEAT_EVERY + 5:
                    raise GDNVizError(f"interrupted: asked the worker to cancel job {jid}; it has not answered yet "
                                      f"(see {store.log_path})")
                time.sleep(0.1)
    finally:
        bar.close()
        if prev is not None:
            signal.signal(signal.SIGINT, prev)
    if rec["status"] != "done":
        what = f"{rec.get('error_type')}: " if rec.get("error_type") else ""
        raise GDNVizError(f"{spec.kind} {rec['status']}: {what}{rec.get('error')}")
    return store, rec


def cmd_capture_via_worker(args) -> int:
    """Submit the capture to the app's worker through the shared store (the run then appears in the app's
    previous runs); start a worker that exits when idle if none is alive."""
    from gdnviz.documents import read_text_file
    from gdnviz.jobs import CaptureJob, load_run_captures

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    docs = tuple((Path(d).name, read_text_file(d)) for d in args.documents)
    spec = CaptureJob(model=args.model, documents=docs, segment_len=args.segment_len, device=args.device,
                      dtype=args.dtype, device_map=_device_map_text(args), max_tokens=args.max_tokens or 1 << 40)
    store, rec = _run_via_worker(spec, args.cache_dir, f"cli capture ({len(docs)} documents)",
                                 "capture (via worker)", "layer")
    run = store.run(rec["result"]["run_id"])
    captures = load_run_captures(store, run)
    for cap in captures:
        path = cap.save(out / f"{Path(cap.meta['name']).stem}.capture.npz")
        print(f"{cap.meta['name']}: {cap.n_tokens} tokens -> {path}", file=sys.stderr)
    print(f"run {run['run_id']} (also in the app's previous runs; cache {store.dir})", file=sys.stderr)
    _write_capture_outputs(out, captures, args.segment_len)
    return 0


def cmd_capture(args) -> int:
    if args.via_worker:
        return cmd_capture_via_worker(args)
    from gdnviz.capture import capture_document
    from gdnviz.documents import read_text_file
    from gdnviz.models import load

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lm = load(args.model, device=args.device, dtype=args.dtype, trust_remote_code=args.trust_remote_code,
              device_map=_device_map(args))
    if lm.tokenizer is None:
        raise GDNVizError(f"{lm.info.path} has no tokenizer files: gdnviz needs one to tokenize documents")
    info = lm.info
    print(f"{info.family}: {len(info.gdn_layers)} GDN layers x {info.num_heads} heads of {info.d_k}x{info.d_v}, "
          f"kernels: {info.kernel_path}, {info.device} {info.dtype}"
          + (f" (device_map over {', '.join(sorted({d for _, d in info.device_map}))})" if info.device_map else ""),
          file=sys.stderr)
    captures = []
    for doc in args.documents:
        text = read_text_file(doc)
        ids = lm.tokenizer(text)["input_ids"]  # the tokenizer's own special tokens, as the app tokenizes
        if args.max_tokens and len(ids) > args.max_tokens:
            from gdnviz.errors import DocumentTooLong

            raise DocumentTooLong(f"{doc}: {len(ids)} tokens, over the limit of {args.max_tokens} (--max-tokens)")
        cap = capture_document(lm, ids, args.segment_len, name=Path(doc).name,
                               progress=_progress(Path(doc).name, len(info.gdn_layers)))
        path = cap.save(out / f"{Path(doc).stem}.capture.npz")
        print(f"{doc}: {len(ids)} tokens, {len(cap.positions)} boundaries, {cap.meta['seconds']:.2f} s -> {path} "
              f"({path.stat().st_size / 2**20:.1f} MiB)", file=sys.stderr)
        captures.append(cap)
    _write_capture_outputs(out, captures, args.segment_len)
    return 0


DEVICE_MAP_HELP = ("place the model's modules like transformers' device_map: 'auto' (over the visible GPUs' memory), "
                   "a JSON object {\"module name\": \"cuda:0\" | \"cpu\", ...} or a .json file holding one; "
                   "leave --device at auto (default: the whole model on --device)")


def _device_map(args):
    """--device-map as ``load`` takes it: None, "auto", or the dict of the JSON text or file."""
    from gdnviz.models import placement

    text = getattr(args, "device_map", "") or ""
    if text and text.strip() != "auto" and not text.lstrip().startswith("{"):
        path = Path(text)
        if not path.is_file():
            raise GDNVizError(f"--device-map {text!r}: not 'auto', not a JSON object, and no such file")
        text = path.read_text()
    return placement.parse(text)


def _device_map_text(args) -> str:
    """--device-map as a job spec holds it: "", "auto" or canonical JSON."""
    from gdnviz.models import placement

    dmap = _device_map(args)
    return dmap if isinstance(dmap, str) else placement.text(dmap)


def _int_list(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise GDNVizError(f"--{what} must be comma-separated integers, got {text!r}") from None


def _load_for_probe(args):
    from gdnviz.models import load

    lm = load(args.model, device=args.device, dtype=args.dtype, trust_remote_code=args.trust_remote_code,
              device_map=_device_map(args))
    if lm.tokenizer is None:
        raise GDNVizError(f"{lm.info.path} has no tokenizer files: gdnviz needs one to build prompts")
    return lm


CLUSTER_HELP = ("answer on a Dask cluster: 'local' (one worker process per GPU; CPU: --workers processes) or a "
                "scheduler address tcp://HOST:PORT (or a scheduler file .json)")


def _cluster_args(sp) -> None:
    """--cluster and --workers, the same on every probe that runs on a Dask cluster."""
    sp.add_argument("--cluster", default="", help=CLUSTER_HELP)
    sp.add_argument("--workers", type=int, default=2, help="CPU worker processes of --cluster local without GPUs")


def _model_or_cluster(args, what: str) -> tuple:
    """(lm, executor) of a probe: with --cluster, the cluster's ``gdnviz.cluster.ClusterExecutor`` and its model view
    (this process loads only the tokenizer); without, the model loaded here and None."""
    if not args.cluster:
        return _load_for_probe(args), None
    from gdnviz import cluster

    if args.device_map:
        raise GDNVizError("--device-map and --cluster exclude each other: the cluster's workers each hold the "
                          "whole model on one GPU; a spread model answers in this process")
    ex = cluster.executor(args.cluster, args.model, args.device, args.dtype, args.trust_remote_code,
                          workers=args.workers)
    print(f"{what} on the Dask cluster {args.cluster}: {len(ex.workers)} workers", file=sys.stderr)
    return ex.model_view(), ex


def _print_per_worker(ex, unit: str = "samples") -> None:
    """The answers each cluster worker gave (nothing without a cluster)."""
    if ex is not None:
        print(f"{unit} answered per worker: " + (", ".join(f"{a} {n}" for a, n in sorted(ex.per_worker.items()))
                                                 or "none (all from the memo)"), file=sys.stderr)


def _sweep_args(args) -> dict:
    """The sweep settings of the command line (both paths), validated as far as possible without the model."""
    rank_maps = []
    for item in args.rank_map or []:
        name, _, body = item.partition("=")
        try:
            rank_maps.append((name, tuple((int(l), int(h), int(r)) for l, h, r in (x.split(":")
                                                                                  for x in body.split(",")))))
        except ValueError:
            raise GDNVizError(f"--rank-map {item!r}: expected NAME=layer:head:r,layer:head:r") from None
    try:
        chat_kwargs = tuple(sorted(json.loads(args.chat_kwargs).items())) if args.chat_kwargs else ()
    except (ValueError, AttributeError):
        raise GDNVizError(f"--chat-kwargs must be a JSON object, got {args.chat_kwargs!r}") from None
    return dict(model=args.model, tasks=tuple(t for t in args.tasks.split(",") if t),
                lengths=tuple(_int_list(args.lengths, "lengths")),
                ranks=tuple(_int_list(args.ranks, "ranks")) if args.ranks else (), n=args.n, seed0=args.seed0,
                heads=args.heads, rank_maps=tuple(rank_maps), segment_len=args.segment_len, batch_size=args.batch,
                max_new_tokens=args.max_new_tokens or 0,
                chat_template={"auto": "auto", "on": True, "off": False}[args.chat], chat_template_kwargs=chat_kwargs)


def _write_sweep_outputs(out: Path, rows, table, settings: dict, model_name: str) -> None:
    """rows.csv, table.csv, figure.png, settings.json (the same files on both paths); prints the table."""
    from gdnviz.probes import sweep

    (out / "settings.json").write_text(json.dumps(settings, indent=2, default=str))
    sweep.to_csv(rows, out / "rows.csv")
    sweep.to_csv(table, out / "table.csv")
    try:
        sweep.sweep_figure(table, title=f"{model_name}: RULER score vs rank").save(str(out / "figure.png"))
    except ImportError as e:  # altair / vl-convert absent (e.g. a bare GPU image): the CSVs are the result
        print(f"figure.png not written ({e}); rows.csv and table.csv are complete.", file=sys.stderr)
    print(table.to_string(index=False))


def cmd_sweep_via_worker(args) -> int:
    """Submit the sweep to the app's worker through the shared store: its samples are memoised there (a rerun,
    from here or from the app's Sweeps page, resumes), and the job shows up in the app's worker queue."""
    from gdnviz.jobs import SweepJob
    from gdnviz.probes import sweep

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = SweepJob(device=args.device, dtype=args.dtype, device_map=_device_map_text(args), **_sweep_args(args))
    store, rec = _run_via_worker(spec, args.cache_dir, f"cli sweep ({len(spec.tasks)} tasks x "
                                 f"{len(spec.lengths)} lengths)", "sweep (via worker)", "sample")
    res = rec["result"]
    print(f"sweep: {res['computed']:,} samples computed, {res['reused']:,} from the memo (cache {store.dir})",
          file=sys.stderr)
    _write_sweep_outputs(out, sweep.rows_frame(res["rows"]), sweep.table_frame(res["table"]),
                         dict(spec=res["settings"], model=res["model"], version=res["version"]),
                         res["model"]["name"])
    return 0


def cmd_sweep(args) -> int:
    if args.via_worker:
        if args.cluster:
            raise GDNVizError("--via-worker and --cluster exclude each other: the app's worker answers on this "
                              "machine; --cluster answers on the cluster's workers")
        return cmd_sweep_via_worker(args)
    from tqdm import tqdm

    from gdnviz.jobs import SweepJob, sweep_spec_of
    from gdnviz.probes import rates, sweep

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sa = _sweep_args(args)
    lm, ex = _model_or_cluster(args, "sweep")
    spec = sweep_spec_of(SweepJob(fingerprint=lm.info.fingerprint, **sa))
    settings = dict(spec=spec.to_dict(), model=lm.info.to_dict(), version=sweep.VERSION)
    (out / "settings.json").write_text(json.dumps(settings, indent=2, default=str))
    plan = sweep.plan_from_keys(lm.info, sweep.cell_keys(lm.info, lm.tokenizer, spec), spec.segment_len, out / "cache",
                                batch_size=spec.batch_size)
    print(f"sweep: {plan['answers']:,} answers, {plan['cached']:,} in the memo, {plan['to_run']:,} to run; "
          f"{rates.eta_text(plan, plan['to_run'])}", file=sys.stderr)
    bar = tqdm(total=1, desc="sweep", unit="sample", file=sys.stderr)

    def progress(done, total):
        bar.total, bar.n = total, done
        bar.refresh()

    try:
        rows = sweep.run_sweep(lm, spec, store=out / "cache", progress=progress, executor=ex)
    finally:
        bar.close()
    _print_per_worker(ex)
    table = sweep.sweep_table(rows, rmax=min(lm.info.d_k, lm.info.d_v))
    _write_sweep_outputs(out, rows, table, settings, lm.info.name)
    return 0


class _CountingMemo:
    """A diskcache directory as the mapping ``run_loss_sweep`` memoises in; counts the entries it computed."""

    def __init__(self, directory: Path):
        import diskcache

        self.cache, self.puts = diskcache.Cache(str(directory)), 0

    def get(self, key):
        return self.cache.get(key)

    def __setitem__(self, key, value):
        self.cache[key] = value
        self.puts += 1


def cmd_loss(args) -> int:
    """loss.csv (seed 000's table in long form, one row per setting, r and subset), loss_documents.csv (one row
    per document and setting), figure.png, settings.json; the per-document losses are memoised in DIR/cache, so
    running it again resumes (and a new --min-distance or head set reuses the untouched losses)."""
    from gdnviz.documents import read_text_file, tokenize
    from gdnviz.errors import EmptyDocumentSet
    from gdnviz.probes import loss_sweep, sweep

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.documents:
        raise EmptyDocumentSet("loss vs rank needs at least one document file")
    texts = [(Path(d).name, read_text_file(d)) for d in args.documents]
    lm, ex = _model_or_cluster(args, "loss")
    spec = loss_sweep.LossSweepSpec(model=args.model, ranks=tuple(_int_list(args.ranks, "ranks")) or None,
                                    heads=args.heads, segment_len=args.segment_len, min_distance=args.min_distance,
                                    fingerprint=lm.info.fingerprint)
    docs = [(name, tokenize(lm.tokenizer, text)) for name, text in texts]
    memo = _CountingMemo(out / "cache")
    n_set = len(sweep.resolve_ranks(spec.ranks, min(lm.info.d_k, lm.info.d_v)))
    try:
        rows = loss_sweep.run_loss_sweep(lm, docs, spec, store=memo,
                                         progress=_progress("loss (document x setting)", n_set * len(docs)),
                                         executor=ex)
    finally:
        memo.cache.close()
    _print_per_worker(ex, "(document, setting) runs")
    table = loss_sweep.loss_table(rows, rmax=min(lm.info.d_k, lm.info.d_v))
    print(f"loss: {memo.puts} (document, setting) runs computed, {len(rows) - memo.puts} from the memo "
          f"({out / 'cache'})", file=sys.stderr)
    table.to_csv(out / "loss.csv", index=False)
    rows.to_csv(out / "loss_documents.csv", index=False)
    (out / "settings.json").write_text(json.dumps(dict(
        spec=spec.to_dict(), model=lm.info.to_dict(), documents=[dict(file=str(d), tokens=len(ids)) for d, (_, ids)
                                                                 in zip(args.documents, docs)],
        version=loss_sweep.VERSION), indent=2, default=str))
    try:
        loss_sweep.loss_figure(table, title=f"{lm.info.name}: next-token loss vs rank",
                               min_distance=args.min_distance).save(str(out / "figure.png"))
    except ImportError as e:  # altair / vl-convert absent (e.g. a bare GPU image): the CSVs are the result
        print(f"figure.png not written ({e}); loss.csv is complete.", file=sys.stderr)
    print(table.to_string(index=False))
    return 0


def _checked(fn):
    """Run ``fn`` with the library's ValueErrors (bad settings) reported as GDNVizError (one line, no traceback)."""
    try:
        return fn()
    except ValueError as e:
        raise GDNVizError(str(e)) from None


def _common_probe(args) -> dict:
    return dict(model=args.model, segment_len=args.segment_len, batch_size=args.batch,
                max_new_tokens=args.max_new_tokens or None,
                chat_template={"auto": "auto", "on": True, "off": False}[args.chat], max_prompts=args.max_prompts)


def cmd_scan(args) -> int:
    from tqdm import tqdm

    from gdnviz import figures as F
    from gdnviz.probes import rates, scan, sweep

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    memo = Path(args.memo) if args.memo else out / "cache"
    lm, ex = _model_or_cluster(args, "scan")
    layers = tuple(_int_list(args.layers, "layers")) if args.layers else None
    spec = scan.ScanSpec(task=args.task, length=args.length, r=args.r, by=args.by, keep=args.keep, layers=layers,
                         n=args.n, seed0=args.seed0, fingerprint=lm.info.fingerprint, **_common_probe(args))
    plan = _checked(lambda: scan.plan_scan(lm.info, lm.tokenizer, spec, memo))
    print(f"scan: {plan['units']} units, {plan['settings']} settings x {spec.n} samples = {plan['answers']:,} "
          f"answers, {plan['cached']:,} in the memo, {plan['to_run']:,} to run; {rates.eta_text(plan, plan['to_run'])}",
          file=sys.stderr)
    bar = tqdm(total=1, desc="scan", unit="answer", file=sys.stderr)

    def progress(done, total):
        bar.total, bar.n = total, done
        bar.refresh()

    try:
        res = _checked(lambda: scan.run_scan(lm, spec, store=memo, progress=progress, executor=ex))
    finally:
        bar.close()
    _print_per_worker(ex)
    sweep.to_csv(res.table, out / "scan.csv")
    settings = dict(spec=spec.to_dict(), model=lm.info.to_dict(), untouched=res.untouched, all_cut=res.all_cut,
                    computed=res.computed, seconds=round(res.seconds, 3), plan=plan, memo=str(memo))
    (out / "settings.json").write_text(json.dumps(settings, indent=2, default=str))
    what = "kept whole, every other head at" if spec.keep else "cut to"
    title = f"{lm.info.name}: {spec.task} @ {spec.length:,} tokens, one {spec.by} {what} r = {spec.r}"
    try:
        F.scan_heatmap(F.scan_heatmap_frame(res.table, lm.info.gdn_layers, lm.info.num_heads), keep=spec.keep,
                       title=title, interactive=False).save(str(out / "heatmap.png"))
    except ImportError as e:
        print(f"heatmap.png not written ({e}); scan.csv is complete.", file=sys.stderr)
    base = f"all heads at r = {spec.r}: {res.all_cut:.1f}; " if spec.keep else ""
    print(f"untouched: {res.untouched:.1f}; {base}{res.computed:,} answers generated, {res.seconds:,.0f} s",
          file=sys.stderr)
    print(scan.ranked(res.table, spec.keep).to_string(index=False))
    return 0


def cmd_budget(args) -> int:
    from tqdm import tqdm

    from gdnviz.probes import budget, rates, sweep

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    memo = Path(args.memo) if args.memo else out / "cache"
    lm, ex = _model_or_cluster(args, "budget")
    kw = dict(tasks=tuple(t for t in args.tasks.split(",") if t), lengths=tuple(_int_list(args.lengths, "lengths")),
              n=args.n, alpha=args.alpha, ladder=tuple(_int_list(args.ladder, "ladder")) or None, seed0=args.seed0,
              heldout_seed0=args.heldout_seed0, n_heldout=args.n_heldout, state_dtype=args.state_dtype,
              fingerprint=lm.info.fingerprint, **_common_probe(args))
    tolerances = [args.tolerance] + [float(x) for x in args.curve.split(",") if x.strip()] if args.curve else \
        [args.tolerance]
    results = []
    for tol in tolerances:
        spec = budget.BudgetSpec(tolerance=tol, **kw)
        plan = _checked(lambda: budget.plan_budget(lm.info, lm.tokenizer, spec, memo))
        print(f"budget δ = {tol:g}: scans {plan['scan_answers']:,} answers ({plan['scan_cached']:,} in the memo), "
              f"search at most {plan['search_max']:,}, held-out {plan['heldout_answers']:,} "
              f"({plan['heldout_cached']:,} in the memo): at most {plan['max_to_run']:,} to run; "
              f"{rates.eta_text(plan, plan['max_to_run'])}", file=sys.stderr)
        print(budget.acceptance_text(spec.tasks, spec.n, tol, spec.alpha), file=sys.stderr)
        bar = tqdm(total=1, desc=f"budget δ = {tol:g}", unit="answer", file=sys.stderr)

        def progress(done, total, text, _bar=bar):
            _bar.total, _bar.n = total, done
            _bar.set_postfix_str(text[:60], refresh=False)
            _bar.refresh()

        try:
            results.append(_checked(lambda: budget.find_budget(lm, spec, store=memo, progress=progress,
                                                               executor=ex)))
        finally:
            bar.close()
    _print_per_worker(ex)
    res = results[0]
    budget.budget_table(res, lm.info).to_csv(out / "budget.csv", index=False)
    summ = budget.summary(res, lm.info)
    (out / "summary.json").write_text(json.dumps(summ, indent=2, default=str))
    (out / "rank_map.json").write_text(budget.rank_map_json(res.ranks, lm.info, tolerance=res.spec.tolerance,
                                                            tasks=list(res.spec.tasks),
                                                            lengths=list(res.spec.lengths), n=res.spec.n))
    if len(results) > 1:
        curve = budget.curve_frame(results, lm.info)
        sweep.to_csv(curve, out / "curve.csv")
        try:
            budget.curve_figure(curve, title=f"{lm.info.name}: score vs recurrent-state memory").save(
                str(out / "curve.png"))
        except ImportError as e:
            print(f"curve.png not written ({e}); curve.csv is complete.", file=sys.stderr)
    full, bud = summ["state_bytes_full"], summ["state_bytes_budget"]
    print(f"state per sequence: {full / 1024:,.1f} KiB full, {bud / 1024:,.1f} KiB with the budget "
          f"({100 * (1 - bud / full):.1f}% saved; {summ['state_dtype']})")
    for which in ("tasks", "heldout"):
        for k, x in summ[which].items():
            print(f"{'search' if which == 'tasks' else 'held-out'} {k}: untouched {x['untouched']:.1f}, budget "
                  f"{x['score']:.1f} (Δ {x['delta']:+.1f} ± {x['se']:.1f}, bound {x['bound']:+.1f}, "
                  f"{'pass' if x['passed'] else 'FAIL'})")
    print(budget.budget_table(res, lm.info).to_string(index=False))
    return 0


def _probe_args(sp) -> None:
    sp.add_argument("--n", type=int, default=20, help="samples per task and length")
    sp.add_argument("--seed0", type=int, default=0)
    sp.add_argument("--out", default="gdnviz-out", help="output folder")
    sp.add_argument("--memo", default=None, help="memo directory (default OUT/cache); share one between runs")
    sp.add_argument("--max-prompts", type=int, default=2000, help="refuse more new answers than this")
    sp.add_argument("--batch", type=int, default=None,
                    help="samples per forward (default: from free GPU memory and prompt length; 8 on CPU)")
    sp.add_argument("--max-new-tokens", type=int, default=0, help="0 = RULER's per task")
    sp.add_argument("--chat", choices=["auto", "on", "off"], default="auto", help="wrap prompts in the chat template")
    _cluster_args(sp)
    sp.add_argument("--segment-len", type=int, default=256)
    sp.add_argument("--device", default="auto")
    sp.add_argument("--device-map", default="", help=DEVICE_MAP_HELP)
    sp.add_argument("--dtype", default="auto")


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return n


def cmd_attribute(args) -> int:
    """contributions.csv and attribution.json (module docstring), float64 on the CPU from the model's run."""
    from gdnviz import attribution
    from gdnviz.documents import read_text_file, tokenize
    from gdnviz.models import load

    text = read_text_file(args.document)
    lm = load(args.model, device=args.device, dtype=args.dtype, trust_remote_code=args.trust_remote_code,
              device_map=_device_map(args))
    ids = tokenize(lm.tokenizer, text)
    position = len(ids) if args.position is None else args.position
    c = attribution.state_contributions(lm, ids, args.layer, args.head, position, start=args.start)
    table, summary = attribution.contributions_table(c, [lm.tokenizer.decode([i]) for i in ids], args.top)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "contributions.csv", index=False)
    (out / "attribution.json").write_text(json.dumps(dict(
        summary, model=lm.info.name, document=str(args.document), tokens=len(ids), layer=args.layer,
        head=args.head, residual=float((c.total() - c.state).norm() / max(float(c.state.norm()), 1e-300))),
        indent=2))
    best = table.reindex(table["norm"].sort_values(ascending=False).index).head(10)
    print(f"layer {args.layer} head {args.head}, state after {position} of {len(ids)} tokens: "
          f"‖S‖ = {summary['state_norm']:.4g}; the 10 largest contributions:", file=sys.stderr)
    print(best[["position", "token", "norm"]].to_string(index=False))
    return 0


def _patch_pairs(args, lm):
    """[(name, inputs)] of the command line: the two files, or ``--n`` needle pairs (``patching.pair_inputs``)."""
    from gdnviz import patching
    from gdnviz.documents import read_text_file, tokenize

    if args.needle:
        if args.prompts:
            raise GDNVizError("give either two prompt files A B or --needle TASK, not both")
        chat = {"auto": "auto", "on": True, "off": False}[args.chat]
        return [(f"seed {s}", patching.pair_inputs(patching.needle_pair(lm.tokenizer, args.length, s, args.needle,
                                                                        chat_template=chat),
                                                   lm.tokenizer, args.segment_len))
                for s in range(args.seed0, args.seed0 + args.n)]
    if len(args.prompts) != 2:
        raise GDNVizError(f"give two prompt files, A (the donor) and B, or --needle TASK; got {len(args.prompts)}")
    a, b = (tokenize(lm.tokenizer, read_text_file(f)) for f in args.prompts)
    return [(f"{Path(args.prompts[0]).name} -> {Path(args.prompts[1]).name}",
             dict(a_ids=a, b_ids=b, boundary=patching.last_boundary(len(b), args.segment_len), continuation=None,
                  references=None, meta={}))]


def cmd_patch(args) -> int:
    """comparison.csv, states.csv, patch.json (module docstring)."""
    import pandas as pd

    from gdnviz import patching

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lm = _load_for_probe(args)
    memo = Path(args.memo) if args.memo else out / "cache"
    rows, heads, results = [], [], []
    for name, x in _patch_pairs(args, lm):
        spec = patching.PatchSpec(heads=args.heads, boundary=args.boundary or x["boundary"], source=args.source,
                                  segment_len=args.segment_len, max_new_tokens=args.max_new_tokens,
                                  fingerprint=lm.info.fingerprint)
        cont = x["continuation"] if args.continuation is None else patching.continuation_ids(lm.tokenizer,
                                                                                             args.continuation)
        res = _checked(lambda: patching.patch_prompts(lm, x["a_ids"], x["b_ids"], spec, continuation=cont,
                                                      references=x["references"], store=memo))
        res["pair"], res["meta"] = name, x["meta"]
        results.append(res)
        t = patching.comparison_table(res)
        t.insert(0, "pair", name)
        t.insert(1, "boundary", res["boundary"])
        t.insert(2, "source", res["source"])
        for k in ("b_question", "needles"):
            if k in x["meta"]:
                t[k] = str(x["meta"][k])
        rows.append(t)
        st = patching.states_table(res)
        st.insert(0, "pair", name)
        heads.append(st)
        ans = {k: v["text"] for k, v in res["answers"].items()}
        print(f"{name}: boundary {res['boundary']} (A {res['source']}), {len(res['heads'])} head(s): "
              f"A {ans['A']!r} · B {ans['B']!r} · B patched {ans['B patched']!r}"
              + (f" · Δloss {res['loss']['delta']:+.3f} nats/token" if res["loss"] else "")
              + (" (memo)" if res["memo_hit"] else ""), file=sys.stderr)
    table = pd.concat(rows, ignore_index=True)
    table.to_csv(out / "comparison.csv", index=False)
    pd.concat(heads, ignore_index=True).to_csv(out / "states.csv", index=False)
    (out / "patch.json").write_text(json.dumps(dict(model=lm.info.to_dict(), heads=args.heads, results=results),
                                               indent=2, default=float))
    summary = table.groupby("run", sort=False)[["score", "loss", "delta_loss"]].mean()
    print(summary.to_string())
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gdnviz", description="Look inside the Gated DeltaNet heads of hybrid LMs.")
    sub = p.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("model", help="'demo', a local checkpoint directory, or org/name in the local HF cache")
    common.add_argument("--trust-remote-code", action="store_true", help="allow the checkpoint's own code (off by default)")
    sp = sub.add_parser("inspect", parents=[common], help="describe a checkpoint without loading its weights")
    sp.set_defaults(fn=cmd_inspect)
    sp = sub.add_parser("capture", parents=[common], help="capture every GDN head along one or more documents")
    sp.add_argument("documents", nargs="+", help="UTF-8 text files")
    sp.add_argument("--out", required=True, help="output folder")
    sp.add_argument("--segment-len", type=int, default=256)
    sp.add_argument("--device", default="auto")
    sp.add_argument("--device-map", default="", help=DEVICE_MAP_HELP)
    sp.add_argument("--dtype", default="auto")
    sp.add_argument("--max-tokens", type=int, default=0, help="refuse documents longer than this (0 = no limit)")
    sp.add_argument("--via-worker", action="store_true",
                    help="run through the app's worker and store (the run appears in the app's previous runs)")
    sp.add_argument("--cache-dir", default=None, help="the store for --via-worker (default: $GDNVIZ_CACHE_DIR or ./cache)")
    sp.set_defaults(fn=cmd_capture)
    sp = sub.add_parser("sweep", parents=[common], help="RULER score vs truncation rank (memoised, resumable)")
    sp.add_argument("--tasks", required=True, help="comma-separated RULER tasks, e.g. niah_single_1,vt")
    sp.add_argument("--lengths", required=True, help="comma-separated target lengths in tokens, e.g. 1024,2048")
    sp.add_argument("--ranks", default="", help="comma-separated ranks (default 1,4,12,32,128 up to d_k)")
    sp.add_argument("--n", type=int, default=20, help="samples per task and length")
    sp.add_argument("--seed0", type=int, default=0)
    sp.add_argument("--heads", default="all", help="all | layer:head,... | layers:0,1")
    sp.add_argument("--rank-map", action="append", help="extra setting NAME=layer:head:r,... (repeatable)")
    sp.add_argument("--batch", type=int, default=None,
                    help="samples per forward (default: from free GPU memory and prompt length; 8 on CPU)")
    sp.add_argument("--max-new-tokens", type=int, default=0, help="0 = RULER's per task")
    sp.add_argument("--chat", choices=["auto", "on", "off"], default="auto", help="wrap prompts in the chat template")
    sp.add_argument("--chat-kwargs", default="", help='JSON for apply_chat_template, e.g. {"enable_thinking": false}')
    sp.add_argument("--out", required=True, help="output folder (its cache/ makes a rerun resume)")
    sp.add_argument("--via-worker", action="store_true",
                    help="run through the app's worker and store (samples memoised there; a rerun resumes)")
    sp.add_argument("--cache-dir", default=None, help="the store for --via-worker (default: $GDNVIZ_CACHE_DIR or ./cache)")
    _cluster_args(sp)
    sp.add_argument("--segment-len", type=int, default=256)
    sp.add_argument("--device", default="auto")
    sp.add_argument("--device-map", default="", help=DEVICE_MAP_HELP)
    sp.add_argument("--dtype", default="auto")
    sp.set_defaults(fn=cmd_sweep)
    sp = sub.add_parser("loss", parents=[common], help="next-token loss vs truncation rank over documents")
    sp.add_argument("documents", nargs="+", help="UTF-8 text files")
    sp.add_argument("--ranks", default="", help="comma-separated ranks (default 1,4,12,32 below min(d_k, d_v)); "
                                                 "the untouched model always runs")
    sp.add_argument("--heads", default="all", help="all | layer:head,... | layers:0,1")
    sp.add_argument("--min-distance", type=int, default=512,
                    help="d of the copy subsets (tokens): the preceding bigram occurred earlier, any occurrence "
                         "(copy_any) or the most recent one (copy_recent) more than d tokens back")
    sp.add_argument("--out", required=True, help="output folder")
    _cluster_args(sp)
    sp.add_argument("--segment-len", type=int, default=256)
    sp.add_argument("--device", default="auto")
    sp.add_argument("--device-map", default="", help=DEVICE_MAP_HELP)
    sp.add_argument("--dtype", default="auto")
    sp.set_defaults(fn=cmd_loss)
    sp = sub.add_parser("scan", parents=[common], help="head sensitivity scan: one layer or head cut (or kept) at a time")
    sp.add_argument("--task", required=True, help="a RULER task, e.g. niah_single_1")
    sp.add_argument("--length", type=int, required=True, help="target length in tokens")
    sp.add_argument("--by", choices=["layer", "head"], default="layer")
    sp.add_argument("--r", type=int, default=1, help="rank a cut head keeps")
    sp.add_argument("--keep", action="store_true", help="keep-one: every head cut to r except the unit")
    sp.add_argument("--layers", default="", help="only units in these GDN layers, e.g. 4,5 (default all)")
    _probe_args(sp)
    sp.set_defaults(fn=cmd_scan)
    sp = sub.add_parser("budget", parents=[common], help="per-head rank budget within a tolerance of untouched")
    sp.add_argument("--tasks", required=True, help="comma-separated RULER tasks")
    sp.add_argument("--lengths", required=True, help="comma-separated target lengths in tokens")
    sp.add_argument("--tolerance", type=float, default=1.0, help="δ, points of score every task may lose")
    sp.add_argument("--alpha", type=float, default=0.05, help="level of the one-sided paired t test")
    sp.add_argument("--ladder", default="", help="ranks tried (default 32,12,4,1 below min(d_k, d_v))")
    sp.add_argument("--n-heldout", type=int, default=None, help="held-out samples (default n; 0 skips the check)")
    sp.add_argument("--heldout-seed0", type=int, default=None, help="first held-out seed (default seed0 + n)")
    sp.add_argument("--state-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    sp.add_argument("--curve", default="", help="more tolerances for curve.csv / curve.png, e.g. 2,5,10")
    _probe_args(sp)
    sp.set_defaults(fn=cmd_budget)
    sp = sub.add_parser("attribute", parents=[common], help="which tokens a GDN head's state holds (exact)")
    sp.add_argument("document", help="a UTF-8 text file")
    sp.add_argument("--layer", type=int, required=True, help="a GDN layer (the model's own layer index)")
    sp.add_argument("--head", type=int, required=True, help="a value head of that layer (0-based)")
    sp.add_argument("--position", type=int, default=None, help="the state after this many tokens (default: all)")
    sp.add_argument("--start", type=int, default=0,
                    help="decompose tokens from this index on; earlier ones form the carried-in term")
    sp.add_argument("--top", type=_positive_int, default=4, help="singular directions to report shares along")
    sp.add_argument("--out", required=True, help="output folder")
    sp.add_argument("--device", default="auto")
    sp.add_argument("--device-map", default="", help=DEVICE_MAP_HELP)
    sp.add_argument("--dtype", default="float32", help="the model's dtype (the decomposition is float64 anyway)")
    sp.set_defaults(fn=cmd_attribute)
    sp = sub.add_parser("patch", parents=[common], help="run prompt B with chosen heads' states patched from A")
    sp.add_argument("prompts", nargs="*", help="two UTF-8 text files: A (the donor) and B")
    sp.add_argument("--needle", default="", help="instead of files: RULER needle pairs of this task "
                                                 "(niah_single_1), A with the needle, B with noise in its place")
    sp.add_argument("--length", type=_positive_int, default=1024, help="--needle: target length in tokens")
    sp.add_argument("--seed0", type=int, default=0, help="--needle: first sample seed")
    sp.add_argument("--n", type=_positive_int, default=1, help="--needle: pairs (seeds seed0..seed0+n-1)")
    sp.add_argument("--chat", choices=["auto", "on", "off"], default="auto", help="wrap prompts in the chat template")
    sp.add_argument("--heads", default="all", help="all | layer:head,... | layers:0,1")
    sp.add_argument("--boundary", type=int, default=0, help="boundary of B (tokens consumed, a multiple of L); "
                    "default: the last one before B's question (--needle) or before B's end")
    sp.add_argument("--source", type=int, default=None, help="boundary of A the states come from (default: the same)")
    sp.add_argument("--continuation", default=None, help="text whose loss after B is measured (default: the needle "
                    "value with --needle, else B's unpatched answer)")
    sp.add_argument("--max-new-tokens", type=_positive_int, default=32)
    sp.add_argument("--segment-len", type=int, default=256)
    sp.add_argument("--out", required=True, help="output folder")
    sp.add_argument("--memo", default=None, help="memo directory (default OUT/cache)")
    sp.add_argument("--device", default="auto")
    sp.add_argument("--device-map", default="", help=DEVICE_MAP_HELP)
    sp.add_argument("--dtype", default="auto")
    sp.set_defaults(fn=cmd_patch)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except GDNVizError as e:
        print(f"gdnviz: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
