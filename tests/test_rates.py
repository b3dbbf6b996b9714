"""Job previews on the bundled demo model (CPU, float32): the answers a sweep will run counted from the job's own
prompt list, what the memo already holds, the time estimate from the throughput a finished sweep recorded, and no
estimate where none was measured (another device, another length, another batch size)."""
from dataclasses import replace
from types import SimpleNamespace

import pytest

from gdnviz.probes import rates, sweep
from gdnviz.probes.memo import MemoStore

TASKS, LENGTHS = ("niah_single_1", "vt"), (1024,)


@pytest.fixture(scope="module")
def lm():
    from gdnviz.models import load

    return load("demo", device="cpu", dtype="float32")


def spec(**kw):
    d = dict(model="demo", tasks=TASKS, lengths=LENGTHS, ranks=(1,), n=2, max_new_tokens=6, batch_size=4,
             heads="layers:0")
    d.update(kw)
    return sweep.SweepSpec(**d)


def plan(lm, s, store):
    return sweep.plan_from_keys(lm.info, sweep.cell_keys(lm.info, lm.tokenizer, s), s.segment_len, store,
                                batch_size=s.batch_size)


def test_the_preview_counts_the_jobs_own_answers_and_the_memo(lm, tmp_path):
    big = spec(n=3)
    p = plan(lm, big, tmp_path)
    assert (p["cached"], p["seconds"]) == (0, None)
    assert sorted(map(tuple, p["missing"])) == sorted((t, 1024) for t in TASKS)
    assert "no estimate yet (no earlier run of niah_single_1 at 1,024 tokens" in rates.eta_text(p, p["to_run"])
    rows = sweep.run_sweep(lm, spec(n=1), store=tmp_path)  # seed 0 of every setting: a third of the big one
    full = sweep.run_sweep(lm, big)  # the job's own answers, no memo
    assert p["answers"] == len(full)
    assert {(c["task"], c["length"]): c["answers"] for c in p["cells"]} == \
        full.groupby(["task", "length"]).size().to_dict()
    p = plan(lm, big, tmp_path)
    assert (p["answers"], p["cached"], p["to_run"]) == (len(full), len(rows), len(full) - len(rows))
    assert sweep.count_cached(lm.info, lm.tokenizer, big, tmp_path) == (len(full), len(rows))
    # the finished sweep recorded its throughput per (task, length); the estimate is the rest at those rates
    mem = MemoStore(tmp_path)
    try:
        measured = {t: rates.read(mem, lm.info, t, 1024, big.segment_len, big.batch_size) for t in TASKS}
    finally:
        mem.close()
    assert all(m["answers"] == len(rows) // len(TASKS) and m["seconds"] > 0 for m in measured.values())
    assert all((m["batch_size"], m["rows"]) == (4, 1) for m in measured.values())  # n = 1: 1 sample per batch
    todo = {c["task"]: c["answers"] - c["cached"] for c in p["cells"]}
    expect = sum(todo[t] / measured[t]["answers_per_second"] for t in TASKS)
    assert p["seconds"] == pytest.approx(expect) and p["missing"] == []
    assert rates.eta_text(p, p["to_run"]).startswith("about ") and " at batch size 4 " in rates.eta_text(p, 1)
    # the same sweep at another batch size has no rate yet: no number, and it says at which batch size
    other = plan(lm, replace(big, batch_size=2), tmp_path)
    assert other["seconds"] is None and other["to_run"] == p["to_run"]
    assert "no earlier run of niah_single_1 at 1,024 tokens, vt at 1,024 tokens at batch size 2 on this" in \
        rates.eta_text(other, other["to_run"])
    sweep.run_sweep(lm, big, store=tmp_path)
    p = plan(lm, big, tmp_path)
    assert (p["cached"], p["to_run"], p["seconds"]) == (len(full), 0, 0.0)
    assert rates.eta_text(p, 0) == "nothing to generate"


def test_the_estimate_is_the_recorded_throughput_of_this_model_device_and_length():
    info = SimpleNamespace(fingerprint="f" * 16, dtype="bfloat16", device="cuda:0")
    mem = MemoStore({})
    rates.record(mem, info, "vt", 4096, 256, 4, seconds=10.0, answers=5, rows=4)
    est = rates.estimate(mem, info, {("vt", 4096): 4}, 256, 4)
    assert est == dict(seconds=pytest.approx(8.0), answers_per_second=pytest.approx(0.5), missing=[], batch_size=4,
                       rows=4)
    assert rates.eta_text(est, 4) == ("about 8 s at the last measured 0.50 answers/s at batch size 4 on this model "
                                      "and device")
    # a newer measurement replaces it
    rates.record(mem, info, "vt", 4096, 256, 4, seconds=2.0, answers=4, rows=4)
    assert rates.estimate(mem, info, {("vt", 4096): 4}, 256, 4)["seconds"] == pytest.approx(2.0)
    # another device type, length, segment length or dtype has no measurement: no number, and it says so
    for other, cell, L in ((SimpleNamespace(**{**vars(info), "device": "cpu"}), ("vt", 4096), 256),
                           (info, ("vt", 8192), 256), (info, ("vt", 4096), 128),
                           (SimpleNamespace(**{**vars(info), "dtype": "float32"}), ("vt", 4096), 256)):
        est = rates.estimate(mem, other, {cell: 4, ("niah_single_1", 4096): 0}, L, 4)
        assert est["seconds"] is None and est["missing"] == [list(cell)]
        assert rates.eta_text(est, 4) == (f"no estimate yet (no earlier run of vt at {cell[1]:,} tokens at batch "
                                          "size 4 on this model, dtype and device)")
    # a cell measured on the same device beside one that is not: still no number
    est = rates.estimate(mem, info, {("vt", 4096): 4, ("vt", 8192): 1}, 256, 4)
    assert est["seconds"] is None and est["missing"] == [["vt", 8192]]
    rates.record(mem, info, "cwe", 4096, 256, 4, seconds=0.0, answers=3, rows=3)  # nothing measured: nothing recorded
    assert rates.read(mem, info, "cwe", 4096, 256, 4) is None
    key = next(k for k in mem.c if rates.is_record(k))  # a damaged record reads as none
    for bad in (7, [1], dict(answers_per_second="x"), dict(answers_per_second=0.0), dict(seconds=1.0)):
        mem.set(key, bad)
        assert rates.estimate(mem, info, {("vt", 4096): 4}, 256, 4)["seconds"] is None


def test_the_estimate_uses_only_a_rate_measured_at_the_jobs_batch_size():
    """Rates at batch sizes 4 and 16 and with the automatic size: each estimate uses its own and says which; a
    batch size never measured gives no number, whatever was measured at the others."""
    info = SimpleNamespace(fingerprint="f" * 16, dtype="bfloat16", device="cuda:0")
    mem = MemoStore({})
    rates.record(mem, info, "vt", 4096, 256, 4, seconds=10.0, answers=5, rows=4)  # 0.5 answers/s
    rates.record(mem, info, "vt", 4096, 256, 16, seconds=2.0, answers=16, rows=16)  # 8 answers/s
    rates.record(mem, info, "vt", 4096, 256, None, seconds=4.0, answers=12, rows=12)  # 3 answers/s
    for b, secs, words in ((4, 8.0, "0.50 answers/s at batch size 4 "), (16, 0.5, "8.00 answers/s at batch size 16 "),
                           (None, 4 / 3, "3.00 answers/s with the batch size chosen from free memory (12 rows) ")):
        est = rates.estimate(mem, info, {("vt", 4096): 4}, 256, b)
        assert est["seconds"] == pytest.approx(secs) and est["batch_size"] == b, b
        assert words in rates.eta_text(est, 4), rates.eta_text(est, 4)
        assert rates.read(mem, info, "vt", 4096, 256, b)["batch_size"] == b
    est = rates.estimate(mem, info, {("vt", 4096): 4}, 256, 8)
    assert (est["seconds"], est["missing"], est["rows"]) == (None, [["vt", 4096]], None)
    assert rates.eta_text(est, 4) == ("no estimate yet (no earlier run of vt at 4,096 tokens at batch size 8 on this "
                                      "model, dtype and device)")
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="batch size must be a positive integer"):
            rates.estimate(mem, info, {("vt", 4096): 4}, 256, bad)


def test_a_preview_too_large_to_build_counts_the_same_answers_without_the_memo(lm, tmp_path):
    """``plan_unbuilt`` (the page's preview above ``PREVIEW_TOKENS``): the same answers per (task, length) as the
    job's own keys, the memo share unknown (None, said in words), the time for all of them at the measured rates."""
    from gdnviz.ui import sweeps as S
    from gdnviz.ui.common import PREVIEW_TOKENS, preview_tokens

    s = spec(n=2, ranks=(1, 4))
    built = plan(lm, s, tmp_path)
    un = sweep.plan_unbuilt(lm.info, s, tmp_path)
    assert (un["answers"], un["to_run"], un["cached"]) == (built["answers"], built["answers"], None)
    assert [(c["task"], c["length"], c["answers"]) for c in un["cells"]] == \
        [(c["task"], c["length"], c["answers"]) for c in built["cells"]]
    assert un["seconds"] is None and "no estimate yet" in S.plan_text(un, s, 128)
    mem = MemoStore(tmp_path)
    try:
        for t in TASKS:
            rates.record(mem, lm.info, t, 1024, s.segment_len, s.batch_size, seconds=3.0, answers=6, rows=2)
    finally:
        mem.close()
    un = sweep.plan_unbuilt(lm.info, s, tmp_path)
    assert un["seconds"] == pytest.approx(un["answers"] / 2.0)
    text = S.plan_text(un, s, 128)
    assert "the memo is read when the job starts" in text and "up to " in text and "to run**" not in text
    with pytest.raises(Exception):  # bad settings still raise before anything is built
        sweep.plan_unbuilt(lm.info, spec(ranks=(999,)), tmp_path)
    assert preview_tokens(s) == 2 * 2 * 1024 <= PREVIEW_TOKENS
    assert preview_tokens(spec(n=100, lengths=(4096, 32768))) > PREVIEW_TOKENS
