"""The on-disk meeting point of the app, the worker and the CLI: a job queue, job records, a memo of results, the
"previous runs" index and worker heartbeats, all in one diskcache directory.

Layout under the cache directory (``cache/`` at the repository root, or ``$GDNVIZ_CACHE_DIR``)::

    jobs/     diskcache.Cache, eviction 'none': "job:<id>" record, "progress:<id>", "cancel:<id>", the queue
              ("queue-<n>" -> job id, FIFO: ``Cache.push`` / ``pull``) and "running:<pid>" -> the job id a worker
              has claimed
    memo/     diskcache.Cache (size-limited): content-hash key -> b"GDNV1" + sha256(payload) + payload
    runs/     diskcache.Index: run id -> run entry (what a capture of a document set produced)
    workers/  diskcache.Cache, eviction 'none': "hb:<pid>" heartbeats
    worker.log

A memo entry carries the sha256 of its payload; ``memo_get`` verifies it and treats a mismatch (or an unreadable
entry) as a miss and deletes it, so a corrupt result is recomputed, never shown. Every other value is stored
through ``gdnviz.store_disk.CheckedDisk`` (pickles with their sha256): a damaged run entry, job record or
heartbeat is skipped and reported (``read_runs``, ``read_jobs``), never read as something else, and never takes
the reader down; a damaged job record reads as a failed job that says so.

Job statuses: queued → running → done | failed | cancelled. A job record is a dict:
``id, kind, spec, label, status, created, started, finished, worker_pid, error, error_type, result``.
Each step of a job is one sqlite transaction of ``jobs/``, so a process killed at any instant leaves the job in
exactly one of three states: queued (record + queue entry: ``submit``), claimed (record "running" by the worker's
pid + "running:<pid>": ``claim_job`` takes it off the queue and marks it in one step), or answered (terminal
record, claim gone: ``finish_job``). A claimed job whose worker is gone is answered "failed" (WorkerCrashed) by
``reap_worker``, never re-queued (it may be the job that killed the worker), and ``finish_job`` and
``reap_worker`` answer only a job still claimed by that pid, so no job is answered twice.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Iterable

import diskcache

from gdnviz import settings
from gdnviz.errors import CorruptStoreEntry
from gdnviz.store_disk import CheckedDisk

ROOT = Path(__file__).resolve().parent.parent
MEMO_MAGIC = b"GDNV1"
#: A worker whose heartbeat is older than this (seconds) is considered gone (its pid is checked too).
HEARTBEAT_STALE = 30.0
HEARTBEAT_EVERY = 1.0
TERMINAL = ("done", "failed", "cancelled")
#: the prefix of the job queue's keys in ``jobs/``
QUEUE = "queue"
#: the exit code of a worker that recorded its running job cancelled and exited to stop it mid-run
#: (``gdnviz.worker``'s cancel watcher); the app restarts it as after a crash
CANCEL_EXIT_CODE = 75


def default_cache_dir() -> Path:
    """``$GDNVIZ_CACHE_DIR`` if set, else ``cache/`` at the repository root."""
    folder = settings.get("GDNVIZ_CACHE_DIR")
    return folder.resolve() if folder else ROOT / "cache"


def content_hash(obj: Any) -> str:
    """sha256 (hex, 32 chars) of the canonical JSON of ``obj`` (sorted keys; tuples as lists)."""
    data = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=_json_default).encode()
    return hashlib.sha256(data).hexdigest()[:32]


def _json_default(o):
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    if isinstance(o, bytes):
        return hashlib.sha256(o).hexdigest()
    raise TypeError(f"not JSON-serialisable: {type(o).__name__}")


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (exited child not yet reaped) still answers kill(0): look at /proc where we can
    try:
        with open(f"/proc/{int(pid)}/stat") as fh:
            return fh.read().split(") ", 1)[1][:1] != "Z"
    except OSError:
        return True


def describe_exit(code: int | None) -> str:
    """'exit code 3', 'exit code -9 (killed by SIGKILL)', 'exit code 75 (it stopped itself to end a cancelled job)',
    or 'exit code unknown'."""
    if code is None:
        return "exit code unknown"
    if code == CANCEL_EXIT_CODE:
        return f"exit code {code} (it stopped itself to end a cancelled job)"
    if code < 0:
        try:
            return f"exit code {code} (killed by {signal.Signals(-code).name})"
        except ValueError:
            return f"exit code {code}"
    return f"exit code {code}"


class Store:
    """All of gdnviz's shared on-disk state for one cache directory. Cheap to create; one per process is enough."""

    def __init__(self, directory: str | os.PathLike | None = None, memo_size_gb: float | None = None):
        self.dir = Path(directory).expanduser().resolve() if directory else default_cache_dir()
        self.dir.mkdir(parents=True, exist_ok=True)
        if memo_size_gb is None:
            memo_size_gb = settings.get("GDNVIZ_MEMO_GB")
        def checked(name: str) -> diskcache.Cache:
            return diskcache.Cache(str(self.dir / name), eviction_policy="none", timeout=60, disk=CheckedDisk)

        self.jobs = checked("jobs")
        self.memo = diskcache.Cache(str(self.dir / "memo"), size_limit=int(memo_size_gb * 2 ** 30),
                                    eviction_policy="least-recently-stored", timeout=60)
        self.runs = diskcache.Index.fromcache(checked("runs"))
        self.workers = checked("workers")

    @property
    def log_path(self) -> Path:
        return self.dir / "worker.log"

    def close(self) -> None:
        for c in (self.jobs, self.memo, self.workers, self.runs.cache):
            c.close()

    @staticmethod
    def _read(cache: diskcache.Cache, key, default=None) -> tuple[Any, str | None]:
        """(value, None), or (default, why it cannot be read) for a damaged entry (checksum, pickle, sqlite)."""
        try:
            return cache.get(key, default), None
        except Exception as e:  # CorruptStoreEntry, UnpicklingError, EOFError, sqlite3 errors: bytes on disk
            return default, str(e) if isinstance(e, CorruptStoreEntry) else f"{type(e).__name__}: {e}"

    # -- jobs ------------------------------------------------------------------------------------------------
    def submit(self, kind: str, spec: dict, label: str = "") -> str:
        """Queue a job; returns its id. ``spec`` must be picklable (plain dicts/lists/tuples/str/int)."""
        jid = uuid.uuid4().hex[:16]
        rec = dict(id=jid, kind=kind, spec=spec, label=label or kind, status="queued", created=time.time(),
                   started=None, finished=None, worker_pid=None, error=None, error_type=None, result=None)
        with self.jobs.transact(retry=True):
            self.jobs.set(f"job:{jid}", rec)
            self.jobs.push(jid, prefix=QUEUE, retry=True)
        return jid

    def job(self, jid: str) -> dict | None:
        """The job record with ``progress`` (dict or None) and ``cancel_requested`` merged in. A record that
        cannot be read is a failed job whose error says so (kind None, spec {}); a damaged progress entry reads as
        no progress."""
        rec, why = self._read(self.jobs, f"job:{jid}")
        if why is not None or (rec is not None and not isinstance(rec, dict)):
            return dict(id=jid, kind=None, spec={}, label="?", status="failed", created=None, started=None,
                        finished=None, worker_pid=None, error=f"its record in the store cannot be read "
                        f"({why or 'not a job record'})", error_type="CorruptStoreEntry", result=None,
                        progress=None, cancel_requested=False)
        if rec is None:
            return None
        rec = dict(rec)
        prog = self._read(self.jobs, f"progress:{jid}")[0]
        rec["progress"] = prog if isinstance(prog, dict) else None
        rec["cancel_requested"] = self._read(self.jobs, f"cancel:{jid}", False)[0] is True
        return rec

    def read_jobs(self) -> tuple[list[dict], list[tuple[str, str]]]:
        """(every readable job record, [(job id, why)] of the records that cannot be read)."""
        recs, bad = [], []
        for k in list(self.jobs.iterkeys()):
            if isinstance(k, str) and k.startswith("job:"):
                rec, why = self._read(self.jobs, k)
                if why is not None or (rec is not None and not isinstance(rec, dict)):
                    bad.append((k[4:], why or "not a job record"))
                elif rec:
                    recs.append(rec)
        return recs, bad

    def update_job(self, jid: str, **fields) -> dict:
        with self.jobs.transact():
            old = self._read(self.jobs, f"job:{jid}")[0]
            rec = dict(old if isinstance(old, dict) else {"id": jid})
            rec.update(fields)
            self.jobs.set(f"job:{jid}", rec)
        return rec

    def set_progress(self, jid: str, done: float, total: float, text: str = "") -> None:
        frac = 0.0 if not total else max(0.0, min(1.0, float(done) / float(total)))
        self.jobs.set(f"progress:{jid}", dict(done=done, total=total, fraction=frac, text=text, time=time.time()))

    def cancel(self, jid: str) -> None:
        """Ask for a job to stop. A queued job is cancelled at once; a running one at its next progress step."""
        self.jobs.set(f"cancel:{jid}", True)
        with self.jobs.transact():
            rec = self._read(self.jobs, f"job:{jid}")[0]
            if isinstance(rec, dict) and rec.get("status") == "queued":
                rec = dict(rec, status="cancelled", finished=time.time(), error="cancelled before it started")
                self.jobs.set(f"job:{jid}", rec)

    def cancel_requested(self, jid: str) -> bool:
        """True when a cancel was asked for (a damaged cancel flag counts as asked: the job stops)."""
        v, why = self._read(self.jobs, f"cancel:{jid}", False)
        return why is not None or bool(v)

    def claim_job(self, pid: int) -> dict | None:
        """Take the next queued job off the queue and mark it running by worker ``pid``, in one transaction;
        returns its record (None when the queue is empty). A job cancelled while queued, or whose record cannot
        be read, is dropped from the queue and not run; one whose cancel flag is set ends "cancelled" here."""
        while True:
            with self.jobs.transact(retry=True):
                front = self._queue_front()
                try:
                    key, jid = self.jobs.pull(prefix=QUEUE, retry=True)
                except Exception:  # a damaged entry at the front: drop it, or the queue would be stuck behind it
                    if front is not None and self._queue_front() == front:
                        self.jobs.delete(front, retry=True)
                    continue
                if key is None:
                    return None
                rec = self._read(self.jobs, f"job:{jid}")[0] if isinstance(jid, str) else None
                if not isinstance(rec, dict) or rec.get("status") != "queued":
                    continue
                now = time.time()
                if self.cancel_requested(jid):
                    self.jobs.set(f"job:{jid}", dict(rec, status="cancelled", finished=now,
                                                     error="cancelled before it started"))
                    continue
                rec = dict(rec, status="running", started=now, worker_pid=pid)
                self.jobs.set(f"job:{jid}", rec)
                self.jobs.set(f"running:{pid}", jid)
                return rec

    def finish_job(self, jid: str, pid: int, **fields) -> dict | None:
        """Answer the job worker ``pid`` claimed (``fields``: its terminal status, result or error, times) and drop
        the claim, in one transaction. A job no longer claimed by ``pid`` (reaped meanwhile) is left as it is;
        returns the job's record either way (None when it is gone)."""
        with self.jobs.transact(retry=True):
            rec = self._read(self.jobs, f"job:{jid}")[0]
            if isinstance(rec, dict) and rec.get("status") == "running" and rec.get("worker_pid") == pid:
                rec = dict(rec, **fields)
                self.jobs.set(f"job:{jid}", rec)
            if self._read(self.jobs, f"running:{pid}")[0] == jid:
                self.jobs.delete(f"running:{pid}", retry=True)
        return rec if isinstance(rec, dict) else None

    def _queue_front(self):
        """The key of the first queue entry (None when there is none), without reading its value."""
        lo, hi = QUEUE + "-000000000000000", QUEUE + "-999999999999999"
        rows = self.jobs._sql("SELECT key FROM Cache WHERE ? < key AND key < ? AND raw = 1 ORDER BY key LIMIT 1",
                              (lo, hi)).fetchall()
        return rows[0][0] if rows else None

    def queued_count(self) -> int:
        """Entries in the queue (a job cancelled while queued counts until a worker drops it)."""
        lo, hi = QUEUE + "-000000000000000", QUEUE + "-999999999999999"
        return self.jobs._sql("SELECT COUNT(*) FROM Cache WHERE ? < key AND key < ? AND raw = 1",
                              (lo, hi)).fetchone()[0]

    def wait(self, jid: str, timeout: float = 600.0, poll: float = 0.1) -> dict:
        """Block until the job is done/failed/cancelled (for the CLI and tests); returns its record."""
        t0 = time.time()
        while True:
            rec = self.job(jid)
            if rec is not None and rec["status"] in TERMINAL:
                return rec
            if time.time() - t0 > timeout:
                raise TimeoutError(f"job {jid} still {rec and rec['status']} after {timeout:.0f} s")
            time.sleep(poll)

    # -- workers ---------------------------------------------------------------------------------------------
    def heartbeat(self, pid: int, **info) -> None:
        prev = self.workers.get(f"hb:{pid}") or {}
        rec = dict(prev, pid=pid, host=socket.gethostname(), time=time.time(), **info)
        rec.setdefault("started", time.time())
        self.workers.set(f"hb:{pid}", rec)

    def worker_gone(self, pid: int) -> None:
        """Forget a worker's heartbeat (its claim, if any, stays for ``reap_worker``)."""
        self.workers.delete(f"hb:{pid}")

    def heartbeats(self) -> list[dict]:
        out = []
        for k in list(self.workers.iterkeys()):
            if isinstance(k, str) and k.startswith("hb:"):
                v = self._read(self.workers, k)[0]
                if isinstance(v, dict) and isinstance(v.get("pid"), int):
                    out.append(v)
        return sorted(out, key=lambda r: -r.get("time", 0))

    def live_workers(self, stale: float = HEARTBEAT_STALE) -> list[dict]:
        """Heartbeats of workers on this host whose process exists and that beat within ``stale`` seconds."""
        now, host = time.time(), socket.gethostname()
        return [h for h in self.heartbeats()
                if now - h.get("time", 0) < stale and (h.get("host") != host or pid_alive(h.get("pid")))]

    def reap_worker(self, pid: int, exit_code: int | None = None, restarted: bool = True) -> list[str]:
        """A worker process is gone: fail the job it had claimed (with the exit code), drop the claim and its
        heartbeat. Returns the ids of the jobs marked failed (at most one)."""
        failed = []
        msg = f"the worker process died while running this job ({describe_exit(exit_code)})"
        msg += "; it has been restarted" if restarted else ""
        with self.jobs.transact(retry=True):
            jid, why = self._read(self.jobs, f"running:{pid}")
            if isinstance(jid, str):
                rec = self._read(self.jobs, f"job:{jid}")[0]
                if isinstance(rec, dict) and rec.get("status") == "running" and rec.get("worker_pid") == pid:
                    self.jobs.set(f"job:{jid}", dict(rec, status="failed", finished=time.time(), error=msg,
                                                     error_type="WorkerCrashed"))
                    failed.append(jid)
            if jid is not None or why is not None:
                self.jobs.delete(f"running:{pid}", retry=True)
        self.worker_gone(pid)
        return failed

    def reap_dead(self, restarted: bool = False) -> list[str]:
        """Reap every worker of this host whose process no longer exists (its exit code is unknown): those with
        a heartbeat and those with a claim."""
        failed, host = [], socket.gethostname()
        for h in self.heartbeats():
            pid = h.get("pid")
            if h.get("host") == host and not pid_alive(pid):
                failed += self.reap_worker(pid, None, restarted=restarted)
        for k in list(self.jobs.iterkeys()):
            if isinstance(k, str) and k.startswith("running:"):
                pid = int(k.split(":", 1)[1])
                if not pid_alive(pid):
                    failed += self.reap_worker(pid, None, restarted=restarted)
        return failed

    # -- memo ------------------------------------------------------------------------------------------------
    def memo_put(self, key: str, payload: bytes) -> None:
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise TypeError("memo payloads are bytes (serialise results first)")
        payload = bytes(payload)
        self.memo.set(key, MEMO_MAGIC + hashlib.sha256(payload).digest() + payload)

    def memo_get(self, key: str) -> bytes | None:
        """The payload, or None when absent or corrupt (a corrupt entry is deleted so that it is recomputed)."""
        try:
            raw = self.memo.get(key)
        except Exception:  # unreadable file / unpicklable value
            self._drop(key)
            return None
        if raw is None:
            return None
        if not isinstance(raw, (bytes, bytearray)) or len(raw) < len(MEMO_MAGIC) + 32 \
                or not bytes(raw[:len(MEMO_MAGIC)]) == MEMO_MAGIC:
            self._drop(key)
            return None
        raw = bytes(raw)
        digest, payload = raw[len(MEMO_MAGIC):len(MEMO_MAGIC) + 32], raw[len(MEMO_MAGIC) + 32:]
        if hashlib.sha256(payload).digest() != digest:
            self._drop(key)
            return None
        return payload

    def memo_has(self, key: str) -> bool:
        """True when an intact entry exists (verifies the checksum)."""
        return self.memo_get(key) is not None

    def memo_put_json(self, key: str, obj: Any) -> None:
        self.memo_put(key, json.dumps(obj, default=_json_default).encode())

    def memo_get_json(self, key: str) -> Any:
        data = self.memo_get(key)
        if data is None:
            return None
        try:
            return json.loads(data)
        except ValueError:
            self._drop(key)
            return None

    def _drop(self, key: str) -> None:
        try:
            self.memo.delete(key)
        except Exception:
            pass

    # -- previous runs ---------------------------------------------------------------------------------------
    def add_run(self, entry: dict) -> str:
        """Record a run (``entry['run_id']`` required); re-adding an id moves it to the end (most recent)."""
        rid = entry["run_id"]
        entry = dict(entry, opened=time.time())
        self.runs.pop(rid, None)
        self.runs[rid] = entry
        return rid

    def run(self, rid: str) -> dict | None:
        """The run entry, None when there is none; raises CorruptStoreEntry (saying why) when it cannot be read."""
        entry, why = self._read(self.runs.cache, rid)
        if why is None and entry is not None:
            why = _run_problem(entry)
        if why is not None:
            raise CorruptStoreEntry(f"the stored run {rid} cannot be read: {why}")
        return entry

    def read_runs(self) -> tuple[list[dict], list[tuple[str, str]]]:
        """(readable runs, most recent first; [(run id, why)] of the entries that cannot be read)."""
        runs, bad = [], []
        for rid in reversed(list(self.runs.keys())):
            entry, why = self._read(self.runs.cache, rid)
            if why is None and entry is not None:
                why = _run_problem(entry)
            if why is not None:
                bad.append((str(rid), why))
            elif entry is not None:
                runs.append(entry)
        return runs, bad

    def list_runs(self) -> list[dict]:
        """Readable runs, most recent first (``read_runs`` also says which cannot be read)."""
        return self.read_runs()[0]

    def latest_run(self) -> dict | None:
        runs = self.list_runs()
        return runs[0] if runs else None

    def delete_run(self, rid: str) -> None:
        self.runs.pop(rid, None)


#: what a page reads of a run entry (``jobs.run_capture`` writes them)
RUN_FIELDS = {"run_id": str, "created": (int, float), "documents": list, "segment_len": int, "dtype": str,
              "device": str, "model": dict, "model_name": str, "spec": dict}


def _run_problem(entry) -> str | None:
    """Why a run entry cannot be used (a missing or mistyped field), or None."""
    if not isinstance(entry, dict):
        return f"not a run entry ({type(entry).__name__})"
    for k, t in RUN_FIELDS.items():
        if not isinstance(entry.get(k), t):
            return f"its field '{k}' is missing or not a {t.__name__ if isinstance(t, type) else 'number'}"
    for d in entry["documents"]:
        if not (isinstance(d, dict) and isinstance(d.get("name"), str) and isinstance(d.get("key"), str)
                and isinstance(d.get("n_tokens"), int)):
            return "a document of it has no name, memo key or token count"
    return None


def corrupt_memo_entry(store: Store, key: str) -> None:
    """Test helper: flip one payload byte of a memo entry in place (keeping its stored checksum)."""
    raw = store.memo.get(key)
    if raw is None:
        raise KeyError(key)
    raw = bytearray(raw)
    raw[-1] ^= 0xFF
    store.memo.set(key, bytes(raw))


def iter_jobs(store: Store) -> Iterable[dict]:
    """The readable job records (``Store.read_jobs`` also says which cannot be read)."""
    yield from store.read_jobs()[0]
