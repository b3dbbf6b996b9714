"""Token throughput of the long jobs (``gdnviz.probes.rates``' job records): how a record is kept, read and turned into
an estimate (no number for another device, dtype, segment length, part, or a damaged entry); every job run through
the real Worker on the tiny checkpoint records the tokens it ran; the pages say "no estimate yet" before such a job
and "about … tokens/s" after it. Timings are not asserted, only their presence and what they are of."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from app_fixtures import short_text, tiny_checkpoint  # noqa: F401  (fixture)
from gdnviz import jobs
from gdnviz.jobs import MemoMapping
from gdnviz.probes import rates
from gdnviz.probes.memo import MemoStore
from gdnviz.store import Store
from test_app_pages import app, capture, env, texts, work  # noqa: F401  (fixtures)

DOCS = (("alpha", short_text(300, 0)), ("beta", short_text(260, 3)))


def info_of(run: dict) -> SimpleNamespace:
    return SimpleNamespace(**run["model"])


def memo(cache) -> MemoStore:
    return MemoStore(MemoMapping(Store(cache)))


def captions(at) -> list[str]:
    return texts(at, "caption")


# --- the records ----------------------------------------------------------------------------------------------------
def test_a_job_rate_is_read_back_only_for_its_model_dtype_device_and_segment_length():
    info = SimpleNamespace(fingerprint="f" * 16, dtype="bfloat16", device="cuda:0")
    mem = MemoStore({})
    est = rates.estimate_job(mem, info, "capture", 5000, 256)
    assert (est["seconds"], est["missing"], est["tokens"]) == (None, [""], 5000)
    assert rates.job_eta_text(est) == "no estimate yet (no earlier capture at L = 256 on this model, dtype and device)"
    rates.record_job(mem, info, "capture", 256, seconds=4.0, tokens=2000)
    r = rates.read_job(mem, info, "capture", 256)
    assert (r["tokens"], r["seconds"], r["tokens_per_second"]) == (2000, 4.0, 500.0) and r["when"] > 0
    est = rates.estimate_job(mem, info, "capture", 5000, 256)
    assert est["seconds"] == pytest.approx(10.0) and est["tokens_per_second"] == {"": 500.0}
    assert rates.job_eta_text(est) == ("about 10 s at the last measured 500 tokens/s (a capture at L = 256 on this "
                                       "model and device)")
    rates.record_job(mem, info, "capture", 256, seconds=1.0, tokens=2000)  # the newest replaces it
    assert rates.estimate_job(mem, info, "capture", 5000, 256)["seconds"] == pytest.approx(2.5)
    # another device type, dtype, segment length, model or job: no number
    for other, job, L in ((SimpleNamespace(**{**vars(info), "device": "cpu"}), "capture", 256),
                          (SimpleNamespace(**{**vars(info), "dtype": "float32"}), "capture", 256),
                          (SimpleNamespace(**{**vars(info), "fingerprint": "e" * 16}), "capture", 256),
                          (info, "capture", 128), (info, "truncate", 256), (info, "patch", 256)):
        est = rates.estimate_job(mem, other, job, 5000, L)
        assert est["seconds"] is None and est["missing"] == [""], (other, job, L)
        assert rates.job_eta_text(est).startswith("no estimate yet (no earlier ")
    # the device's index does not matter, a device map's digest does
    assert rates.read_job(mem, SimpleNamespace(**{**vars(info), "device": "cuda:1"}), "capture", 256) is not None
    assert rates.read_job(mem, SimpleNamespace(**vars(info), memo_device="map-0123"), "capture", 256) is None
    # nothing to run; nothing measured is not recorded
    assert rates.job_eta_text(rates.estimate_job(mem, info, "capture", 0, 256)) == "nothing to run"
    rates.record_job(mem, info, "patch", 256, seconds=0.0, tokens=30)
    rates.record_job(mem, info, "patch", 256, seconds=1.0, tokens=0)
    assert rates.read_job(mem, info, "patch", 256) is None
    # a damaged or foreign entry under the key reads as no record
    key = next(k for k in mem.c if rates.is_record(k))
    for bad in (7, [1], "x", None, dict(tokens_per_second="x"), dict(tokens_per_second=0.0),
                dict(tokens_per_second=float("inf")), dict(tokens_per_second=float("nan")), dict(seconds=1.0),
                dict(answers_per_second=3.0)):
        mem.set(key, bad)
        assert rates.read_job(mem, info, "capture", 256) is None, bad
        assert rates.estimate_job(mem, info, "capture", 10, 256)["seconds"] is None
    with pytest.raises(ValueError, match="no throughput is measured for job 'sweep'"):
        rates.estimate_job(mem, info, "sweep", 10, 256)
    with pytest.raises(ValueError, match="capture has no part 'truncated'"):
        rates.record_job(mem, info, "capture", 256, 1.0, 10, part="truncated")


def test_loss_vs_rank_is_estimated_from_its_untouched_and_truncated_rates_apart():
    info = SimpleNamespace(fingerprint="f" * 16, dtype="float32", device="cpu")
    mem = MemoStore({})
    tok = {"untouched": 1000, "truncated": 4000}
    est = rates.estimate_job(mem, info, "loss", tok, 64)
    assert est["missing"] == ["untouched", "truncated"]
    assert rates.job_eta_text(est) == ("no estimate yet (no earlier loss vs rank run at L = 64 on this model, dtype "
                                       "and device)")
    rates.record_job(mem, info, "loss", 64, 2.0, 1000, part="untouched")  # 500 tokens/s
    est = rates.estimate_job(mem, info, "loss", tok, 64)
    assert est["seconds"] is None and est["missing"] == ["truncated"]
    assert rates.job_eta_text(est) == ("no estimate yet (no earlier loss vs rank run with truncated passes at L = 64 "
                                       "on this model, dtype and device)")
    assert rates.estimate_job(mem, info, "loss", {"untouched": 1000, "truncated": 0}, 64)["seconds"] == \
        pytest.approx(2.0)
    rates.record_job(mem, info, "loss", 64, 8.0, 2000, part="truncated")  # 250 tokens/s
    est = rates.estimate_job(mem, info, "loss", tok, 64)
    assert est["seconds"] == pytest.approx(2.0 + 16.0) and est["missing"] == []
    assert rates.job_eta_text(est) == ("about 18 s at the last measured 500 tokens/s untouched, 250 tokens/s "
                                       "truncated (a loss vs rank run at L = 64 on this model and device)")
    with pytest.raises(ValueError, match="loss has no part ''"):
        rates.estimate_job(mem, info, "loss", 100, 64)
    # the records are rate records: memo counters skip them
    assert all(rates.is_record(k) for k in mem.c)


# --- every job records what it ran ----------------------------------------------------------------------------------
def test_each_job_records_the_tokens_it_ran_through_the_model(tmp_path, tiny_checkpoint):
    cache = tmp_path / "c"
    ck = str(tiny_checkpoint)
    run = capture(cache, ck, DOCS)
    info, n_doc = info_of(run), sum(d["n_tokens"] for d in run["documents"])
    r = rates.read_job(memo(cache), info, "capture", 64)
    assert r is not None and r["tokens"] == n_doc and r["seconds"] > 0
    capture(cache, ck, DOCS)  # every document read back: nothing measured, the record stays
    assert rates.read_job(memo(cache), info, "capture", 64) == r
    assert rates.read_job(memo(cache), info, "capture", 128) is None

    st = Store(cache)
    docs = tuple(tuple(d) for d in run["spec"]["documents"])

    def done(kind, spec):
        jid = st.submit(kind, jobs.spec_to_dict(spec))
        assert work(cache) == 1
        rec = st.job(jid)
        assert rec["status"] == "done", rec["error"]
        return rec["result"]

    # loss vs rank: the untouched and the truncated passes apart
    done("loss", jobs.LossJob(model=ck, documents=docs, ranks=(1, 4), heads="layers:1", segment_len=64))
    un, tr = (rates.read_job(memo(cache), info, "loss", 64, p) for p in ("untouched", "truncated"))
    assert un["tokens"] == n_doc and tr["tokens"] == 2 * n_doc and un["seconds"] > 0 and tr["seconds"] > 0
    done("loss", jobs.LossJob(model=ck, documents=docs, ranks=(2,), heads="layers:1", segment_len=64))
    assert rates.read_job(memo(cache), info, "loss", 64, "untouched") == un  # read from the memo: not measured
    assert rates.read_job(memo(cache), info, "loss", 64, "truncated")["tokens"] == n_doc

    # truncate & compare: both runs' prompt and new tokens, the loss documents twice
    spec = jobs.TruncateCompareJob(model=ck, ranks=((1, 0, 1), (3, 1, 2)), task="niah_single_1", target_len=300,
                                   max_new_tokens=5, segment_len=64, loss_documents=docs[:1])
    res = done("truncate", spec)
    r = rates.read_job(memo(cache), info, "truncate", 64)
    assert r["tokens"] == 2 * res["prompt_tokens"] + len(res["untouched"]["tokens"]) + \
        len(res["truncated"]["tokens"]) + 2 * run["documents"][0]["n_tokens"] and r["seconds"] > 0
    assert done("truncate", spec)["memo_hit"] and rates.read_job(memo(cache), info, "truncate", 64) == r

    # state patching: A, B twice with the three answers, then B and the continuation twice
    spec = jobs.PatchJob(model=ck, prompt_a=short_text(200, 1), prompt_b=short_text(150, 2), heads="1:0",
                         segment_len=64, max_new_tokens=4)
    res = done("patch", spec)
    r = rates.read_job(memo(cache), info, "patch", 64)
    p = res["prompt_tokens"]
    assert res["loss"] and r["tokens"] == p["A"] + 2 * p["B"] + sum(len(a["tokens"]) for a in res["answers"].values()) \
        + 2 * (p["B"] + res["loss"]["n"]) and r["seconds"] > 0
    assert done("patch", spec)["memo_hit"] and rates.read_job(memo(cache), info, "patch", 64) == r
    # none of them counts as a computed memo entry of a sweep, and none is a sweep's answers rate
    assert all(rates.read(memo(cache), info, t, 300, 64, None) is None for t in ("niah_single_1",))


# --- the pages ------------------------------------------------------------------------------------------------------
def test_the_job_pages_say_no_estimate_before_a_job_and_the_measured_rate_after(env, tmp_path, tiny_checkpoint):
    cache = env(tmp_path / "c")
    run = capture(cache, tiny_checkpoint, DOCS)
    n_doc = sum(d["n_tokens"] for d in run["documents"])

    # Loss vs rank: the passes' tokens, untouched and truncated
    at = app("loss", run=run)
    at.run()
    at.text_input(key="ls_ranks").input("2").run()
    cap = [c for c in captions(at) if "forward passes" in c]
    assert cap and f"{n_doc:,} tokens untouched and {n_doc:,} truncated" in cap[0], captions(at)
    assert "no estimate yet (no earlier loss vs rank run at L = 64 on this model, dtype and device)" in cap[0]
    at.button(key="ls_run").click().run()
    work(cache)
    at.run()
    assert not at.exception
    cap = [c for c in captions(at) if "forward passes" in c][0]
    assert ": about " in cap and " tokens/s untouched, " in cap and " tokens/s truncated (a loss vs rank run at L = " \
        "64 on this model and device)" in cap, cap

    # Truncate & compare: both runs' tokens, then the rate of the comparison it ran
    at = app("truncate", run=run)
    at.run()
    at.number_input(key="tr_g0_r").set_value(1)
    at.number_input(key="tr_target_len").set_value(400)
    at.number_input(key="tr_max_new").set_value(6).run()
    cap = [c for c in captions(at) if c.startswith("Each of the two runs (untouched, truncated): ")]
    assert cap and f"up to 6 new tokens and the run's documents ({n_doc:,} tokens), so **up to about " in cap[0] \
        and "no estimate yet (no earlier truncate & compare run at L = 64 on this" in cap[0], captions(at)
    at.button(key="tr_run").click().run()
    work(cache)
    at.run()
    cap = [c for c in captions(at) if c.startswith("Each of the two runs (untouched, truncated): ")][0]
    assert ": about " in cap and " tokens/s (a truncate & compare run at L = 64 on this model and device)" in cap, cap

    # State patching
    at = app("patching", run=run)
    at.run()
    at.text_input(key="pt_heads").input("1:0")
    at.number_input(key="pt_len").set_value(400)
    at.number_input(key="pt_new").set_value(4).run()
    cap = [c for c in captions(at) if "through the model: " in c]
    assert cap and cap[0].startswith("Up to about **") and "no estimate yet (no earlier state patching run at L = " \
        "64" in cap[0], captions(at)
    at.button(key="pt_run").click().run()
    work(cache)
    at.run()
    cap = [c for c in captions(at) if "through the model: " in c][0]
    assert " tokens/s (a state patching run at L = 64 on this model and device)" in cap, cap


def test_the_capture_section_says_the_documents_tokens_and_the_time_of_the_last_capture(env, tmp_path):
    cache = env(tmp_path / "c")
    at = app()
    at.run()
    at.multiselect(key="sample_docs").select("lincoln_two_speeches.txt").run()  # not inspected yet
    assert any(c.startswith("1 document (none for a document already captured with these settings): no estimate "
                            "yet (the model is not inspected yet)") for c in captions(at)), captions(at)
    work(cache)
    at.number_input(key="segment_len").set_value(64).run()
    n = int(at.dataframe[0].value["tokens"][0])
    want = f"1 document, **{n:,} tokens** through the model (none for a document already captured with these " \
        "settings): "
    assert any(c == want + "no estimate yet (no earlier capture at L = 64 on this model, dtype and device)"
               for c in captions(at)), captions(at)
    at.button(key="run_capture").click().run()
    work(cache)
    at.run()
    assert not at.exception
    at.multiselect(key="sample_docs").select("genesis_1_2_kjv.txt").run()  # another set: the last capture's rate
    cap = [c for c in captions(at) if c.startswith("2 documents, **")]
    assert cap and " tokens/s (a capture at L = 64 on this model and device)" in cap[0] and ": about " in cap[0], \
        captions(at)
