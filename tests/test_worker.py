"""The worker as a real subprocess on a tmp cache directory with a tiny real checkpoint: a capture end to end,
library errors as messages, cancel, kill -9 mid-job (the job is reported failed and a restarted worker serves
the next job), the OOM hook, and the reaping of jobs of a worker that vanished."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app_fixtures import build_not_gdn, short_text, tiny_checkpoint  # noqa: F401  (fixture)
from gdnviz import jobs
from gdnviz.store import Store

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT = 240  # importing torch + transformers on 2 busy cores


def _env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _wait_heartbeat(store: Store, pid: int, state_prefix: str = "idle", timeout: float = START_TIMEOUT) -> dict:
    t0 = time.time()
    while time.time() - t0 < timeout:
        for h in store.live_workers():
            if h["pid"] == pid and str(h.get("state", "")).startswith(state_prefix):
                return h
        time.sleep(0.2)
    raise TimeoutError(f"worker {pid} never reported '{state_prefix}' (log: {store.log_path.read_text()[-2000:] if store.log_path.exists() else ''})")


def _wait_status(store: Store, jid: str, statuses, timeout: float = 120) -> dict:
    t0 = time.time()
    while time.time() - t0 < timeout:
        rec = store.job(jid)
        if rec and rec["status"] in statuses:
            return rec
        time.sleep(0.05)
    raise TimeoutError(f"job {jid} stuck in {store.job(jid)['status']}")


def _submit(store, spec) -> str:
    return store.submit(spec.kind, jobs.spec_to_dict(spec))


@pytest.fixture(scope="module")
def worker(tmp_path_factory, tiny_checkpoint):
    """A plain worker subprocess (no test hooks) on its own cache directory."""
    d = tmp_path_factory.mktemp("worker_cache")
    store = Store(d)
    log = open(d / "stdout.log", "wb")
    p = subprocess.Popen([sys.executable, "-m", "gdnviz.worker", "--cache-dir", str(d), "--poll", "0.05"],
                         cwd=str(ROOT), env=_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_heartbeat(store, p.pid)
        yield store, p
    finally:
        p.terminate()
        p.wait(20)
        log.close()


@pytest.mark.slow
def test_capture_end_to_end(worker, tiny_checkpoint):
    store, proc = worker
    ck = str(tiny_checkpoint)
    rec = store.wait(_submit(store, jobs.InspectModelJob(model=ck)), timeout=120)
    assert rec["status"] == "done", rec["error"]
    info = rec["result"]
    assert info["family"] == "qwen3_5" and info["gdn_layers"] == [0, 1, 3] and info["attn_layers"] == [2]
    assert (info["num_heads"], info["d_k"], info["d_v"]) == (4, 16, 16)
    assert info["kernel_path"] == "torch" and info["dtype"] == "float32" and info["fingerprint"]

    docs = (("one", short_text(300, 0)), ("two", short_text(250, 1)))
    spec = jobs.CaptureJob(model=ck, documents=docs, segment_len=64)
    jid = _submit(store, spec)
    rec = store.wait(jid, timeout=300)
    assert rec["status"] == "done", rec["error"]
    assert rec["worker_pid"] == proc.pid
    res = rec["result"]
    assert res["computed"] == 2 and res["reused"] == 0 and len(res["n_tokens"]) == 2
    assert rec["progress"]["fraction"] == 1.0
    run = store.run(res["run_id"])
    assert [d["name"] for d in run["documents"]] == ["one", "two"]
    assert run["model"]["fingerprint"] == info["fingerprint"] and run["backends"] == ["torch"]
    caps = jobs.load_run_captures(store, run)
    T = res["n_tokens"][0]
    assert caps[0].sv.shape == (-(-T // 64), 3, 4, 16) and caps[0].g.shape == (3, 4, T)
    assert caps[0].meta["segment_len"] == 64 and caps[0].meta["n_tokens"] == T

    # the same spec again: every document comes from the memo, same run
    rec2 = store.wait(_submit(store, spec), timeout=120)
    assert rec2["result"]["reused"] == 2 and rec2["result"]["run_id"] == res["run_id"]
    assert rec2["seconds"] < rec["seconds"]


@pytest.mark.slow
def test_sweep_end_to_end_then_from_the_memo(worker, tiny_checkpoint):
    """A SweepJob in the worker process: rows, seed 000's table and settings come back; the same sweep again is
    answered from the per-sample memo (nothing generated) with the same rows."""
    import pandas as pd

    from gdnviz.probes import sweep

    store, proc = worker
    spec = jobs.SweepJob(model=str(tiny_checkpoint), tasks=("niah_single_1", "fwe"), lengths=(400,), ranks=(2,),
                         n=2, heads="layers:0,1", batch_size=2, max_new_tokens=6, segment_len=128)
    rec = store.wait(_submit(store, spec), timeout=300)
    assert rec["status"] == "done", rec["error"]
    assert rec["worker_pid"] == proc.pid and rec["progress"]["fraction"] == 1.0
    res = rec["result"]
    # 2 tasks x 1 length x (r = 2 and the untouched r = 16) x 2 samples, all generated now
    assert (res["computed"], res["reused"], res["n_results"]) == (8, 0, 8)
    assert res["ranks"] == [2, 16] and res["rmax"] == 16 and res["n_heads"] == 8  # 2 layers x 4 heads
    assert res["settings"]["heads"] == "layers:0,1" and res["settings"]["n"] == 2
    assert res["settings"]["fingerprint"] == res["model"]["fingerprint"]
    rows, table = sweep.rows_frame(res["rows"]), sweep.table_frame(res["table"])
    assert len(rows) == 8 and rows["score"].between(0, 100).all() and (rows["n_generated"] <= 6).all()
    assert list(table.columns) == sweep.TABLE_COLUMNS and len(table) == 4
    # the table is the library's table of the rows the worker returned
    pd.testing.assert_frame_equal(table, sweep.sweep_table(rows, rmax=16))
    assert (table[table.r == 16][["delta", "se"]] == 0).all().all()

    rec2 = store.wait(_submit(store, spec), timeout=120)
    res2 = rec2["result"]
    assert rec2["status"] == "done" and (res2["computed"], res2["reused"]) == (0, 8)
    assert res2["rows"] == res["rows"] and res2["table"] == res["table"]
    assert rec2["seconds"] < rec["seconds"]


def test_cancelled_sweep_resumes_where_it_stopped(tmp_path, tiny_checkpoint):
    """Cancel between batches (the way the worker cancels: progress raises): the finished batch is stored, and
    the same sweep again generates only the rest."""
    from gdnviz.errors import JobCancelled

    store = Store(tmp_path / "cache")
    spec = jobs.SweepJob(model=str(tiny_checkpoint), tasks=("niah_single_1",), lengths=(400,), ranks=(2,), n=3,
                         batch_size=2, max_new_tokens=6, segment_len=128)
    seen, cancel = [], {"now": False}

    def progress(done, total, text):
        seen.append((done, total, text))
        if total > 1 and done >= 2:  # the user presses Cancel during the first batch's report
            cancel["now"] = True

    with pytest.raises(JobCancelled):
        jobs.run(spec, jobs.JobContext(store, progress=progress, cancelled=lambda: cancel["now"]))
    assert [d for d, t, _ in seen if t > 1] == [1, 2]  # stopped right after the first batch of two
    assert any("niah_single_1 · 400 tokens · r = 2: 3 of 3 samples to generate" in t for _, _, t in seen), seen
    res = jobs.run(spec, jobs.JobContext(store))
    assert (res["computed"], res["reused"], res["n_results"]) == (4, 2, 6)
    again = jobs.run(spec, jobs.JobContext(store))
    assert (again["computed"], again["reused"]) == (0, 6) and again["rows"] == res["rows"]


@pytest.mark.slow
def test_loss_job_in_the_worker_cancels_resumes_and_refuses_bad_input(tmp_path, tiny_checkpoint):
    """A LossJob in a real worker process (every progress step slowed by the test hook): progress per (document,
    setting), Cancel stops it with the finished entries stored, the same job again computes only the rest, a third
    time nothing; a too-short document and an out-of-range r fail with their messages."""
    from gdnviz.probes import loss_sweep

    d = tmp_path / "cache"
    store = Store(d)
    p = subprocess.Popen([sys.executable, "-m", "gdnviz.worker", "--cache-dir", str(d), "--poll", "0.05"],
                         cwd=str(ROOT), env=_env(GDNVIZ_TEST_JOB_DELAY="0.3"), stdout=subprocess.DEVNULL,
                         stderr=subprocess.STDOUT)
    try:
        _wait_heartbeat(store, p.pid)
        ck = str(tiny_checkpoint)
        spec = jobs.LossJob(model=ck, documents=(("one", short_text(300, 0)), ("two", short_text(260, 3))),
                            ranks=(2, 4), heads="layers:0,1", segment_len=64, min_distance=16)
        jid = _submit(store, spec)
        t0, texts = time.time(), set()
        while (store.job(jid)["progress"] or {}).get("total") != 6 or store.job(jid)["progress"]["done"] < 2:
            assert time.time() - t0 < 180 and store.job(jid)["status"] in ("queued", "running"), store.job(jid)
            texts.add((store.job(jid)["progress"] or {}).get("text"))
            time.sleep(0.05)
        # before each (document, setting) the progress says which one runs
        assert any(t and t.startswith("0/6 (document × setting) done · running document 1/2 'one'") and "r = 2"
                   in t for t in texts), texts
        store.cancel(jid)
        rec = _wait_status(store, jid, ("cancelled", "failed", "done"))
        assert rec["status"] == "cancelled" and rec["worker_pid"] == p.pid
        rec = store.wait(_submit(store, spec), timeout=300)
        assert rec["status"] == "done", rec["error"]
        res = rec["result"]
        assert res["n_results"] == 6 and res["reused"] >= 2 and res["computed"] == 6 - res["reused"]
        assert res["ranks"] == [2, 4, 16] and res["n_heads"] == 8 and res["settings"]["min_distance"] == 16
        rows, table = loss_sweep.rows_frame(res["rows"]), loss_sweep.table_frame(res["table"])
        import pandas as pd

        pd.testing.assert_frame_equal(table, loss_sweep.loss_table(rows, rmax=16))  # the library's table
        assert list(table.columns) == loss_sweep.TABLE_COLUMNS and len(table) == 9
        again = store.wait(_submit(store, spec), timeout=120)["result"]
        assert (again["computed"], again["reused"]) == (0, 6) and again["table"] == res["table"]
        bad = [(jobs.LossJob(model=ck, documents=(("one", short_text(300, 0)), ("tiny", "a few words")),
                             segment_len=64), "DocumentTooShort", "document 'tiny' has"),
               (jobs.LossJob(model=ck, documents=(("one", short_text(300, 0)),), ranks=(17,), segment_len=64),
                "RankOutOfRange", "rank 17 is outside 1..16"),
               (jobs.LossJob(model=ck, documents=(), segment_len=64), "EmptyDocumentSet", "at least one document")]
        for spec, etype, text in bad:
            rec = store.wait(_submit(store, spec), timeout=120)
            assert rec["status"] == "failed" and rec["error_type"] == etype and text in rec["error"], rec
    finally:
        p.terminate()
        p.wait(20)


@pytest.mark.slow
def test_library_errors_become_messages(worker, tiny_checkpoint, tmp_path):
    store, proc = worker
    ck = str(tiny_checkpoint)
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    cases = [
        (jobs.InspectModelJob(model=str(empty)), "NotAModelDirectory", "has no config.json"),
        (jobs.InspectModelJob(model=str(build_not_gdn(tmp_path))), "NotAGDNModel", "no Gated DeltaNet layers"),
        (jobs.CaptureJob(model=ck, documents=(("long", short_text(400)),), max_tokens=50), "DocumentTooLong",
         "over the limit of 50 tokens"),
        (jobs.CaptureJob(model=ck, documents=(("blank", "   "),)), "EmptyDocument", "empty"),
        (jobs.TruncateCompareJob(model=ck, ranks=((0, 0, 17),), prompt="hello"), "RankOutOfRange",
         "outside 1..16"),
        (jobs.TruncateCompareJob(model=ck, ranks=((2, 0, 4),), prompt="hello"), "ValueError",
         "not a Gated DeltaNet layer"),
        (jobs.SweepJob(model=ck, tasks=("vt",), lengths=(300,), n=1), "TaskTooShort",
         "vt needs a target length of at least"),
        (jobs.SweepJob(model=ck, tasks=("niah_single_1",), lengths=(400,), ranks=(4, 32), n=1), "RankOutOfRange",
         "rank 32 is outside 1..16"),
        (jobs.SweepJob(model=ck, tasks=("niah_single_1",), lengths=(400,), n=1, fingerprint="0" * 16), "ValueError",
         "fingerprint"),
    ]
    ids = [_submit(store, spec) for spec, _, _ in cases]
    for jid, (_, etype, text) in zip(ids, cases):
        rec = store.wait(jid, timeout=120)
        assert rec["status"] == "failed" and rec["error_type"] == etype and text in rec["error"], rec
    assert proc.poll() is None  # still serving


@pytest.mark.slow
def test_cancel_kill_and_restart(tmp_path, tiny_checkpoint, monkeypatch):
    """The app's WorkerHandle: cancel a running job; kill -9 the worker mid-job -> the job fails with the exit
    code, a new worker starts and serves the next job."""
    from gdnviz.ui.worker_client import WorkerHandle

    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("GDNVIZ_TEST_JOB_DELAY", "0.4")  # every progress step sleeps: jobs stay running a while
    store = Store(tmp_path / "cache")
    h = WorkerHandle(store)
    h.start()
    try:
        first = h.proc.pid
        _wait_heartbeat(store, first)
        ck = str(tiny_checkpoint)
        spec = jobs.CaptureJob(model=ck, documents=(("d", short_text(200)),), segment_len=64)

        jid = _submit(store, spec)
        _wait_status(store, jid, ("running",))
        store.cancel(jid)
        rec = _wait_status(store, jid, ("cancelled", "failed", "done"))
        assert rec["status"] == "cancelled" and rec["error"] == "cancelled by the user"

        jid = _submit(store, spec)
        _wait_status(store, jid, ("running",))
        time.sleep(0.5)
        os.kill(first, signal.SIGKILL)
        h.proc.wait(10)
        st = h.check()  # what every page run and poll does
        rec = store.job(jid)
        assert rec["status"] == "failed" and rec["error_type"] == "WorkerCrashed"
        assert rec["error"] == ("the worker process died while running this job (exit code -9 (killed by "
                                "SIGKILL)); it has been restarted")
        assert h.restarts == 1 and h.proc.pid != first and st["restarts"] == 1
        _wait_heartbeat(store, h.proc.pid)
        rec = store.wait(_submit(store, jobs.InspectModelJob(model=ck)), timeout=120)
        assert rec["status"] == "done" and rec["worker_pid"] == h.proc.pid
    finally:
        h.stop()


def test_oom_hook_reports_what_to_reduce(tmp_path, tiny_checkpoint, monkeypatch):
    """GDNVIZ_TEST_OOM raises torch.cuda.OutOfMemoryError inside a job (same code path as the worker process)."""
    from gdnviz.worker import Worker

    monkeypatch.setenv("GDNVIZ_TEST_OOM", "1")
    store = Store(tmp_path / "cache")
    w = Worker(store)
    ck = str(tiny_checkpoint)
    jid = _submit(store, jobs.CaptureJob(model=ck, documents=(("d", short_text(100)),), segment_len=64))
    ok = _submit(store, jobs.InspectModelJob(model=ck))  # inspect jobs are exempt from the hooks
    assert w.run_pending() == 2
    rec = store.job(jid)
    assert rec["status"] == "failed" and rec["error_type"] == "GPUOutOfMemory"
    assert "ran out of memory" in rec["error"] and "Reduce the document length" in rec["error"]
    assert "segment length" in rec["error"] and "bfloat16" in rec["error"]
    assert store.job(ok)["status"] == "done"


@pytest.mark.slow
def test_worker_reaps_jobs_of_a_vanished_worker_and_exits_with_its_parent(tmp_path, tiny_checkpoint):
    store = Store(tmp_path / "cache")
    ghost = subprocess.Popen([sys.executable, "-c", "pass"])
    ghost.wait()
    jid = store.submit("capture", {"model": "x", "documents": []})
    store.claim_job(ghost.pid)
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    p = subprocess.Popen([sys.executable, "-m", "gdnviz.worker", "--cache-dir", str(store.dir), "--parent-pid",
                          str(parent.pid)], cwd=str(ROOT), env=_env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    try:
        rec = _wait_status(store, jid, ("failed",), timeout=60)
        assert "the worker process died while running this job" in rec["error"]
        _wait_heartbeat(store, p.pid, "")
        parent.kill()
        parent.wait()
        assert p.wait(30) == 0
        assert all(h["pid"] != p.pid for h in store.live_workers())
    finally:
        for q in (p, parent):
            if q.poll() is None:
                q.kill()
