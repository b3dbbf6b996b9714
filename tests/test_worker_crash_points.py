"""A real worker process killed at every instant of a capture job: no job is lost, none is answered twice.

``tests/support/crash_points.py`` forks the worker's own entry point and SIGKILLs it right after its k-th store
write (each write is one sqlite transaction, so "after write k", k = 1, 2, ..., is every instant at which it can
die), from taking the job off the queue to where it exits on its own. For every k, on a fresh store with one
queued capture job: the worker is killed, the job is recovered the way the app recovers it, and then a next
worker runs on the same store. Recovery alternates between the app's handle (``Store.reap_worker`` with the exit
code, what ``WorkerHandle.check`` does when its child exited) and the next worker's own start (``reap_dead``,
exit code unknown). Every job must end in one terminal state told to its session: "done" with its own run, or
"failed" with ``WorkerCrashed`` and the message; a state seen as terminal never changes; the next worker never
runs or answers the job again. The counts are written to ``RECORD`` (docs/reliability.md).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from app_fixtures import short_text, tiny_checkpoint  # noqa: F401  (fixture)
from gdnviz import jobs
from gdnviz.store import TERMINAL, Store

ROOT = Path(__file__).resolve().parent.parent
RECORD = Path(__file__).resolve().parent / "records" / "crash_points.json"
NO_KILL = 10 ** 6


@pytest.fixture(scope="module")
def zygote():
    """The crash-point launcher (torch imported once); yields run(k, cache_dir) -> (pid, exit code, writes, the
    last write)."""
    p = subprocess.Popen([sys.executable, str(ROOT / "tests" / "support" / "crash_points.py")], cwd=str(ROOT),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.stdout.readline().strip() == "ready"

    def run(k: int, cache_dir: Path) -> tuple[int, int, int, str]:
        p.stdin.write(f"{k} {cache_dir}\n")
        p.stdin.flush()
        pid, code, writes, what = p.stdout.readline().rstrip("\n").split(" ", 3)
        return int(pid), int(code), int(writes), what

    try:
        yield run
    finally:
        p.stdin.close()
        p.wait(60)


def _answers(store: Store, jid: str) -> int:
    """How many times a worker logged this job as finished (done, failed or cancelled)."""
    text = store.log_path.read_text(errors="replace") if store.log_path.exists() else ""
    return len(re.findall(rf"job {jid} \(\w+\) (?:done|failed|cancelled) in", text))


def _problem(rec: dict, told: dict, answers_before: int, answers_after: int, recovered_by: str) -> str | None:
    """What is wrong with the job's final record ``rec`` (None when nothing is)."""
    if rec["status"] not in TERMINAL:
        return f"stranded '{rec['status']}'"
    if told["status"] in TERMINAL and (rec["status"], rec["error_type"], rec["error"], rec["result"]) != \
            (told["status"], told["error_type"], told["error"], told["result"]):
        return f"answered twice: first {told['status']}, then {rec['status']}"
    if answers_after != answers_before:
        return "the next worker ran it again"
    if rec["status"] == "failed":
        why = "exit code -9 (killed by SIGKILL)); it has been restarted" if recovered_by == "app" \
            else "exit code unknown)"
        if (rec["error_type"], rec["error"]) != ("WorkerCrashed", f"the worker process died while running this "
                                                                  f"job ({why}"):
            return f"failed with {rec['error_type']}: {rec['error']}"
    elif rec["status"] != "done":
        return f"ended {rec['status']}"
    return None


@pytest.mark.slow
def test_a_worker_killed_after_any_store_write_loses_no_job_and_answers_none_twice(zygote, tiny_checkpoint,
                                                                                  tmp_path):
    spec = jobs.CaptureJob(model=str(tiny_checkpoint), documents=(("d", short_text(120, 5)),), segment_len=64,
                           device="cpu")
    rows, k = [], 0
    while True:
        k += 1
        assert k < 200, "the worker never ran out of store writes"
        store = Store(tmp_path / f"k{k}")
        jid = store.submit("capture", jobs.spec_to_dict(spec), label="crash point")
        pid, code, writes, what = zygote(k, store.dir)
        if code == 0:  # the worker finished the job and exited before its k-th write
            assert store.job(jid)["status"] == "done" and writes == k - 1
            break
        assert code == -9 and writes == k
        killed = store.job(jid)
        if k % 2:
            store.reap_worker(pid, code, restarted=True)  # the app's handle saw its child exit
            recovered_by, told = "app", store.job(jid)
        else:  # the next worker's start reaps the jobs of dead workers of this host
            recovered_by, told = "next worker", killed
        answers = _answers(store, jid)
        assert zygote(NO_KILL, store.dir)[1] == 0
        rec = store.job(jid)
        row = dict(k=k, after=what, at_kill=killed["status"], recovered_by=recovered_by, final=rec["status"],
                   error_type=rec["error_type"],
                   problem=_problem(rec, told, answers, _answers(store, jid), recovered_by))
        if rec["status"] == "done" and row["problem"] is None:
            run = store.run(rec["result"]["run_id"])
            if [d["name"] for d in run["documents"]] != ["d"]:
                row["problem"] = "its run is not its document's"
        rows.append(row)
        store.close()
    bad = [r for r in rows if r["problem"]]
    assert not bad, "\n".join(json.dumps(r) for r in bad)
    assert rows and rows[-1]["at_kill"] == "done"  # the last point is after the job was answered
    out = dict(points=len(rows), lost=0, answered_twice=0, crashed=sum(r["final"] == "failed" for r in rows),
               done=sum(r["final"] == "done" for r in rows), rows=rows)
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}))
    RECORD.parent.mkdir(exist_ok=True)
    RECORD.write_text(json.dumps(out, indent=1) + "\n")
