"""Cancel at every stage: a job that stops at its next progress step ends "cancelled" in the same worker; one that
does not (stuck inside one unit: a long batch, document or model load) is recorded "cancelled" by the worker's
cancel watcher, which then exits so that the app's handle restarts it; what finished before stays in the memo and a
rerun resumes from it. And the race of the two answers: exactly one is recorded.

Real worker processes (the app's ``WorkerHandle``), a real store, the tiny checkpoint. ``GDNVIZ_TEST_STALL_AT``
makes the worker stall for good at one progress step (a unit that never returns), ``GDNVIZ_TEST_JOB_DELAY`` slows
every step. The cancel latency (cancel asked → job answered) is printed, not asserted.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from pathlib import Path

import pytest

from app_fixtures import short_text, tiny_checkpoint  # noqa: F401  (fixture)
from gdnviz import jobs
from gdnviz.store import CANCEL_EXIT_CODE, TERMINAL, Store, describe_exit
from gdnviz.worker import CANCEL_GRACE, CANCEL_RESTART_TEXT, Worker

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT = 240  # importing torch + transformers on 2 busy cores


def _wait(what, cond, timeout: float):
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise TimeoutError(what)


def _idle(store: Store, pid: int):
    return _wait(f"worker {pid} never idle", lambda: any(
        h["pid"] == pid and str(h.get("state", "")).startswith("idle") for h in store.live_workers()), START_TIMEOUT)


def _cancel_and_wait(store: Store, jid: str) -> tuple[dict, float]:
    """Cancel a running job; (its final record, seconds from the cancel to its answer)."""
    assert store.job(jid)["status"] == "running"
    t0 = time.time()
    store.cancel(jid)
    rec = _wait(f"job {jid} never answered", lambda: (r := store.job(jid))["status"] in TERMINAL and r, 120)
    return rec, time.time() - t0


def _report(capsys, text: str) -> None:
    with capsys.disabled():
        print(f"\n[cancel latency] {text}")


def _loss_spec(ck: str) -> jobs.LossJob:
    # 2 documents x (r = 2, untouched r = 16): 4 units, each its own memo entry
    return jobs.LossJob(model=ck, documents=(("one", short_text(300, 0)), ("two", short_text(260, 3))),
                        ranks=(2,), heads="layers:0,1", segment_len=64, min_distance=16)


@pytest.fixture
def handle(tmp_path, monkeypatch):
    """The app's handle on a real worker process; the test sets the hooks before ``start``."""
    from gdnviz.ui.worker_client import WorkerHandle

    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    h = WorkerHandle(Store(tmp_path / "cache"))
    yield h
    h.stop()


@pytest.mark.slow
def test_a_job_stuck_in_one_unit_is_cancelled_by_a_restart_and_resumes(handle, tiny_checkpoint, monkeypatch,
                                                                       capsys):
    """The worker stalls at the start of document 2's first unit (document 1's two units are stored): Cancel →
    the job ends "cancelled" with the restart text, answered by the stalled worker itself, which exits with
    CANCEL_EXIT_CODE; the handle restarts it; the same job again computes only document 2's units."""
    monkeypatch.setenv("GDNVIZ_TEST_STALL_AT", "running document 2/2")
    store, h = handle.store, handle
    h.start()
    first = h.proc.pid
    _idle(store, first)
    monkeypatch.delenv("GDNVIZ_TEST_STALL_AT")  # the restarted worker runs without the hook
    spec = _loss_spec(str(tiny_checkpoint))
    jid = store.submit(spec.kind, jobs.spec_to_dict(spec))
    _wait("the job never reached document 2", lambda: "running document 2/2" in
          str((store.job(jid)["progress"] or {}).get("text")), 300)
    rec, latency = _cancel_and_wait(store, jid)
    assert rec["status"] == "cancelled", rec
    assert rec["error"] == CANCEL_RESTART_TEXT.format(grace=CANCEL_GRACE) and rec["worker_pid"] == first
    assert h.proc.wait(60) == CANCEL_EXIT_CODE
    _report(capsys, f"stuck in one unit: answered {latency:.2f} s after the cancel (grace {CANCEL_GRACE:g} s)")

    t_restart = time.time()
    st = h.check()  # what every page run and poll does: the dead worker is restarted
    assert st["restarts"] == 1 and h.proc.pid != first
    assert st["last_exit"] == describe_exit(CANCEL_EXIT_CODE) and "cancelled job" in st["last_exit"]
    assert store.job(jid)["status"] == "cancelled"  # the handle's reaping did not touch the answer
    log = store.log_path.read_text()
    assert len(re.findall(rf"job {jid} \(\w+\) (?:done|failed|cancelled) in", log)) == 1, log[-3000:]

    _idle(store, h.proc.pid)
    _report(capsys, f"the restarted worker was idle (PyTorch imported) {time.time() - t_restart:.1f} s after the "
                    "restart")
    again = store.wait(store.submit(spec.kind, jobs.spec_to_dict(spec)), timeout=300)
    assert again["status"] == "done", again["error"]
    assert again["worker_pid"] == h.proc.pid
    res = again["result"]
    assert (res["n_results"], res["reused"], res["computed"]) == (4, 2, 2)  # document 1 came from the memo


@pytest.mark.slow
def test_a_cancel_between_units_ends_the_job_in_the_same_worker(handle, tiny_checkpoint, monkeypatch, capsys):
    """Every progress step takes 0.3 s (less than the grace): Cancel → the job stops at its next step, "cancelled
    by the user", and the same worker process serves the next job (no restart)."""
    monkeypatch.setenv("GDNVIZ_TEST_JOB_DELAY", "0.3")
    store, h = handle.store, handle
    h.start()
    first = h.proc.pid
    _idle(store, first)
    ck = str(tiny_checkpoint)
    spec = jobs.CaptureJob(model=ck, documents=(("d", short_text(300)), ("e", short_text(300, 2))), segment_len=64)
    jid = store.submit(spec.kind, jobs.spec_to_dict(spec))
    _wait("the job never started a document", lambda: "document 1/2" in
          str((store.job(jid)["progress"] or {}).get("text")), 300)
    rec, latency = _cancel_and_wait(store, jid)
    assert rec["status"] == "cancelled" and rec["error"] == "cancelled by the user", rec
    _report(capsys, f"between units (0.3 s steps): answered {latency:.2f} s after the cancel, no restart")
    time.sleep(CANCEL_GRACE + 2)  # the watcher had its chance: the worker still runs
    assert h.proc.poll() is None and h.check()["restarts"] == 0
    nxt = store.wait(store.submit("inspect", jobs.spec_to_dict(jobs.InspectModelJob(model=ck))), timeout=120)
    assert nxt["status"] == "done" and nxt["worker_pid"] == first


def test_a_job_answered_while_the_watcher_acts_is_recorded_once(tmp_path, caplog):
    """The worker's own answer (``Worker.answer``) and the cancel watcher's (``Worker.stop_mid_run``), started
    together from two threads on a real store, 40 times, then once in each order: exactly one of them is recorded
    (the record is that one's, the log has one answer line), and the watcher exits only when its answer won."""
    store = Store(tmp_path / "cache")
    w = Worker(store)
    caplog.set_level(logging.INFO, logger="gdnviz.worker")
    wins = {"done": 0, "cancelled": 0}

    def race(order: str | None) -> None:
        jid = store.submit("capture", {"model": "x", "documents": []})
        assert store.claim_job(w.pid)["id"] == jid
        w.current, w._job_t0 = jid, time.time()
        store.cancel(jid)
        exits, answers = [], {}
        final = dict(status="done", result={"n": 1}, finished=time.time(), seconds=0.5)
        go = threading.Barrier(2)

        def main():
            go.wait()
            answers["main"] = w.answer(jid, "capture", dict(final))

        def watcher():
            go.wait()
            answers["watcher"] = w.stop_mid_run(jid, exit=exits.append)

        if order is None:
            ts = [threading.Thread(target=main), threading.Thread(target=watcher)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(60)
        else:
            go = threading.Barrier(1)
            (main if order == "main" else watcher)()
            (watcher if order == "main" else main)()
        rec = store.job(jid)
        lines = [r.getMessage() for r in caplog.records if re.match(rf"job {jid} \(\w+\) (done|failed|cancelled) in",
                                                                    r.getMessage())]
        assert len(lines) == 1, lines
        if rec["status"] == "done":
            assert rec["result"] == {"n": 1} and rec["error"] is None
            assert exits == [] and answers["watcher"] is False and lines[0].startswith(f"job {jid} (capture) done")
        else:
            assert rec["status"] == "cancelled" and rec["error"].startswith("cancelled by the user; it did not stop")
            assert rec["result"] is None and exits == [CANCEL_EXIT_CODE] and answers["watcher"] is True
            assert "cancelled in" in lines[0]
        assert store.jobs.get(f"running:{w.pid}") is None  # the claim is gone either way
        wins[rec["status"]] += 1

    race("main")
    assert wins == {"done": 1, "cancelled": 0}
    race("watcher")
    assert wins == {"done": 1, "cancelled": 1}
    for _ in range(40):
        race(None)
    assert sum(wins.values()) == 42
    print(f"concurrent answers: {wins['done'] - 1} times the job's own answer won, {wins['cancelled'] - 1} times "
          "the watcher's")
