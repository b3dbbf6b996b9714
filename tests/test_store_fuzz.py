"""One damaged store entry takes no page down and shows nothing wrong: every kind of entry of a real store (a
previous run, job records, progress, the queue, memo entries of a capture and of a sweep, a worker heartbeat) is
truncated, garbled and deleted on disk in turn, and every page of the app is opened (AppTest) with the damaged
run picked. Unreadable entries are skipped and reported; a damaged capture is recomputed, never shown, and its
zip is not offered without saying why."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from app_fixtures import short_text, tiny_checkpoint  # noqa: F401  (fixture)
from gdnviz import jobs
from gdnviz.errors import CorruptStoreEntry
from gdnviz.store import Store
from support import store_fuzz
from test_app_pages import app, capture, charts, env, texts, work  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow
PAGES = ("documents", "heatmap", "head", "overview", "truncate", "sweeps", "budget")
#: kind of entry -> (area, how its key starts)
KINDS = {"run": ("runs", "run-"), "capture job": ("jobs", "job:"), "sweep job": ("jobs", "job:"),
         "progress": ("jobs", "progress:"), "queued job": ("jobs", "queue-"), "capture memo": ("memo", "capture:"),
         "sweep memo": ("memo", "sweep"), "heartbeat": ("workers", "hb:")}


@pytest.fixture(scope="module")
def template(tmp_path_factory, tiny_checkpoint):
    """A store with one run (two documents), a finished sweep, a finished capture job, a queued job and a
    heartbeat."""
    d = tmp_path_factory.mktemp("fuzz_template")
    run = capture(d, tiny_checkpoint, (("alpha", short_text(200, 0)), ("beta", short_text(180, 3))))
    store = Store(d)
    sw = store.submit("sweep", jobs.spec_to_dict(jobs.SweepJob(
        model=str(tiny_checkpoint), tasks=("niah_single_1",), lengths=(300,), ranks=(2,), n=1, max_new_tokens=4,
        segment_len=64)))
    work(d)
    assert store.job(sw)["status"] == "done", store.job(sw)["error"]
    queued = store.submit("inspect", {"model": str(tiny_checkpoint)})
    store.heartbeat(os.getpid(), state="idle")
    capture_jid = next(r["id"] for r in _jobs(store) if r["kind"] == "capture")
    store.close()
    return d, run, dict(sweep=sw, capture=capture_jid, queued=queued)


def _jobs(store):
    from gdnviz.store import iter_jobs

    return list(iter_jobs(store))


def _row(cache: Path, kind: str, ids: dict) -> int:
    area, prefix = KINDS[kind]
    want = {"capture job": f"job:{ids['capture']}", "sweep job": f"job:{ids['sweep']}",
            "progress": f"progress:{ids['sweep']}"}.get(kind)
    for rowid, key, _f, _n in store_fuzz.rows(cache / area):
        k = key.decode() if isinstance(key, bytes) else str(key)
        if (want is not None and k == want) or (want is None and k.startswith(prefix)):
            return rowid
    raise AssertionError(f"no {kind} entry in {area}")


@pytest.mark.parametrize("how", store_fuzz.HOW)
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_page_renders_with_one_damaged_entry(env, template, tmp_path, kind, how):
    src, run, ids = template
    cache = tmp_path / "cache"
    shutil.copytree(src, cache)
    area = KINDS[kind][0]
    store_fuzz.damage(cache / area, _row(cache, kind, ids), how)
    env(cache)
    import streamlit as st

    st.cache_resource.clear()  # a server started on the damaged store
    st.cache_data.clear()
    at = app(run=run)
    at.session_state["sweep_job"] = ids["sweep"]
    for page in PAGES:
        at.switch_page(f"pages/{page}.py").run()
        assert not at.exception, (page, [e.value for e in at.exception])
        shown = " ".join(texts(at, "error") + texts(at, "warning") + texts(at, "caption") + texts(at, "info"))
        assert "internal error" not in shown.lower() and "Traceback" not in shown, (page, shown)
        if kind == "run" and page in ("heatmap", "head", "overview"):
            assert not charts(at)
            if how == "delete":
                assert any(f"{run['run_id']}" in e and "no longer in the store" in e for e in texts(at, "error"))
            else:
                assert any(f"{run['run_id']}" in e and "cannot be read" in e for e in texts(at, "error")), shown
        if kind == "run" and how != "delete":
            assert any("1 stored run cannot be read" in w for w in texts(at, "warning")), (page, shown)
        if kind == "capture memo" and page in ("heatmap", "overview"):
            assert not charts(at)
            assert any("is missing or corrupt" in w for w in texts(at, "warning")), shown
            assert "Download this run (zip)" not in [b.proto.label for b in at.get("download_button")]
            assert any("cannot be exported" in c for c in texts(at, "caption")), shown
        if kind == "sweep job" and page == "sweeps":
            assert "sw_prev" not in [s.key for s in at.selectbox]  # the only finished sweep is not listed
            if how != "delete":
                assert any("1 stored job record cannot be read" in c for c in texts(at, "caption")), shown
                assert any("Sweep failed: its record in the store cannot be read" in e for e in texts(at, "error"))
    # the worker's side: the queue and the job records still work
    store = Store(cache)
    for _ in range(3):
        store.claim_job(os.getpid())
    assert store.claim_job(os.getpid()) is None
    if kind != "run":
        assert store.run(run["run_id"]) == Store(src).run(run["run_id"])
    elif how == "delete":
        assert store.run(run["run_id"]) is None
    else:
        with pytest.raises(CorruptStoreEntry, match=run["run_id"]):
            store.run(run["run_id"])
        assert run["run_id"] in dict(store.read_runs()[1])
