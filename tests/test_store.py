"""The store (queue, job records, memo with checksums, previous runs, heartbeats), job specs and keys, document
decoding, and figure export. No model, no worker: fast."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
import zipfile

import numpy as np
import pandas as pd
import pytest

from gdnviz import documents as D
from gdnviz import figures as F
from gdnviz import jobs
from gdnviz.errors import DocumentTooLong, EmptyDocument, NotText
from app_fixtures import tiny_checkpoint  # noqa: F401  (fixture)
from gdnviz.store import Store, content_hash, corrupt_memo_entry, default_cache_dir, describe_exit, pid_alive


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "cache")
    yield s
    s.close()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# --- jobs -----------------------------------------------------------------------------------------------------
def test_queue_is_fifo_and_records_merge_progress(store):
    a = store.submit("inspect", {"model": "x"})
    b = store.submit("capture", {"model": "y"}, label="cap")
    assert store.queued_count() == 2
    assert store.job(a)["status"] == "queued" and store.job(b)["label"] == "cap"
    store.set_progress(a, 3, 12, "layer 3")
    rec = store.job(a)
    assert rec["progress"]["fraction"] == pytest.approx(0.25) and rec["progress"]["text"] == "layer 3"
    first = store.claim_job(123)
    assert (first["id"], first["status"], first["worker_pid"]) == (a, "running", 123)
    assert store.job(a)["status"] == "running" and store.queued_count() == 1
    assert store.claim_job(123)["id"] == b and store.claim_job(123) is None and store.queued_count() == 0
    assert store.job("nope") is None


def test_claim_skips_cancelled_jobs_and_finish_answers_only_the_claimer(store):
    """A job cancelled while queued is dropped, one whose cancel flag is set ends cancelled at the claim; a
    finished job is answered once: a second answer (or one from another pid) changes nothing."""
    a, b, c = (store.submit("capture", {}) for _ in range(3))
    store.cancel(a)
    store.jobs.set(f"cancel:{b}", True)  # the flag is set; the queued record not yet changed
    rec = store.claim_job(7)
    assert rec["id"] == c and store.job(b)["status"] == "cancelled"
    assert store.job(b)["error"] == "cancelled before it started"
    assert store.finish_job(c, 8, status="done", result={"x": 1})["status"] == "running"  # not its claim
    assert store.finish_job(c, 7, status="done", result={"x": 1})["result"] == {"x": 1}
    assert store.finish_job(c, 7, status="failed", error="late")["status"] == "done"
    assert store.reap_worker(7, -9) == [] and store.job(c)["status"] == "done"
    assert "running:7" not in store.jobs


def test_cancel_queued_job_is_immediate(store):
    a = store.submit("capture", {})
    store.cancel(a)
    rec = store.job(a)
    assert rec["status"] == "cancelled" and rec["cancel_requested"]
    assert store.cancel_requested(a)


def test_wait_times_out_and_returns_terminal(store):
    a = store.submit("capture", {})
    with pytest.raises(TimeoutError):
        store.wait(a, timeout=0.2, poll=0.05)
    store.update_job(a, status="done", result={"ok": 1})
    assert store.wait(a, timeout=1)["result"] == {"ok": 1}


# --- memo -----------------------------------------------------------------------------------------------------
def test_memo_roundtrip_and_corruption_is_a_miss(store):
    payload = os.urandom(100_000)  # > diskcache's file threshold: stored as a file
    store.memo_put("k", payload)
    assert store.memo_get("k") == payload and store.memo_has("k")
    corrupt_memo_entry(store, "k")
    assert store.memo_get("k") is None  # checksum mismatch
    assert "k" not in store.memo  # deleted, so it will be recomputed
    store.memo_put("small", b"abc")
    store.memo.set("small", b"garbage without header")
    assert store.memo_get("small") is None
    assert store.memo_get("absent") is None


def test_memo_corrupt_file_on_disk(store):
    payload = os.urandom(200_000)
    store.memo_put("f", payload)
    files = [p for p in (store.dir / "memo").rglob("*.val")]
    assert files, "large values live in files"
    data = bytearray(files[0].read_bytes())
    data[1000] ^= 0x55
    files[0].write_bytes(bytes(data))
    assert store.memo_get("f") is None
    files[0].unlink(missing_ok=True)


def test_memo_json(store):
    store.memo_put_json("j", {"a": [1, 2], "b": np.arange(3)})
    assert store.memo_get_json("j") == {"a": [1, 2], "b": [0, 1, 2]}
    with pytest.raises(TypeError):
        store.memo_put("x", "not bytes")


# --- runs -----------------------------------------------------------------------------------------------------
def _run_entry(rid: str, created: float) -> dict:
    return dict(run_id=rid, created=created, documents=[dict(name="d", key="capture:x", n_tokens=3)], segment_len=64,
                dtype="float32", device="cpu", model={}, model_name="m", spec={})


def test_previous_runs_most_recent_first(store):
    assert store.latest_run() is None and store.list_runs() == []
    for rid in ("r1", "r2", "r3"):
        store.add_run(_run_entry(rid, time.time()))
    assert [r["run_id"] for r in store.list_runs()] == ["r3", "r2", "r1"]
    store.add_run(_run_entry("r1", 0))  # reopened: moves to the front
    assert store.latest_run()["run_id"] == "r1"
    store.delete_run("r2")
    assert store.run("r2") is None


# --- workers --------------------------------------------------------------------------------------------------
def test_heartbeats_and_reaping(store):
    store.heartbeat(os.getpid(), state="idle")
    assert [h["pid"] for h in store.live_workers()] == [os.getpid()]
    dead = _dead_pid()
    assert not pid_alive(dead)
    store.heartbeat(dead, state="running capture")
    jid = store.submit("capture", {})
    assert store.claim_job(dead)["id"] == jid
    assert dead not in [h["pid"] for h in store.live_workers()]
    failed = store.reap_worker(dead, -9, restarted=True)
    assert failed == [jid]
    rec = store.job(jid)
    assert rec["status"] == "failed" and rec["error_type"] == "WorkerCrashed"
    assert rec["error"] == ("the worker process died while running this job (exit code -9 (killed by SIGKILL)); "
                            "it has been restarted")
    assert all(h["pid"] != dead for h in store.heartbeats())


def test_reap_dead_finds_jobs_of_vanished_workers(store):
    dead = _dead_pid()
    jid = store.submit("capture", {})
    store.claim_job(dead)
    assert store.reap_dead() == [jid] and store.reap_dead() == []
    assert "exit code unknown" in store.job(jid)["error"]


def test_describe_exit():
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-15) == "exit code -15 (killed by SIGTERM)"
    assert describe_exit(None) == "exit code unknown"


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("GDNVIZ_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == (tmp_path / "c").resolve()
    monkeypatch.delenv("GDNVIZ_CACHE_DIR")
    assert default_cache_dir().name == "cache"


# --- specs and keys -------------------------------------------------------------------------------------------
def test_spec_roundtrip_through_dicts():
    specs = [jobs.InspectModelJob(model="m"),
             jobs.CaptureJob(model="m", documents=(("a", "text"),), segment_len=64),
             jobs.TruncateCompareJob(model="m", ranks=((0, 1, 4), (3, 2, 1)), task="vt", loss_documents=(("a", "t"),)),
             jobs.LossJob(model="m", documents=(("a", "t"),), heads=((0, 1),))]
    for s in specs:
        d = json.loads(json.dumps(jobs.spec_to_dict(s)))  # lists instead of tuples, as after JSON
        assert jobs.spec_from_dict(d) == s
        assert hash(s) == hash(jobs.spec_from_dict(d))


def test_cache_key_depends_on_every_determinant(monkeypatch):
    base = jobs.capture_key("fp", [1, 2, 3], 256, "float32", "cpu")
    assert base == jobs.capture_key("fp", [1, 2, 3], 256, "float32", "cpu")
    others = [jobs.capture_key("fp2", [1, 2, 3], 256, "float32", "cpu"),
              jobs.capture_key("fp", [1, 2, 4], 256, "float32", "cpu"),
              jobs.capture_key("fp", [1, 2, 3], 128, "float32", "cpu"),
              jobs.capture_key("fp", [1, 2, 3], 256, "bfloat16", "cpu"),
              jobs.capture_key("fp", [1, 2, 3], 256, "float32", "cuda")]
    assert len({base, *others}) == 6
    monkeypatch.setitem(jobs.VERSIONS, "capture", "capture-v999")
    assert jobs.capture_key("fp", [1, 2, 3], 256, "float32", "cpu") != base
    assert content_hash({"a": 1, "b": (1, 2)}) == content_hash({"b": [1, 2], "a": 1})


# --- documents ------------------------------------------------------------------------------------------------
def test_decode_upload_errors_name_what_went_wrong():
    with pytest.raises(EmptyDocument, match="empty"):
        D.decode_upload("a.txt", b"")
    with pytest.raises(EmptyDocument, match="empty"):
        D.decode_upload("a.txt", b" \n\t ")
    with pytest.raises(NotText, match="byte offset 3"):
        D.decode_upload("b.bin", b"abc\x00\x01\x02")
    with pytest.raises(NotText, match=r"not valid UTF-8 text: byte 0xe9 at byte offset 3"):
        D.decode_upload("latin.txt", "café au lait".encode("latin-1"))
    assert D.decode_upload("bom.txt", "\ufeffhello".encode()) == "hello"
    assert D.decode_upload("ok.md", "# Title\n\ntext é".encode()) == "# Title\n\ntext é"


def test_check_length_gives_both_numbers():
    D.check_length("d", 10, 10)
    with pytest.raises(DocumentTooLong, match="11 tokens, over the limit of 10"):
        D.check_length("d", 11, 10)


def test_sample_documents_are_public_domain_texts_of_a_few_thousand_tokens(tiny_checkpoint):
    docs = D.sample_documents()
    assert 3 <= len(docs) <= 4
    tok = D.load_fast_tokenizer(tiny_checkpoint)
    for d in docs:
        n = len(D.tokenize(tok, d.text))
        assert 1000 <= n <= 5000, (d.name, n)
        assert D.sample_title(d)


def test_fast_tokenizer_matches_transformers(tiny_checkpoint):
    """Token counts in the app (tokenizers) equal what the worker feeds the model (transformers)."""
    from transformers import AutoTokenizer

    fast = D.load_fast_tokenizer(tiny_checkpoint)
    hf = AutoTokenizer.from_pretrained(tiny_checkpoint)
    for d in D.sample_documents():
        assert D.tokenize(fast, d.text) == D.tokenize(hf, d.text)


# --- figures and export ---------------------------------------------------------------------------------------
def test_figure_builders_export_png_svg_and_zip(tmp_path):
    rng = np.random.default_rng(0)
    table = pd.DataFrame([dict(layer=l, head=h, erank=rng.uniform(1, 10), horizon=10 ** rng.uniform(0, 4),
                               numerical_rank=16, stable_rank=2.0, mean_key_norm=0.5, key_cov_erank=3.0,
                               decayed_P_erank=3.0, energy_rank99=8.0) for l in (0, 1, 3) for h in range(4)])
    for m in F.HEATMAP_METRICS:
        table[f"{m}_min"], table[f"{m}_max"] = table[m] * 0.9, table[m] * 1.1
    table["n_docs"] = 2
    heat = F.heatmap(F.heatmap_frame(table, "horizon"), "horizon", selected=(1, 2), picked=[(0, 0)])
    spec = heat.to_dict()
    assert spec["params"][0]["name"] == "cell" and spec["encoding"]["color"]["scale"]["type"] == "log"
    assert {t["title"] for t in spec["encoding"]["tooltip"]} >= {"min over documents", "max over documents"}
    kw = dict(n_gdn=18, h_v=16, h_k=16, d_k=128, d_v=128, n_attn=6, h_kv=2, d_h=256, conv_kernel=4, batch=1,
              b_state=4, b_kv=2, b_conv=2)
    bud = F.cache_budget_frame(contexts=[1024, 1 << 20], **kw)
    rec = bud[bud.cache == "GDN recurrent state"]["bytes"]
    assert (rec == 18 * 16 * 128 * 128 * 4).all()  # constant in T
    kv = bud[bud.cache == "full-attention KV"].set_index("context")["bytes"]
    assert kv[1 << 20] == 6 * 2 * 2 * 256 * (1 << 20) * 2
    assert F.crossover_context(**kw) == pytest.approx(18 * 16 * 128 * 128 * 4 / (6 * 2 * 2 * 256 * 2))
    charts = {"heat": (heat, table), "evh": (F.erank_vs_horizon_chart(table, 0.5), table),
              "hist": (F.horizon_hist_chart(table, 256), table),
              "forget": (F.forgetting_chart(F.forgetting_by_layer_frame(table, 256), 256), None),
              "budget": (F.cache_budget_chart(bud, 1536.0), bud)}
    png = F.to_png(charts["evh"][0])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert F.to_svg(charts["hist"][0]).lstrip().startswith("<svg")
    z = zipfile.ZipFile(io.BytesIO(F.run_zip(charts, {"segment_len": 256}, {"heads": table})))
    names = set(z.namelist())
    assert {"settings.json", "figures/heat.png", "figures/heat.svg", "data/heat.csv", "tables/heads.csv",
            "figures/budget.png"} <= names
    assert json.loads(z.read("settings.json")) == {"segment_len": 256}
