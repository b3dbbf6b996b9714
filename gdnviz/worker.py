"""The worker: one process that owns the model(s) and the GPU, pops jobs from the store and writes results back.

    python -m gdnviz.worker [--cache-dir DIR] [--parent-pid PID] [--exit-when-idle] [--poll 0.2]

- Keeps the last loaded model; reloads when a job names another model, device, dtype or device_map.
- Writes progress (per document and per GDN layer), honours cancel flags (a cancelled job ends "cancelled"): the
  job stops at its next progress step; one that has not stopped ``CANCEL_GRACE`` seconds after the heartbeat thread
  saw the flag (inside a long batch, document or model load) is recorded "cancelled" by that thread, in one store
  transaction that writes only a job still claimed by this pid and not answered, and the process exits with
  ``store.CANCEL_EXIT_CODE`` (the app restarts it as after a crash). Memo entries stored before stay.
- Library errors (``gdnviz.errors``, ``ValueError``) end a job "failed" with their user message; out-of-memory
  ends it "failed" with a message that says what to reduce; anything else fails with the exception named and the
  traceback in the record and in ``<cache>/worker.log``.
- A heartbeat thread writes ``hb:<pid>`` every second (state, current job, loaded model) so the app can tell the
  worker is alive; with ``--parent-pid`` the worker exits when that process is gone.
- Takes a job off the queue and marks it running in one store transaction (``Store.claim_job``) and answers it
  in one (``Store.finish_job``): killed at any instant, the job is queued, claimed by this pid, or answered.
- At start it fails the jobs claimed by dead workers of this host (``Store.reap_dead``), so no job is lost.

Test-only hooks (environment variables, read at every progress step of a job other than ``inspect``):
``GDNVIZ_TEST_OOM=1`` raises ``torch.cuda.OutOfMemoryError`` inside the job; ``GDNVIZ_TEST_CRASH=<code>`` exits
the process with that code mid-job (``os._exit``); ``GDNVIZ_TEST_JOB_DELAY=<seconds>`` sleeps at every step;
``GDNVIZ_TEST_STALL_AT=<text>`` sleeps for good at the first step whose text contains ``<text>``.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import threading
import time
import traceback

from gdnviz import settings
from gdnviz.store import CANCEL_EXIT_CODE, HEARTBEAT_EVERY, Store, pid_alive

log = logging.getLogger("gdnviz.worker")

#: seconds a running job has, after the heartbeat thread saw its cancel flag, to stop at a progress step before
#: the worker records it cancelled and exits (the flag is looked at every ``HEARTBEAT_EVERY`` seconds)
CANCEL_GRACE = 3.0
#: the error of a job the cancel watcher ended
CANCEL_RESTART_TEXT = ("cancelled by the user; it did not stop within {grace:g} s (a long batch, document or "
                       "model load was running), so the worker was restarted to stop it mid-run. Results finished "
                       "before the cancel are stored: running it again resumes from them")


def _is_oom(e: BaseException) -> bool:
    try:
        import torch

        if isinstance(e, torch.OutOfMemoryError):
            return True
    except Exception:
        pass
    return isinstance(e, MemoryError) or "out of memory" in str(e).lower()


def oom_message(kind: str, spec: dict, e: BaseException) -> str:
    """What ran out, with what, and what to reduce."""
    model = spec.get("model", "?")
    where = f"model '{model}', dtype {spec.get('dtype', 'auto')}, device {spec.get('device', 'auto')}" + (
        f", device_map {spec['device_map']}" if spec.get("device_map") else "")
    if kind == "capture":
        docs = spec.get("documents") or []
        longest = max((len(t) for _, t in docs), default=0)
        what = (f"capturing {len(docs)} document(s) (longest {longest:,} characters) with segment length "
                f"{spec.get('segment_len')}")
        reduce = ("Reduce the document length (lower the token limit or split long documents), capture fewer "
                  "documents per run, or use a smaller segment length")
    elif kind == "truncate":
        what = f"running the truncation comparison (max {spec.get('max_new_tokens')} new tokens)"
        reduce = ("Reduce the prompt / retrieval sample length (target tokens), the number of loss documents, or "
                  "the number of new tokens")
    elif kind == "sweep":
        lengths = [int(x) for x in spec.get("lengths") or [0]]
        size = spec.get("batch_size")
        what = (f"running a retrieval sweep (lengths up to {max(lengths):,} tokens, batch size "
                f"{'chosen from free memory' if size is None else size})")
        reduce = ("Reduce the batch size (samples per forward) first, then the longest length; the samples "
                  "already finished are stored, so running it again resumes where it stopped")
    elif kind == "loss":
        what = f"measuring loss vs rank on {len(spec.get('documents') or [])} document(s)"
        reduce = "Reduce the document length or the number of documents"
    else:
        what = f"running a {kind} job"
        reduce = "Reduce the input size"
    return (f"The GPU ran out of memory while {what} ({where}). {reduce}; or load the model in bfloat16, pick a "
            f"smaller model, or free GPU memory held by other processes. ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else 'out of memory'})")


def _weights_version(name: str, trust_remote_code: bool) -> str | None:
    """The fingerprint of the checkpoint ``name`` names, or None when it cannot be found (``load`` then raises the
    error that says why)."""
    from gdnviz.errors import GDNVizError
    from gdnviz.models.loader import fingerprint, resolve

    try:
        return fingerprint(resolve(name), trust_remote_code)
    except (GDNVizError, OSError):
        return None


def _exit_process(code: int) -> None:
    """Flush the log and the std streams, then end this process at once (other threads mid-work included)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def _recorded(rec: dict | None, fields: dict) -> bool:
    """Whether ``Store.finish_job``'s returned record is the answer ``fields`` (False: another answer won)."""
    return isinstance(rec, dict) and all(rec.get(k) == v for k, v in fields.items())


class Worker:
    """Owns the loaded model; ``process(job_id)`` runs one job; ``serve()`` loops over the queue."""

    def __init__(self, store: Store, parent_pid: int | None = None, poll: float = 0.2):
        self.store = store
        self.pid = os.getpid()
        self.parent_pid = parent_pid
        self.poll = poll
        self.state = "starting"
        self.current: str | None = None
        self._lm = None
        self._lm_key = None
        self.warm_up_seconds: dict | None = None  # gdnviz.warmup's timings for the loaded model (CUDA only)
        self._stop = threading.Event()
        # held while claiming a job, and by the cancel watcher from its answer to the exit: no job is claimed by a
        # process that is about to exit
        self._claim_lock = threading.Lock()
        self._cancel_seen: tuple[str, float] | None = None  # (job id, when the watcher first saw its cancel flag)
        self._job_t0 = 0.0

    # -- model pool ------------------------------------------------------------------------------------------
    def model(self, name: str, device: str, dtype: str, device_map: str = "", trust_remote_code: bool = False):
        """The loaded model for (name, device, dtype, device_map, trust_remote_code), reloaded when its weights (or,
        trusted, its code) changed on disk since it was loaded (the fingerprint only stats the files when they did
        not). ``device_map``: "", "auto" or a JSON object; the cache key holds its canonical form, so the same map
        written differently is the same model."""
        from gdnviz.models import placement

        dmap = placement.parse(device_map)
        dmap_key = dmap if isinstance(dmap, str) else placement.text(dmap)
        key = (str(name), str(device), str(dtype), dmap_key, bool(trust_remote_code),
               _weights_version(name, trust_remote_code))
        if self._lm is not None and self._lm_key == key:
            return self._lm
        from gdnviz.models import load

        self._lm, self._lm_key = None, None
        from gdnviz.gpu import scan_graph

        scan_graph.clear()  # the previous model's CUDA graphs hold static buffers on the GPU
        gc.collect()
        self._empty_cuda_cache()
        self.state = f"loading {name}"
        self.warm_up_seconds = None
        lm = load(name, device=device, dtype=dtype, device_map=dmap, trust_remote_code=trust_remote_code)
        from gdnviz.warmup import needs_warm_up, warm_up

        if needs_warm_up(lm):  # compile and autotune fla's kernels now, not during the user's first document
            self.state = f"warming up kernels for {name}"
            self.beat()
            self.warm_up_seconds = warm_up(lm)
        self._lm, self._lm_key = lm, key
        return self._lm

    def loaded_model(self) -> dict | None:
        if self._lm is None:
            return None
        i = self._lm.info
        return dict(name=i.name, device=i.device, dtype=i.dtype, kernel_path=i.kernel_path, family=i.family,
                    warm_up=self.warm_up_seconds, **({"device_map": dict(i.device_map)} if i.device_map else {}))

    @staticmethod
    def _empty_cuda_cache() -> None:
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:
            pass

    # -- heartbeat -------------------------------------------------------------------------------------------
    def beat(self) -> None:
        self.store.heartbeat(self.pid, state=self.state, job=self.current, model=self.loaded_model(),
                             queued=self.store.queued_count())

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_EVERY):
            try:
                self.beat()
            except Exception:  # a locked database for a moment is not fatal
                log.exception("heartbeat failed")
            if self.parent_pid and not pid_alive(self.parent_pid):
                log.warning("parent process %s is gone: exiting", self.parent_pid)
                os._exit(0)
            try:
                self.watch_cancel()
            except Exception:  # the store busy for a moment: look again at the next beat
                log.exception("cancel watcher failed")

    def watch_cancel(self, now: float | None = None) -> bool:
        """The cancel watcher (the heartbeat thread calls it every beat): when the running job's cancel flag has
        been set for ``CANCEL_GRACE`` seconds, ``stop_mid_run`` it. Returns False when it did nothing."""
        jid, now = self.current, time.time() if now is None else now
        if jid is None or not self.store.cancel_requested(jid):
            self._cancel_seen = None
            return False
        if self._cancel_seen is None or self._cancel_seen[0] != jid:
            self._cancel_seen = (jid, now)
            return False
        if now - self._cancel_seen[1] < CANCEL_GRACE:
            return False
        return self.stop_mid_run(jid)

    def stop_mid_run(self, jid: str, exit=None) -> bool:
        """Record job ``jid`` cancelled (what ``process`` writes for JobCancelled, with ``CANCEL_RESTART_TEXT``) in
        one transaction that writes only a job still claimed by this pid and not answered, then
        ``exit(CANCEL_EXIT_CODE)`` (default ``_exit_process``: flush the log, ``os._exit``; the claim lock stays
        held, so nothing is claimed meanwhile). Returns False, and does not exit, when the job was answered first
        (it ended on its own)."""
        with self._claim_lock:
            fields = dict(status="cancelled", error=CANCEL_RESTART_TEXT.format(grace=CANCEL_GRACE),
                          finished=time.time())
            fields["seconds"] = round(fields["finished"] - self._job_t0, 3)
            rec = self.store.finish_job(jid, self.pid, **fields)
            if not _recorded(rec, fields):
                return False
            kind = rec.get("kind")
            log.warning("job %s (%s) cancelled in %.2f s: did not stop within %g s of its cancel; exiting with "
                        "code %d to stop it", jid, kind, fields["seconds"], CANCEL_GRACE, CANCEL_EXIT_CODE)
            try:
                self.store.worker_gone(self.pid)
            except Exception:
                log.exception("could not drop the heartbeat")
            (exit or _exit_process)(CANCEL_EXIT_CODE)
            return True

    # -- jobs ------------------------------------------------------------------------------------------------
    def _hooks(self, kind: str, text: str = "") -> None:
        """Test-only fault injection (see the module docstring)."""
        if kind == "inspect":
            return
        stall = settings.get("GDNVIZ_TEST_STALL_AT")
        if stall and stall in str(text):
            log.warning("GDNVIZ_TEST_STALL_AT: stalling for good at %r", text)
            while True:
                time.sleep(3600)
        delay = settings.get("GDNVIZ_TEST_JOB_DELAY")
        if delay:
            time.sleep(delay)
        code = settings.get("GDNVIZ_TEST_CRASH")
        if code:
            log.warning("GDNVIZ_TEST_CRASH: exiting with code %s mid-job", code)
            logging.shutdown()
            os._exit(code)
        if settings.get("GDNVIZ_TEST_OOM"):
            import torch

            raise torch.cuda.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 20.00 GiB (GDNVIZ_TEST_OOM: simulated by a test hook)")

    def process(self, rec: dict) -> dict | None:
        """Run one job this worker claimed (``Store.claim_job``'s record); returns its final record."""
        from gdnviz import jobs

        jid, kind, spec_d = rec["id"], rec["kind"], rec["spec"]
        self._job_t0 = time.time()
        self.current = jid
        self.state = f"running {kind}"
        self.beat()

        def progress(done, total, text=""):
            self.store.set_progress(jid, done, total, text)
            self._hooks(kind, text)

        ctx = jobs.JobContext(self.store, jid, model_loader=self.model, progress=progress,
                              cancelled=lambda: self.store.cancel_requested(jid))
        t0 = time.time()
        try:
            spec = jobs.spec_from_dict(dict(spec_d, kind=kind))
            result = jobs.run(spec, ctx)
            final = dict(status="done", result=result)
        except jobs.JobCancelled:
            final = dict(status="cancelled", error="cancelled by the user")
        except Exception as e:  # noqa: BLE001 - every failure becomes a message, never a silent loss
            final = self._failure(kind, spec_d, e)
        except BaseException:  # SystemExit (SIGTERM), KeyboardInterrupt: record it, then stop
            self.store.finish_job(jid, self.pid, status="failed", finished=time.time(), error_type="WorkerStopped",
                                  error="the worker was stopped while running this job; run it again")
            self.current = None
            raise
        self.current = None
        self.state = "idle"
        final.update(finished=time.time(), seconds=round(time.time() - t0, 3))
        rec = self.answer(jid, kind, final)
        self.beat()
        return rec

    def answer(self, jid: str, kind: str, final: dict) -> dict | None:
        """Record ``final`` (status, result or error, times) as job ``jid``'s answer unless it was answered first
        (by the cancel watcher or a reaper: that answer stands, and the log says this one was not recorded);
        returns the job's record."""
        rec = self.store.finish_job(jid, self.pid, **final)
        if _recorded(rec, final):
            log.info("job %s (%s) %s in %.2f s%s", jid, kind, final["status"], final["seconds"],
                     f": {final.get('error')}" if final.get("error") else "")
        else:
            log.info("job %s (%s) ended %s after it had been answered %s: not recorded", jid, kind,
                     final["status"], (rec or {}).get("status"))
        return rec

    def _failure(self, kind: str, spec: dict, e: BaseException) -> dict:
        from gdnviz.errors import GDNVizError

        if _is_oom(e):
            self._lm, self._lm_key = None, None  # free everything; the next job reloads
            gc.collect()
            self._empty_cuda_cache()
            return dict(status="failed", error=oom_message(kind, spec, e), error_type="GPUOutOfMemory")
        if isinstance(e, GDNVizError):
            return dict(status="failed", error=str(e), error_type=type(e).__name__)
        if isinstance(e, (ValueError, FileNotFoundError)):
            return dict(status="failed", error=str(e), error_type=type(e).__name__)
        tb = traceback.format_exc()
        log.error("job failed with an unexpected error:\n%s", tb)
        return dict(status="failed", error=f"internal error ({type(e).__name__}: {e}); the traceback is in "
                                           f"{self.store.log_path}", error_type=type(e).__name__, traceback=tb)

    def run_pending(self, max_jobs: int | None = None) -> int:
        """Process queued jobs until the queue is empty (in this process; tests and batch use)."""
        n = 0
        while max_jobs is None or n < max_jobs:
            rec = self.store.claim_job(self.pid)
            if rec is None:
                break
            self.process(rec)
            n += 1
        return n

    def serve(self, exit_when_idle: bool = False) -> None:
        self.beat()
        self.store.reap_dead(restarted=False)
        hb = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        hb.start()
        self.state = "starting (importing PyTorch)"
        self.beat()
        import gdnviz.jobs  # noqa: F401  (pays the torch / transformers imports before the first job)
        import gdnviz.models.loader as _loader

        _loader._register_fla()
        import torch  # noqa: F401
        import transformers  # noqa: F401

        self.state = "idle"
        self.beat()
        log.info("worker %s ready on %s", self.pid, self.store.dir)
        try:
            while not self._stop.is_set():
                with self._claim_lock:
                    rec = self.store.claim_job(self.pid)
                if rec is None:
                    if exit_when_idle:
                        break
                    time.sleep(self.poll)
                    continue
                self.process(rec)
        finally:
            self._stop.set()
            if self.current:
                self.store.finish_job(self.current, self.pid, status="failed", finished=time.time(),
                                      error="the worker was stopped while running this job", error_type="WorkerStopped")
            self.store.worker_gone(self.pid)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gdnviz.worker", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-dir", default=None, help="diskcache directory (default: $GDNVIZ_CACHE_DIR or ./cache)")
    ap.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    ap.add_argument("--exit-when-idle", action="store_true", help="exit once the queue is empty (batch use)")
    ap.add_argument("--poll", type=float, default=0.2, help="seconds between queue polls when idle")
    args = ap.parse_args(argv)
    store = Store(args.cache_dir)
    handlers = [logging.FileHandler(store.log_path)]
    if sys.stderr.isatty():
        handlers.append(logging.StreamHandler(sys.stderr))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker[%(process)d] %(levelname)s %(message)s",
                        handlers=handlers)
    w = Worker(store, parent_pid=args.parent_pid, poll=args.poll)

    def _term(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _term)
    try:
        w.serve(exit_when_idle=args.exit_when_idle)
    except (SystemExit, KeyboardInterrupt):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
