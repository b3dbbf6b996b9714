"""ScanJob and BudgetJob through the real worker process (tiny checkpoint, its own cache directory): results,
progress, errors as messages, and a cancelled scan that resumes from the memo."""
from __future__ import annotations

import pytest

from app_fixtures import tiny_checkpoint  # noqa: F401  (fixture)
from gdnviz import jobs
from gdnviz.store import Store
from test_worker import _submit, worker  # noqa: F401  (fixture)


def test_scan_and_budget_jobs_in_the_worker(worker, tiny_checkpoint):
    from gdnviz.probes import scan

    store, proc = worker
    ck = str(tiny_checkpoint)
    spec = jobs.ScanJob(model=ck, task="niah_single_1", length=400, r=2, by="head", layers=(3,), n=2, batch_size=2,
                        max_new_tokens=6, segment_len=128)
    rec = store.wait(_submit(store, spec), timeout=300)
    assert rec["status"] == "done", rec["error"]
    assert rec["worker_pid"] == proc.pid and rec["progress"]["fraction"] == 1.0
    res = rec["result"]
    assert (res["computed"], res["reused"], res["n_results"]) == (10, 0, 10)  # 4 heads + untouched, 2 samples
    t = scan.table_frame(res["table"])
    assert list(t.columns) == scan.TABLE_COLUMNS and t[["layer", "head"]].values.tolist() == [[3, h] for h in
                                                                                              range(4)]
    assert res["settings"]["layers"] == [3] and res["all_cut"] is None
    rec2 = store.wait(_submit(store, spec), timeout=120)
    assert (rec2["result"]["computed"], rec2["result"]["reused"]) == (0, 10)
    assert rec2["result"]["table"] == res["table"]

    bspec = jobs.BudgetJob(model=ck, tasks=("niah_single_1",), lengths=(400,), n=2, tolerances=(5.0, 20.0),
                           ladder=(4, 2), batch_size=2, max_new_tokens=6, segment_len=128)
    rec = store.wait(_submit(store, bspec), timeout=600)
    assert rec["status"] == "done", rec["error"]
    b = rec["result"]
    assert [s["tolerance"] for s in b["budgets"]] == [5.0, 20.0]
    assert b["budgets"][0]["state_bytes_full"] == 3 * 4 * 16 * 16 * 4
    assert {c["tolerance"] for c in b["curve"]} == {0.0, 5.0, 20.0}

    bad = [(jobs.ScanJob(model=ck, task="niah_single_1", length=400, r=16, n=2), "RankOutOfRange",
            "r = 16 keeps every state untouched"),
           (jobs.ScanJob(model=ck, task="niah_single_1", length=400, n=5, max_prompts=3), "TooManyPrompts",
            "over the limit of 3"),
           (jobs.BudgetJob(model=ck, tasks=("niah_single_1",), lengths=(400,), n=1), "TooFewSamples",
            "n = 1 is too small"),
           (jobs.BudgetJob(model=ck, tasks=("niah_single_1",), lengths=(400,), n=2, tolerances=(0.0,)),
            "ValueError", "tolerance must be a number of points > 0")]
    ids = [_submit(store, s) for s, _, _ in bad]
    for jid, (_, etype, text) in zip(ids, bad):
        rec = store.wait(jid, timeout=120)
        assert rec["status"] == "failed" and rec["error_type"] == etype and text in rec["error"], rec


def test_cancelled_scan_resumes(tmp_path, tiny_checkpoint):
    from gdnviz.errors import JobCancelled

    store = Store(tmp_path / "cache")
    spec = jobs.ScanJob(model=str(tiny_checkpoint), task="niah_single_1", length=400, r=2, layers=(0,), n=3,
                        batch_size=2, max_new_tokens=6, segment_len=128)
    cancel = {"now": False}

    def progress(done, total, text):
        if total > 1 and done >= 2:
            cancel["now"] = True

    with pytest.raises(JobCancelled):
        jobs.run(spec, jobs.JobContext(store, progress=progress, cancelled=lambda: cancel["now"]))
    res = jobs.run(spec, jobs.JobContext(store))
    assert (res["computed"], res["reused"]) == (4, 2)  # 2 settings x 3 samples, the first batch kept
