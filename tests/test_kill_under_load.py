"""4 sessions x 20 capture jobs on the bundled demo model, the worker SIGKILLed mid-job.

The sessions are 4 threads of this process sharing one ``Store`` and one ``WorkerHandle``, as the sessions of one
Streamlit server do (``gdnviz.ui.common`` caches both per server); the worker is the real ``gdnviz.worker``
process on a real diskcache. Each session submits its 20 jobs (one short document each, named after the session
and job) with small gaps and polls them as a page does (``WorkerHandle.check()`` on every poll, which restarts a
dead worker). Once at least 10 jobs are done and a job is running with progress, the worker is killed with
SIGKILL.

Counted, and written to ``RECORD`` for ``tests/test_reliability_table.py`` (docs/reliability.md):
- lost: a job whose record is gone or that never reaches a terminal state;
- misattributed: a finished job whose run is not its own document, or a record that is not its session's spec;
- answered twice: a job seen in one terminal state and later in another (or with another result), or finished by a
  worker more than once (the worker logs one line per finished job);
- crashed: jobs failed with ``WorkerCrashed`` (the one being run when the worker was killed), each told its session.
Targets: lost, misattributed and answered twice are 0; crashed is 1 (one job was running).
"""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from app_fixtures import short_text
from gdnviz import jobs
from gdnviz.store import TERMINAL, Store

ROOT = Path(__file__).resolve().parent.parent
DEMO = str(ROOT / "gdnviz" / "assets" / "demo")
RECORD = Path(__file__).resolve().parent / "records" / "kill_under_load.json"
SESSIONS, JOBS = 4, 20
START_TIMEOUT = 240  # importing torch + transformers on 2 busy cores


def _doc(s: int, j: int) -> tuple[str, str]:
    return f"s{s}-j{j}", f"Session {s}, job {j}. " + short_text(40, s * JOBS + j)


def _session(s: int, store: Store, handle, seen: dict, done: threading.Event, errors: list) -> None:
    """Submit this session's jobs, then poll them (and the worker) until every one is terminal or ``done`` is set."""
    try:
        mine = []
        for j in range(JOBS):
            spec = jobs.CaptureJob(model=DEMO, documents=(_doc(s, j),), segment_len=32, device="cpu")
            mine.append(store.submit("capture", jobs.spec_to_dict(spec), label=f"session {s} job {j}"))
            seen[mine[-1]] = (s, j, [])
            time.sleep(0.02 * (s + 1))
        while not done.is_set():
            handle.check()
            open_ = 0
            for jid in mine:
                rec = store.job(jid)
                obs = None if rec is None else (rec["status"], (rec.get("result") or {}).get("run_id"),
                                                rec.get("error_type"), rec.get("label"), rec.get("spec"))
                hist = seen[jid][2]
                if not hist or hist[-1] != obs:
                    hist.append(obs)
                open_ += obs is None or obs[0] not in TERMINAL
            if not open_:
                return
            time.sleep(0.1)
    except Exception as e:  # noqa: BLE001 - reported by the test
        errors.append(f"session {s}: {type(e).__name__}: {e}")


def _outcome(store: Store, seen: dict, log_text: str) -> dict:
    finished_by_worker: dict[str, int] = {}
    for jid in re.findall(r"job ([0-9a-f]{16}) \(\w+\) (?:done|failed|cancelled) in", log_text):
        finished_by_worker[jid] = finished_by_worker.get(jid, 0) + 1
    out = dict(sessions=SESSIONS, jobs_per_session=JOBS, submitted=len(seen), finished=0, crashed=0, lost=0,
               misattributed=0, answered_twice=0, other_failures=0)
    for jid, (s, j, hist) in seen.items():
        name, text = _doc(s, j)
        terminal = [h for h in hist if h is not None and h[0] in TERMINAL]
        last = hist[-1] if hist else None
        if last is None or last[0] not in TERMINAL:
            out["lost"] += 1
            continue
        if len(set(h[:3] for h in terminal)) > 1 or finished_by_worker.get(jid, 0) > 1:
            out["answered_twice"] += 1
        status, rid, etype, label, spec = last
        if label != f"session {s} job {j}" or [tuple(d) for d in spec["documents"]] != [(name, text)]:
            out["misattributed"] += 1
        elif status == "done":
            run = store.run(rid)
            if [d["name"] for d in run["documents"]] != [name] \
                    or [tuple(d) for d in run["spec"]["documents"]] != [(name, text)]:
                out["misattributed"] += 1
            else:
                out["finished"] += 1
        elif etype == "WorkerCrashed":
            out["crashed"] += 1
        else:
            out["other_failures"] += 1
    return out


@pytest.mark.slow
def test_four_sessions_twenty_jobs_each_worker_killed_mid_job(tmp_path, monkeypatch):
    from gdnviz.ui.worker_client import WorkerHandle

    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("GDNVIZ_TEST_JOB_DELAY", "0.02")  # each progress step sleeps: a job runs long enough to kill
    store = Store(tmp_path / "cache")
    h = WorkerHandle(store)
    h.start()
    seen: dict = {}
    done, errors = threading.Event(), []
    threads = [threading.Thread(target=_session, args=(s, store, h, seen, done, errors)) for s in range(SESSIONS)]
    try:
        first = h.proc.pid
        t0 = time.time()
        while not any(w["pid"] == first and w.get("state") == "idle" for w in store.live_workers()):
            assert time.time() - t0 < START_TIMEOUT, "the worker never started"
            time.sleep(0.2)
        for t in threads:
            t.start()
        killed_job = None
        t0 = time.time()
        while killed_job is None and time.time() - t0 < 300:
            recs = [store.job(j) for j in list(seen)]
            n_done = sum(r is not None and r["status"] == "done" for r in recs)
            running = [r for r in recs if r is not None and r["status"] == "running" and r["progress"]
                       and 0 < r["progress"]["fraction"] < 1]
            if n_done >= 10 and running:
                os.kill(first, signal.SIGKILL)
                killed_job = running[0]["id"]
            time.sleep(0.01)
        assert killed_job is not None, "no job was running to kill"
        deadline = time.time() + 600
        for t in threads:
            t.join(max(1.0, deadline - time.time()))
        done.set()
        for t in threads:
            t.join(10)
        assert not errors, errors
        assert h.restarts == 1 and h.proc.pid != first
        out = _outcome(store, seen, store.log_path.read_text(errors="replace"))
    finally:
        done.set()
        h.stop()
    print(json.dumps(out), f"in {time.time() - t0:.0f} s")
    RECORD.parent.mkdir(exist_ok=True)
    RECORD.write_text(json.dumps(out, indent=1) + "\n")
    assert out["submitted"] == SESSIONS * JOBS
    assert (out["lost"], out["misattributed"], out["answered_twice"], out["other_failures"]) == (0, 0, 0, 0), out
    assert out["crashed"] == 1 and out["finished"] == SESSIONS * JOBS - 1, out
