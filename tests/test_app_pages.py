"""Every page of the app under Streamlit's AppTest, on a tmp cache directory and a tiny real checkpoint.

No worker process: GDNVIZ_NO_WORKER=1, and the tests run queued jobs in-process with ``Worker.run_pending`` (the
same code the worker runs). Chart clicks are injected through ``at.session_state`` (AppTest cannot click).
"""
from __future__ import annotations

import io
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from streamlit.testing.v1 import AppTest

from app_fixtures import build_not_gdn, short_text, tiny_checkpoint  # noqa: F401  (fixture)
from gdnviz import jobs
from gdnviz.plotstyle import human_bytes
from gdnviz.store import Store, corrupt_memo_entry

ROOT = Path(__file__).resolve().parent.parent
APP = str(ROOT / "app.py")
_WORKERS: dict = {}


def work(cache) -> int:
    """Run every queued job in-process (one Worker per cache directory keeps its model loaded)."""
    from gdnviz.worker import Worker

    key = str(cache)
    if key not in _WORKERS:
        _WORKERS[key] = Worker(Store(cache))
    return _WORKERS[key].run_pending()


def app(page: str | None = None, *, run: dict | None = None, **query) -> AppTest:
    """The app opened on ``page`` in a new session; ``run``: the session has picked that run (a new session shows
    no run of another session until it picks one)."""
    at = AppTest.from_file(APP, default_timeout=180)
    if run is not None:
        at.session_state["run_id"] = run["run_id"]
    if page:
        at.switch_page(f"pages/{page}.py")
    for k, v in query.items():
        at.query_params[k] = str(v)
    return at


def inspected(cache) -> AppTest:
    """The app on its first page after the worker has inspected the default model (the usual starting point)."""
    at = app()
    at.run()
    work(cache)
    at.run()
    return at


def texts(at, kind: str) -> list[str]:
    return [e.value for e in getattr(at, kind)]


def progress(at) -> list[str]:
    return [p.proto.text for p in at.get("progress")]


def charts(at) -> list:
    return list(at.get("vega_lite_chart"))


def chart_titles(at) -> list[str]:
    import json

    out = []
    for c in charts(at):
        t = json.loads(c.proto.spec).get("title", "")
        out.append(t.get("text", "") if isinstance(t, dict) else t)
    return out


def capture(cache, ck, docs, L=64) -> dict:
    store = Store(cache)
    jid = store.submit("capture", jobs.spec_to_dict(jobs.CaptureJob(model=str(ck), documents=docs, segment_len=L)))
    work(cache)
    rec = store.job(jid)
    assert rec["status"] == "done", rec["error"]
    return store.run(rec["result"]["run_id"])


@pytest.fixture
def env(monkeypatch, tiny_checkpoint):
    """Point the app at a cache directory (``env(dir)``) and the tiny checkpoint; no worker process."""
    from gdnviz.ui import worker_client  # noqa: F401

    monkeypatch.setenv("GDNVIZ_DEFAULT_MODEL", str(tiny_checkpoint))
    monkeypatch.setenv("GDNVIZ_NO_WORKER", "1")
    monkeypatch.setenv("GDNVIZ_POLL_SECONDS", "0")  # AppTest does not tick fragments; the tests rerun pages
    monkeypatch.delenv("GDNVIZ_TEST_OOM", raising=False)

    def use(cache):
        monkeypatch.setenv("GDNVIZ_CACHE_DIR", str(cache))
        return Path(cache)

    return use


@pytest.fixture(scope="module")
def populated(tmp_path_factory, tiny_checkpoint):
    """A cache directory holding one run: two short documents, L = 64."""
    d = tmp_path_factory.mktemp("populated")
    run = capture(d, tiny_checkpoint, (("alpha", short_text(300, 0)), ("beta", short_text(260, 3))))
    return d, run


# =============================================================================================================
# Model & documents
# =============================================================================================================
def test_documents_page_inspects_and_captures(env, tmp_path, tiny_checkpoint):
    cache = env(tmp_path / "c")
    at = app()
    at.run()
    assert not at.exception
    assert at.session_state["model_source"] == "path" and at.text_input(key="model_path").value == str(tiny_checkpoint)
    assert any("Inspecting" in t for t in progress(at))
    work(cache)
    at.run()
    table = " ".join(texts(at, "markdown"))
    assert "qwen3_5" in table and "3 of 4" in table and "16 × 16" in table and "**torch**" in table
    at.button(key="run_capture").proto.disabled is True  # no documents yet
    assert any("document set is empty" in t for t in texts(at, "info"))

    # samples: token counts in the table
    at.multiselect(key="sample_docs").select("lincoln_two_speeches.txt").run()
    df = at.dataframe[0].value
    assert list(df["document"]) == ["lincoln_two_speeches.txt"] and 1000 < int(df["tokens"][0]) < 5000
    at.multiselect(key="sample_docs").unselect("lincoln_two_speeches.txt").run()

    # paste a short document and capture it
    at.text_input(key="paste_name").input("mine")
    at.text_area(key="paste_text").input(short_text(200))
    at.button(key="paste_add").click().run()
    assert list(at.dataframe[0].value["document"]) == ["mine"]
    at.number_input(key="segment_len").set_value(64)
    at.button(key="run_capture").click().run()
    jid = at.session_state["capture_job"]
    assert Store(cache).job(jid)["status"] == "queued"
    assert any("queued" in t for t in progress(at))
    work(cache)
    at.run()
    assert not at.exception
    assert any("Captured 1 document" in t for t in texts(at, "success"))
    run = Store(cache).latest_run()
    assert at.session_state["run_id"] == run["run_id"] and run["segment_len"] == 64
    # the previous-runs list and the sidebar picker show it
    assert run["run_id"] in list(at.dataframe[-1].value["run"])
    assert at.selectbox(key="sb_run").value == run["run_id"]


def test_cancel_a_capture_from_the_page(env, tmp_path):
    cache = env(tmp_path / "c")
    at = inspected(cache)
    at.text_area(key="paste_text").input(short_text(100))
    at.button(key="paste_add").click().run()
    at.button(key="run_capture").click().run()
    jid = at.session_state["capture_job"]
    at.button(key="capture_job_cancel").click().run()
    assert Store(cache).job(jid)["status"] == "cancelled"
    assert work(cache) == 0 and Store(cache).queued_count() == 0  # the worker drops it from the queue, unrun
    at.run()
    assert Store(cache).job(jid)["status"] == "cancelled"
    assert any("Capture was cancelled" in i for i in texts(at, "info"))


def test_a_cancel_mid_step_says_the_worker_restarts_and_then_says_it_did(env, tmp_path):
    """A running job's cancel says a long step is stopped by restarting the worker; a job the cancel watcher ended
    shows the watcher's text (gdnviz.worker.CANCEL_RESTART_TEXT), not a bare "cancelled"."""
    import os
    import time

    from gdnviz.worker import CANCEL_GRACE, CANCEL_RESTART_TEXT

    cache = env(tmp_path / "c")
    at = inspected(cache)
    at.text_area(key="paste_text").input(short_text(100))
    at.button(key="paste_add").click().run()
    at.button(key="run_capture").click().run()
    jid = at.session_state["capture_job"]
    s = Store(cache)
    assert s.claim_job(os.getpid())["id"] == jid
    s.cancel(jid)
    at.run()
    assert any("restarting the worker" in c for c in texts(at, "caption"))
    s.finish_job(jid, os.getpid(), status="cancelled", finished=time.time(),
                 error=CANCEL_RESTART_TEXT.format(grace=CANCEL_GRACE))
    at.run()
    assert any("Capture was cancelled: " in i and "the worker was restarted" in i for i in texts(at, "info"))


def test_the_upload_limit_is_said_in_words_before_a_file_is_chosen(env, tmp_path):
    """The browser refuses a file over server.maxUploadSize with only a red icon (the server never sees it), so the
    page states the limit in words under the uploader, from the server's own option."""
    cache = env(tmp_path / "c")
    at = inspected(cache)
    limit = at.get("file_uploader")[0].proto.max_upload_size_mb  # what the browser enforces
    assert limit > 0
    assert any(f"at most {limit} MB per file" in c and "red icon" in c for c in texts(at, "caption"))


def test_empty_pasted_text(env, tmp_path):
    env(tmp_path / "c")
    at = app()
    at.run()
    at.button(key="paste_add").click().run()
    assert any("is empty: paste some text" in t for t in texts(at, "error"))


def test_bad_setting_stops_the_app_with_its_name(env, tmp_path, monkeypatch):
    """An environment variable that does not parse gets a message naming it, not a traceback."""
    env(tmp_path / "c")
    monkeypatch.setenv("GDNVIZ_MAX_TOKENS", "lots")
    at = app()
    at.run()
    assert not at.exception
    assert any("GDNVIZ_MAX_TOKENS='lots' is not an integer" in t for t in texts(at, "error"))


@pytest.mark.parametrize("name,data,message", [
    ("photo.txt", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "looks like a binary file (a NUL byte at byte offset 8)"),
    ("latin1.txt", "Le café est prêt.".encode("latin-1"), "is not valid UTF-8 text: byte 0xe9 at byte offset 6"),
    ("blank.md", b"", "is an empty file"),
    ("notes16.txt", "Notes in UTF-16.".encode("utf-16"), "is UTF-16 text (it starts with a UTF-16 little-endian byte-order mark)"),
    ("be16.txt", "Big-endian.".encode("utf-16-be").join([b"\xfe\xff", b""]), "iconv -f UTF-16 -t UTF-8"),
])
def test_bad_uploads(env, tmp_path, name, data, message):
    env(tmp_path / "c")
    at = app()
    at.run()
    at.file_uploader[0].set_value([(name, data, "text/plain"), ("good.md", b"# fine\n\nsome text", "text/plain")])
    at.run()
    assert not at.exception
    errs = texts(at, "error")
    assert any(message in e and name in e for e in errs), errs
    assert [d["name"] for d in at.session_state["user_docs"]] == ["good.md"]  # the good file still got in
    assert any("at most 50 MB per file (a larger file is refused by the browser" in c for c in texts(at, "caption"))


def test_document_over_the_token_limit(env, tmp_path):
    cache = env(tmp_path / "c")
    at = inspected(cache)
    at.number_input(key="max_tokens").set_value(100)
    at.multiselect(key="sample_docs").select("genesis_1_2_kjv.txt").run()
    errs = texts(at, "error")
    assert any("'genesis_1_2_kjv.txt' has" in e and "over the limit of 100 tokens" in e for e in errs), errs
    assert at.button(key="run_capture").proto.disabled


def test_path_that_is_not_a_model(env, tmp_path):
    cache = env(tmp_path / "c")
    empty = tmp_path / "empty-folder"
    empty.mkdir()
    at = app()
    at.run()
    at.text_input(key="model_path").input(str(empty)).run()
    work(cache)
    at.run()
    errs = texts(at, "error")
    assert any("is not a model directory: it has no config.json" in e for e in errs), errs
    assert at.button(key="run_capture").proto.disabled


def test_model_without_gdn_layers(env, tmp_path):
    cache = env(tmp_path / "c")
    at = app()
    at.run()
    at.text_input(key="model_path").input(str(build_not_gdn(tmp_path))).run()
    work(cache)
    at.run()
    errs = texts(at, "error")
    assert any("has no Gated DeltaNet layers" in e and "qwen3" in e for e in errs), errs


def test_demo_is_the_default_model(env, tmp_path, monkeypatch):
    """Without GDNVIZ_DEFAULT_MODEL the app opens the bundled demo checkpoint and the worker inspects it."""
    cache = env(tmp_path / "c")
    monkeypatch.delenv("GDNVIZ_DEFAULT_MODEL")
    from gdnviz.ui.common import demo_installed

    assert demo_installed()
    at = app()
    at.run()
    assert not at.exception and at.session_state["model_source"] == "demo"
    assert at.session_state["inspect"]["key"][0] == "demo"
    work(cache)
    at.run()
    md = " ".join(texts(at, "markdown"))
    assert "qwen3_5" in md and "6 of 8" in md and "128 × 128" in md, md
    assert any("MODEL_CARD.md" in c for c in texts(at, "caption"))


def test_missing_demo_gives_clear_fallback(env, tmp_path, monkeypatch):
    """A checkout without the demo weights says so and offers the other sources (nothing crashes)."""
    env(tmp_path / "c")
    monkeypatch.delenv("GDNVIZ_DEFAULT_MODEL")
    from gdnviz.ui import common

    monkeypatch.setattr(common, "DEMO_DIR", tmp_path / "no-demo")
    at = app()
    at.run()
    assert not at.exception and at.session_state["model_source"] == "demo"
    assert any("demo model is not installed" in w for w in texts(at, "warning"))
    assert at.radio(key="model_source").options == ["Bundled demo model", "Local checkpoint folder",
                                                    "Local Hugging Face cache"]


def test_oom_in_the_worker_says_what_to_reduce(env, tmp_path, monkeypatch):
    cache = env(tmp_path / "c")
    at = inspected(cache)
    at.text_area(key="paste_text").input(short_text(100))
    at.button(key="paste_add").click().run()
    monkeypatch.setenv("GDNVIZ_TEST_OOM", "1")
    at.button(key="run_capture").click().run()
    work(cache)
    at.run()
    errs = texts(at, "error")
    assert any("Capture failed: The GPU ran out of memory" in e and "Reduce the document length" in e
               for e in errs), errs


def test_worker_crash_mid_job_is_reported(env, tmp_path, monkeypatch):
    """A worker that died while running the session's job: the page says so with the exit code and restarts it."""
    from gdnviz.ui import common
    from gdnviz.ui.worker_client import WorkerHandle

    cache = env(tmp_path / "c")
    store = Store(cache)
    dead = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    dead.wait()
    jid = store.submit("capture", {"model": "x", "documents": []}, label="capture")
    store.claim_job(dead.pid)
    h = WorkerHandle(store, enabled=True)
    h.proc = dead
    spare = []

    def fake_start():  # the restarted "worker": a process that stays up
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        spare.append(p)
        h.proc = p

    h.start = fake_start
    monkeypatch.setattr(common, "_handle", lambda cache_dir: h)
    try:
        at = app()
        at.session_state["capture_job"] = jid
        at.run()
        assert not at.exception
        errs = texts(at, "error")
        assert any("Capture failed: the worker process died while running this job (exit code 3); it has been "
                   "restarted" in e for e in errs), errs
        assert h.restarts == 1 and spare and h.proc is spare[0]
        assert any("restarted 1×" in c for c in texts(at, "caption"))
    finally:
        for p in spare:
            p.kill()
            p.wait()


# =============================================================================================================
# Heatmap
# =============================================================================================================
def test_heatmap_metrics_tooltips_and_click(env, populated):
    cache, run = populated
    env(cache)
    at = app("heatmap", run=run)
    at.run()
    assert not at.exception
    ch = charts(at)
    assert [c.key for c in ch] == ["heat"] and "cell" in list(ch[0].proto.selection_mode)
    import json

    spec = json.loads(ch[0].proto.spec)
    titles = {t["title"] for t in spec["encoding"]["tooltip"]}
    assert {"min over documents", "max over documents", "documents"} <= titles
    data = pa.ipc.open_stream(ch[0].proto.datasets[0].data.data).read_all().to_pandas()
    assert len(data) == 12 and set(data["layer"]) == {0, 1, 3} and (data["n_docs"] == 2).all()
    assert (data["min"] <= data["value"]).all() and (data["value"] <= data["max"]).all()

    at.radio(key="heat_metric").set_value("horizon").run()
    spec = json.loads(charts(at)[0].proto.spec)
    assert spec["encoding"]["color"]["scale"]["type"] == "log"
    for m in ("numerical_rank", "stable_rank", "energy_rank99", "mean_key_norm", "key_cov_erank",
              "decayed_P_erank"):
        at.radio(key="heat_metric").set_value(m).run()
        assert not at.exception and charts(at)
    spec = json.loads(charts(at)[0].proto.spec)
    assert "…" not in json.dumps(spec["encoding"]["color"]["title"], ensure_ascii=False)
    assert {"heat_png", "heat_svg", "heat_csv"} <= {b.key for b in at.get("download_button")}



def _panel_heading(at) -> list[str]:
    return [m for m in texts(at, "markdown") if m.startswith("### Layer ")]


def test_heatmap_click_shows_the_head_under_the_heatmap(env, populated):
    """A click on a cell (open mode) shows that head in a panel on the Heatmap page itself, in the same run: its
    heading, the Head page's six key numbers, its singular spectrum and a link to its Head page; the panel stays
    across a change of statistic and shows the next clicked head."""
    import json

    cache, run = populated
    env(cache)
    at = app("heatmap", run=run)
    at.run()
    assert not _panel_heading(at) and chart_titles(at) == ["Effective rank (directions)"]
    radio = at.radio(key="click_action")
    assert radio.value == "open" and radio.options[0] == "shows it below the heatmap"
    at.session_state["heat"] = {"selection": {"cell": [{"layer": 1, "head": 2}]}}
    at.run()
    assert not at.exception
    assert [t.value for t in at.title] == ["Heatmap"]  # no page switch
    assert _url_head(at) == ("1", "2")  # the page's URL holds the open head
    assert _panel_heading(at) == [m for m in _panel_heading(at) if m.startswith("### Layer 1 · head 2  \n")] != []
    assert run["run_id"] in _panel_heading(at)[0]
    assert [m.label for m in at.metric] == ["Effective rank", "Numerical rank", "Horizon", "Mean key norm",
                                            "Key-cov erank", "r for 99% energy"]
    from gdnviz.summary import document_set_table

    table = document_set_table(jobs.load_run_captures(Store(cache), run))
    row = table[(table["layer"] == 1) & (table["head"] == 2)].iloc[0]
    assert at.metric[0].value == f"{row['erank']:.1f}" and at.metric[5].value == f"{row['energy_rank99']:g}"
    assert any("medians over the 2 documents of this run" in c and "one document, “alpha”" in c
               for c in texts(at, "caption"))
    assert chart_titles(at) == ["Effective rank (directions)", "Singular spectrum at the document end"]
    spectrum = json.loads(charts(at)[1].proto.spec)
    assert spectrum["title"]["subtitle"][0] == "one document: “alpha”"
    links = {l.proto.label: l.proto for l in at.get("page_link")}
    assert "Open the full head page" in links and links["Open the full head page"].query_string == "layer=1&head=2"
    heat = json.loads(charts(at)[0].proto.spec)
    assert heat["title"]["subtitle"][0] == "click a cell to see that head below"
    data = pa.ipc.open_stream(charts(at)[0].proto.datasets[0].data.data).read_all().to_pandas()
    assert data.loc[data["frame"] == "open head", ["layer", "head"]].values.tolist() == [[1, 2]]

    # another statistic: the panel stays; another cell: the panel shows that head, nothing of the first
    at.radio(key="heat_metric").set_value("horizon").run()
    assert _panel_heading(at)[0].startswith("### Layer 1 · head 2  \n")
    at.session_state["heat"] = {"selection": {"cell": [{"layer": 0, "head": 3}]}}
    at.run()
    assert len(_panel_heading(at)) == 1 and _panel_heading(at)[0].startswith("### Layer 0 · head 3  \n")
    row = table[(table["layer"] == 0) & (table["head"] == 3)].iloc[0]
    assert at.metric[0].value == f"{row['erank']:.1f}"
    # the Head page opens on the panel's head; back on the heatmap the panel still shows it
    at.switch_page("pages/head.py").run()
    assert not at.exception and any(m.startswith("### Layer 0 · head 3") for m in texts(at, "markdown"))
    at.switch_page("pages/heatmap.py").run()
    assert _panel_heading(at)[0].startswith("### Layer 0 · head 3  \n")
    # closed by its button, which takes the head out of the URL
    assert _url_head(at) == ("0", "3")
    at.button(key="head_panel_close").click().run()
    assert not _panel_heading(at) and len(charts(at)) == 1
    assert _url_head(at) == (None, None)


def _url_head(at) -> tuple:
    """(layer, head) of the page's query params as AppTest holds them (strings), None where absent."""
    def one(k):
        v = at.query_params.get(k)
        return v[0] if isinstance(v, list) and v else v
    return one("layer"), one("head")


@pytest.mark.parametrize("page", ["heatmap", "overview"])
def test_a_reload_or_shared_link_reopens_the_head_panel(env, populated, page):
    """The page's URL with ?layer=l&head=h (a reload, a link sent to a colleague: a new session) opens the panel on
    that head; a click on another head then moves the URL to it; a link to no head of the model says so and opens
    nothing."""
    cache, run = populated
    env(cache)
    at = app(page, run=run, layer=3, head=1)
    at.run()
    assert not at.exception
    assert len(_panel_heading(at)) == 1 and _panel_heading(at)[0].startswith("### Layer 3 · head 1  \n")
    assert _url_head(at) == ("3", "1")
    state, param = {"heatmap": ("heat", "cell"), "overview": ("ov_evh", "head")}[page]
    at.session_state[state] = {"selection": {param: [{"layer": 0, "head": 2}]}}
    at.run()
    assert _panel_heading(at)[0].startswith("### Layer 0 · head 2  \n") and _url_head(at) == ("0", "2")
    at.run()  # the URL this session wrote does not take the panel back to the head of the link
    assert _panel_heading(at)[0].startswith("### Layer 0 · head 2  \n")
    at.button(key="head_panel_close").click().run()
    assert not _panel_heading(at) and _url_head(at) == (None, None)
    at.run()
    assert not _panel_heading(at)

    bad = app(page, run=run, layer=2, head=1)  # layer 2 is full attention in the tiny model
    bad.run()
    assert not bad.exception and not _panel_heading(bad)
    assert any("layer='2', head='1'" in e for e in texts(bad, "error")) and _url_head(bad) == (None, None)


def test_the_head_panel_follows_the_run(env, tmp_path, tiny_checkpoint):
    """Another run of the same model: the panel shows that run's numbers of the open head; a run whose model has
    no such head: the panel is closed (and stays closed on returning)."""
    from gdnviz.summary import document_set_table

    cache = env(tmp_path / "c")
    r1 = capture(cache, tiny_checkpoint, (("first", short_text(150, 2)),))
    r2 = capture(cache, tiny_checkpoint, (("second", short_text(180, 5)),))
    r3 = capture(cache, "demo", (("third", short_text(120, 1)),))
    assert 3 not in r3["model"]["gdn_layers"]
    at = app("heatmap", run=r1)
    at.run()
    at.session_state["heat"] = {"selection": {"cell": [{"layer": 3, "head": 1}]}}
    at.run()
    assert r1["run_id"] in _panel_heading(at)[0]
    at.selectbox(key="sb_run").set_value(r2["run_id"]).run()
    assert len(_panel_heading(at)) == 1 and _panel_heading(at)[0].startswith("### Layer 3 · head 1  \n")
    assert r2["run_id"] in _panel_heading(at)[0] and r1["run_id"] not in _panel_heading(at)[0]
    t2 = document_set_table(jobs.load_run_captures(Store(cache), r2))
    assert at.metric[0].value == f"{t2[(t2['layer'] == 3) & (t2['head'] == 1)].iloc[0]['erank']:.1f}"
    at.selectbox(key="sb_run").set_value(r3["run_id"]).run()
    assert not at.exception and not _panel_heading(at) and len(charts(at)) == 1
    at.selectbox(key="sb_run").set_value(r1["run_id"]).run()
    assert not _panel_heading(at) and len(charts(at)) == 1


def test_heatmap_pick_mode_builds_the_truncation_set(env, populated):
    cache, run = populated
    env(cache)
    at = app("heatmap", run=run)
    at.run()
    at.radio(key="click_action").set_value("pick").run()
    at.session_state["heat"] = {"selection": {"cell": [{"layer": 3, "head": 1}]}}
    at.run()
    assert at.session_state["picked_heads"] == [[3, 1]]
    assert any("Truncation set" in m and "L3·H1" in m for m in texts(at, "markdown"))
    at.switch_page("pages/truncate.py").run()
    assert not at.exception
    assert at.selectbox(key="tr_g0_mode").value == "picked"
    assert at.multiselect(key="tr_g0_heads").value == ["L3·H1"]
    assert any("1 of 12 heads" in c for c in texts(at, "caption"))


def _heatmap_spec_and_data(at):
    import json

    ch = charts(at)[0]
    return json.loads(ch.proto.spec), pa.ipc.open_stream(ch.proto.datasets[0].data.data).read_all().to_pandas()


def test_heatmap_pick_mode_says_what_a_click_does_and_draws_frames_on_top(env, populated):
    cache, run = populated
    env(cache)
    at = app("heatmap", run=run)
    at.run()
    spec, _ = _heatmap_spec_and_data(at)
    assert spec["title"]["subtitle"][0] == "click a cell to see that head below"
    at.radio(key="click_action").set_value("pick").run()
    for cell in ({"layer": 0, "head": 1}, {"layer": 0, "head": 2}, {"layer": 1, "head": 1}):
        at.session_state["heat"] = {"selection": {"cell": [cell]}}
        at.run()
    spec, data = _heatmap_spec_and_data(at)
    assert "see that head" not in " ".join(spec["title"]["subtitle"])
    assert not _panel_heading(at)  # a pick opens no panel
    assert spec["title"]["subtitle"][0] == "click a cell to add it to / remove it from the truncation set"
    # the framed cells are drawn after every unframed one: no neighbour drawn later covers half of a frame
    framed = (data["frame"] != "none").to_numpy()
    assert framed.sum() == 3 and framed[-3:].all()
    assert any("Truncation set** (3 heads)" in m for m in texts(at, "markdown"))
    # switching the statistic does not count the last click again
    at.radio(key="heat_metric").set_value("horizon").run()
    assert at.session_state["picked_heads"] == [[0, 1], [0, 2], [1, 1]]


def test_head_page_figures_are_built_once_per_head(env, populated, monkeypatch):
    """A head seen before is drawn from the cache: no figure of it is rebuilt (and another head is)."""
    from gdnviz import figures

    cache, run = populated
    env(cache)
    built = []
    orig = figures.spectrum_chart
    monkeypatch.setattr(figures, "spectrum_chart", lambda *a, **k: built.append(1) or orig(*a, **k))
    at = app("head", run=run, layer=3, head=3)
    at.run()
    n = len(built)
    at.switch_page("pages/heatmap.py").run()
    at.switch_page("pages/head.py").run()
    assert not at.exception and any("Layer 3 · head 3" in m for m in texts(at, "markdown"))
    assert len(built) == n
    at.query_params["layer"], at.query_params["head"] = "3", "0"
    at.run()
    assert any("Layer 3 · head 0" in m for m in texts(at, "markdown")) and len(built) == n + 1
    assert chart_titles(at)[0] == "Singular spectrum at the document end"


# =============================================================================================================
# Head
# =============================================================================================================
def test_head_deep_link_in_a_new_session(env, populated):
    cache, run = populated
    env(cache)
    at = app("head", run=run, layer=3, head=1)
    at.run()
    assert not at.exception
    assert any("Layer 3 · head 1" in m for m in texts(at, "markdown"))
    assert any(run["run_id"] in m for m in texts(at, "markdown"))
    # the figures, one tab at a time: only the open tab's figures are built and drawn
    import json

    labels = [t.label for t in at.tabs]
    assert labels == ["Spectrum & effective rank", "Energy kept", "Decay α & key cone", "Over the documents"]
    per_tab = {}
    specs, n_downloads, frames = {}, 0, []
    for label in labels:
        if label != labels[0]:
            at.session_state["head_tab"] = label
            at.run()
            assert not at.exception
        per_tab[label] = chart_titles(at)
        specs.update({json.loads(c.proto.spec)["title"]["text"]: json.loads(c.proto.spec) for c in charts(at)})
        n_downloads += len(at.get("download_button"))
        frames += [d.value for d in at.dataframe]
        assert any("Layer 3 · head 1" in m for m in texts(at, "markdown")) and len(at.metric) == 6
    assert per_tab == {"Spectrum & effective rank": ["Singular spectrum at the document end",
                                                     "Effective rank along the document"],
                       "Energy kept": ["Energy kept by rank-r truncation at the document end"],
                       "Decay α & key cone": ["Per-token decay α of this head", "Key cone of this head"],
                       "Over the documents": ["Per-document spread of this head"]}
    assert n_downloads >= 3 * 6  # PNG, SVG, CSV under every figure
    metrics = {m.label: m.value for m in at.metric}
    assert {"Effective rank", "Numerical rank", "Horizon", "Mean key norm", "Key-cov erank",
            "r for 99% energy"} <= set(metrics)
    # which numbers are medians and which plots show one document
    assert any("medians over the 2 documents" in c and "show one document, “alpha”" in c for c in texts(at, "caption"))
    for t in ("Singular spectrum at the document end", "Key cone of this head"):
        assert specs[t]["title"]["subtitle"][0] == "one document: “alpha”"
    spread = specs["Per-document spread of this head"]
    from gdnviz.figures import HEATMAP_METRICS

    nr = spread["vconcat"][list(HEATMAP_METRICS).index("numerical_rank")]
    x = nr["layer"][0]["encoding"]["x"]
    assert x["axis"]["format"] == "d" and x["scale"]["domain"][1] <= 1.01 * min(run["model"]["d_k"], run["model"]["d_v"])
    # the statistics table has median / min / max per statistic
    stats = [f for f in frames if "statistic" in f.columns][0]
    assert {"effective rank", "decay horizon (tokens)", "key-covariance erank"} <= set(stats["statistic"])
    # the open tab is kept when another head is opened from the heatmap's panel
    at.switch_page("pages/heatmap.py").run()
    at.session_state["heat"] = {"selection": {"cell": [{"layer": 1, "head": 2}]}}
    at.run()
    link = next(l.proto for l in at.get("page_link") if l.proto.label == "Open the full head page")
    at.switch_page("pages/head.py")  # the link's page and query
    at.query_params.update(dict(kv.split("=") for kv in link.query_string.split("&")))
    at.run()
    assert not at.exception and any("Layer 1 · head 2" in m for m in texts(at, "markdown"))
    assert chart_titles(at) == ["Per-document spread of this head"]
    # pick the head from the page
    at.button(key="head_pick").click().run()
    assert at.session_state["picked_heads"] == [[1, 2]]


@pytest.mark.parametrize("layer,head,message", [
    (2, 0, "Layer 2 is not a Gated DeltaNet layer"),
    (0, 9, "Head 9 is out of range"),
    ("x", 1, "both must be integers"),
])
def test_head_bad_deep_links(env, populated, layer, head, message):
    cache, run = populated
    env(cache)
    at = app("head", run=run, layer=layer, head=head)
    at.run()
    assert not at.exception
    assert any(message in e for e in texts(at, "error"))
    # falls back to the run's head with the largest effective rank, and says so
    from gdnviz.summary import document_set_table

    cache_, run = populated
    table = document_set_table(jobs.load_run_captures(Store(cache_), run))
    top = table.sort_values(["erank", "layer", "head"], ascending=[False, True, True]).iloc[0]
    assert (at.session_state["layer"], at.session_state["head"]) == (int(top["layer"]), int(top["head"]))
    assert any(f"Layer {int(top['layer'])} · head {int(top['head'])}" in m for m in texts(at, "markdown"))
    assert any("the head with the largest effective rank in this run" in c for c in texts(at, "caption"))


# =============================================================================================================
# Overview, budget
# =============================================================================================================
def test_overview_figures(env, populated):
    cache, run = populated
    env(cache)
    at = app("overview", run=run)
    at.run()
    assert not at.exception
    assert chart_titles(at) == ["Effective rank vs decay horizon", "Decay horizons of all GDN heads",
                                "Heads forgetting within a segment, per layer", "The key cone's ceiling"]
    labels = [m.label for m in at.metric]
    assert "Spearman ρ" in labels and "Forget within L" in labels
    from gdnviz.summary import document_set_table, overview

    table = document_set_table(jobs.load_run_captures(Store(cache), run))
    lo, hi = overview(table, int(run["segment_len"]))["spearman_ci95"]
    rho_metric = [m for m in at.metric if m.label == "Spearman ρ"][0]
    assert rho_metric.proto.delta == f"95% CI {lo:.2f} to {hi:.2f}"
    import json

    evh = json.loads(charts(at)[0].proto.spec)
    assert any(l.get("mark", {}).get("strokeDash") for l in evh["layer"])  # the y = x line
    assert evh["layer"][2]["encoding"]["x"]["scale"]["type"] == "log"
    assert any(l.get("mark", {}).get("type") == "rule" for l in evh["layer"])  # the min(d_k, d_v) ceiling


def test_overview_scatter_opens_or_picks_the_clicked_head_and_shows_its_spread(env, populated):
    import json

    cache, run = populated
    env(cache)
    at = app("overview", run=run)
    at.run()
    ch = charts(at)[0]
    assert ch.key == "ov_evh" and list(ch.proto.selection_mode) == ["head"]
    spec = json.loads(ch.proto.spec)
    bars = [l for l in spec["layer"] if l["encoding"].get("y2", {}).get("field") == "erank_max"]
    assert len(bars) == 1 and bars[0]["encoding"]["y"]["field"] == "erank_min"
    assert "min–max over documents" in " ".join(spec["title"]["subtitle"])
    at.radio(key="click_action").set_value("pick").run()
    at.session_state["ov_evh"] = {"selection": {"head": [{"layer": 3, "head": 2}]}}
    at.run()
    assert not at.exception and at.session_state["picked_heads"] == [[3, 2]]
    assert any("Truncation set (1 head): L3·H2" in c for c in texts(at, "caption"))
    assert not _panel_heading(at)  # a pick opens no panel
    at.radio(key="click_action").set_value("open").run()
    assert at.radio(key="click_action").options[0] == "shows it below these figures"
    at.session_state["ov_evh"] = {"selection": {"head": [{"layer": 1, "head": 0}]}}
    at.run()
    # the head shows in the panel under the scatter, on the Overview page, with the Head page's numbers
    assert not at.exception and [t.value for t in at.title] == ["Overview figures"]
    assert len(_panel_heading(at)) == 1 and _panel_heading(at)[0].startswith("### Layer 1 · head 0  \n")
    assert [m.label for m in at.metric][-6:] == ["Effective rank", "Numerical rank", "Horizon", "Mean key norm",
                                                 "Key-cov erank", "r for 99% energy"]
    assert "Singular spectrum at the document end" in chart_titles(at) and _url_head(at) == ("1", "0")
    links = {l.proto.label: l.proto for l in at.get("page_link")}
    assert links["Open the full head page"].query_string == "layer=1&head=0"
    assert at.session_state["picked_heads"] == [[3, 2]]  # the open-mode click picked nothing
    # the open head is ringed on the scatter (under its point), and the subtitle says so; Close removes the ring
    spec = json.loads(charts(at)[0].proto.spec)
    rings = [l for l in spec["layer"] if l.get("mark", {}).get("filled") is False]
    assert len(rings) == 1 and "ringed: layer 1 head 0, shown below" in spec["title"]["subtitle"]
    pts = [l for l in spec["layer"] if l.get("name") in spec["params"][0]["views"]][0]  # the clickable points
    assert spec["layer"].index(rings[0]) < spec["layer"].index(pts)
    data = {d.name: d.data.data for d in charts(at)[0].proto.datasets}  # Arrow IPC bytes, sent apart from the spec
    ring_rows = pa.ipc.open_stream(data[rings[0]["data"]["name"]]).read_all().to_pandas()
    assert list(zip(ring_rows["layer"], ring_rows["head"])) == [(1, 0)]
    # the min–max bars take the points' colours (one colour per layer)
    bars = [l for l in spec["layer"] if l["encoding"].get("y2", {}).get("field") == "erank_max"][0]
    assert bars["encoding"]["color"]["scale"] == pts["encoding"]["color"]["scale"]
    at.button(key="head_panel_close").click().run()
    spec = json.loads(charts(at)[0].proto.spec)
    assert not [l for l in spec["layer"] if l.get("mark", {}).get("filled") is False]


def test_cache_budget(env, populated):
    cache, run = populated
    env(cache)
    at = app("budget", run=run)
    at.run()
    assert not at.exception
    metrics = {m.label: m.value for m in at.metric}
    m = run["model"]
    rec = len(m["gdn_layers"]) * m["num_heads"] * m["d_k"] * m["d_v"] * 4
    assert metrics["Recurrent state"] == human_bytes(rec)
    kv_per_tok = len(m["attn_layers"]) * 2 * m["attn_kv_heads"] * m["attn_head_dim"] * 2
    assert metrics["KV per token"] == human_bytes(kv_per_tok)
    assert metrics["KV = recurrent at"] == f"T ≈ {rec / kv_per_tok:,.0f}"
    assert chart_titles(at) == ["Cache memory vs context length"]
    at.number_input(key="bud_batch").set_value(4)
    at.selectbox(key="bud_state_dtype").set_value("bfloat16").run()
    assert {m.label: m.value for m in at.metric}["Recurrent state"] == human_bytes(4 * rec / 2)
    table = [d.value for d in at.dataframe][0]
    assert all(str(v).endswith(("B", "KiB", "MiB", "GiB", "TiB")) for v in table.drop(columns="T (tokens)").values.ravel())
    assert not any("0.0000" in str(v) for v in table.values.ravel())


# =============================================================================================================
# Empty states, previous runs, corrupt results
# =============================================================================================================
@pytest.mark.parametrize("page", ["heatmap", "head", "overview", "budget", "loss"])
def test_empty_states_say_what_to_do(env, tmp_path, page):
    env(tmp_path / "empty")
    at = app(page)
    at.run()
    assert not at.exception
    infos = texts(at, "info")
    assert any(("No capture yet" in i) or ("No model yet" in i) for i in infos), infos
    assert "Go to Model & documents" in [l.proto.label for l in at.get("page_link")]
    assert not charts(at)


def test_previous_runs_reopen_and_corrupt_results_are_recomputed(env, tmp_path, tiny_checkpoint):
    cache = env(tmp_path / "c")
    r1 = capture(cache, tiny_checkpoint, (("first", short_text(150, 2)),))
    r2 = capture(cache, tiny_checkpoint, (("second", short_text(180, 5)),))
    at = app("heatmap", run=r2)
    at.run()
    assert any(r2["run_id"] in c for c in texts(at, "caption"))
    at.selectbox(key="sb_run").set_value(r1["run_id"]).run()
    assert at.session_state["run_id"] == r1["run_id"]
    assert any(r1["run_id"] in c for c in texts(at, "caption")) and charts(at)

    store = Store(cache)
    corrupt_memo_entry(store, r2["documents"][0]["key"])
    import streamlit as st

    st.cache_resource.clear()  # as after a server restart: the verified copy in memory is gone
    st.cache_data.clear()
    at2 = app("overview", run=r2)
    at2.run()
    assert not at2.exception
    warns = texts(at2, "warning")
    assert any("'second' is missing or corrupt" in w and "recomputed" in w for w in warns), warns
    assert not charts(at2)  # never shown
    assert store.queued_count() == 1
    work(cache)
    at2.run()
    assert not texts(at2, "warning") and len(charts(at2)) == 4  # the overview's four figures
    assert store.memo_has(r2["documents"][0]["key"])


def test_run_zip(env, populated):
    from gdnviz.ui.common import run_zip_bytes

    cache, run = populated
    env(cache)
    z = zipfile.ZipFile(io.BytesIO(run_zip_bytes(run, 1, 2)))
    names = set(z.namelist())
    assert {"settings.json", "tables/heads.csv", "figures/heatmap_erank.png", "figures/heatmap_erank.svg",
            "data/heatmap_erank.csv", "figures/erank_vs_horizon.png", "figures/L1H2_spectrum.svg",
            "figures/L1H2_keycone.png", "figures/keycone_ceiling.svg", "figures/L1H2_energy_kept.png",
            "figures/heatmap_energy_rank99.svg"} <= names
    assert "click a cell" not in z.read("figures/heatmap_erank.svg").decode()
    assert z.read("figures/heatmap_horizon.png")[:4] == b"\x89PNG"


# --- uipolish: the run zip holds the run's jobs, a README and redraw.py -----------------------------------------
def test_run_zip_holds_the_runs_truncations_sweeps_and_loss_with_a_readme_and_a_redraw_script(env, tmp_path):
    """A real run on the demo model with a truncation, a sweep and a loss run on it, and a sweep at another L
    (not this run's): the zip holds the three, as the job results say, redraw.py runs on the unzipped files and
    reload_with_gdnviz.py reopens the run with the library."""
    import json

    import pandas as pd

    from gdnviz.ui.common import run_zip_bytes

    cache = env(tmp_path / "c")
    L = 128
    run = capture(cache, "demo", (("alpha", short_text(300, 0)), ("beta", short_text(260, 3))), L=L)
    docs = tuple(tuple(d) for d in run["spec"]["documents"])
    gl = run["model"]["gdn_layers"]
    store = Store(cache)
    kw = dict(model="demo", segment_len=L)
    ids = {k: store.submit(k, jobs.spec_to_dict(j)) for k, j in (
        ("truncate", jobs.TruncateCompareJob(ranks=((gl[0], 0, 2), (gl[0], 1, 2)), task="niah_single_1",
                                             target_len=512, max_new_tokens=6, loss_documents=docs, **kw)),
        ("sweep", jobs.SweepJob(tasks=("niah_single_1",), lengths=(512,), ranks=(2,), n=2, heads=f"layers:{gl[0]}",
                                batch_size=2, max_new_tokens=6, **kw)),
        ("loss", jobs.LossJob(documents=docs, ranks=(2,), heads=f"layers:{gl[0]}", min_distance=64, **kw)))}
    other = store.submit("sweep", jobs.spec_to_dict(jobs.SweepJob(
        tasks=("niah_single_1",), lengths=(512,), ranks=(2,), n=1, heads=f"layers:{gl[0]}", batch_size=2,
        max_new_tokens=6, model="demo", segment_len=256)))
    assert work(cache) == 4
    res = {k: store.job(j)["result"] for k, j in ids.items()}
    assert store.job(other)["status"] == "done"
    z = zipfile.ZipFile(io.BytesIO(run_zip_bytes(run)))
    out = tmp_path / "unzipped"
    z.extractall(out)
    listed = pd.read_csv(out / "jobs.csv")
    assert sorted(listed["job"]) == sorted(ids.values()) and other not in set(listed["job"])
    assert dict(zip(listed["job"], listed["kind"])) == {j: k for k, j in ids.items()}
    # the sweep's table and rows as the job stored them
    sw = pd.read_csv(out / "sweeps" / ids["sweep"] / "table.csv")
    assert list(sw.columns) == ["task", "length", "setting", "r", "score", "n", "untouched", "delta", "se"]
    want = {int(t["r"]): t["score"] for t in res["sweep"]["table"]}
    assert dict(zip(sw["r"].astype(int), sw["score"])) == pytest.approx(want)
    rows = pd.read_csv(out / "sweeps" / ids["sweep"] / "rows.csv")
    assert len(rows) == res["sweep"]["n_results"] == 4
    assert json.loads((out / "sweeps" / ids["sweep"] / "settings.json").read_text())["spec"]["segment_len"] == L
    # the truncation: one summary row and the whole result
    tr = pd.read_csv(out / "truncations.csv")
    t = res["truncate"]
    assert tr["job"].tolist() == [ids["truncate"]] and tr["ranks"][0] == f"{gl[0]}:0:2 {gl[0]}:1:2"
    assert (tr["score_untouched"][0], tr["score_truncated"][0]) == (t["scores"]["untouched"], t["scores"]["truncated"])
    assert tr["loss_delta"][0] == pytest.approx(t["loss"]["delta"]) and tr["n_documents"][0] == 2
    assert json.loads((out / "truncations" / f"{ids['truncate']}.json").read_text())["result"]["prompt"] == t["prompt"]
    # the loss run
    lt = pd.read_csv(out / "loss" / ids["loss"] / "table.csv")
    assert len(lt) == len(res["loss"]["table"]) and set(lt["r"].dropna().astype(int)) <= {2, int(res["loss"]["rmax"])}
    assert lt["loss"].tolist() == pytest.approx([x["loss"] for x in res["loss"]["table"]], nan_ok=True)
    # the README names every kind of file present, with units
    readme = (out / "README.txt").read_text()
    for s in ("truncations.csv", "sweeps/<id>/table.csv", "loss/<id>/table.csv", "tables/heads.csv", "redraw.py",
              "nats per token", "percentage points", f"L = {L}"):
        assert s in readme, s
    assert "scans/<id>" not in readme and "budgets/<id>" not in readme  # none of those in this cache
    # redraw.py reloads the files with pandas and redraws the main figure and the sweep
    done = subprocess.run([sys.executable, "redraw.py"], cwd=out, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"{len(pd.read_csv(out / 'tables' / 'heads.csv'))} heads, 3 job(s)" in done.stdout
    html = (out / "redrawn_erank_vs_horizon.html").read_text()
    assert "effective rank vs decay horizon" in html and "erank_min" in html
    assert (out / f"redrawn_sweep_{ids['sweep']}.html").exists()
    # reload_with_gdnviz.py reopens the run itself with the library, from the cache it was made in
    from gdnviz.summary import document_set_table, overview

    assert "reload_with_gdnviz.py" in readme
    done = subprocess.run([sys.executable, "reload_with_gdnviz.py"], cwd=out, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr
    table = document_set_table(jobs.load_run_captures(store, run))
    rho = overview(table, L)["spearman_erank_horizon"]
    assert f"run {run['run_id']}: 2 document(s), {len(table)} heads, Spearman rho(erank, horizon) = {rho:.4f}" \
        in done.stdout, done.stdout
# --- end uipolish ---------------------------------------------------------------------------------------------


# =============================================================================================================
# Truncate & compare
# =============================================================================================================
def test_truncate_rank_out_of_range(env, populated):
    cache, run = populated
    env(cache)
    at = app("truncate", run=run)
    at.run()
    assert not at.exception
    assert at.selectbox(key="tr_g0_mode").value == "all"
    for r in (0, 17, -3):
        at.number_input(key="tr_g0_r").set_value(r).run()
        errs = texts(at, "error")
        assert any(f"rank {r} for layer 0 head 0 is outside 1..16" in e for e in errs), errs
        assert at.button(key="tr_run").proto.disabled
    at.number_input(key="tr_g0_r").set_value(4).run()
    assert not texts(at, "error") and not at.button(key="tr_run").proto.disabled
    # a horizon filter and whole layers resolve against the run
    at.button(key="tr_add_group").click().run()
    at.selectbox(key="tr_g1_mode").set_value("layers").run()
    at.multiselect(key="tr_g1_layers").select(3).run()
    at.number_input(key="tr_g1_r").set_value(1).run()
    assert any("12 of 12 heads" in c and "8 at r = 4" in c and "4 at r = 1" in c for c in texts(at, "caption"))


def test_truncate_and_compare_runs(env, populated):
    pytest.importorskip("gdnviz.truncation", reason="gdnviz/truncation (the top-r projection) is not in the tree yet")
    cache, run = populated
    env(cache)
    at = app("truncate", run=run)
    at.run()
    at.number_input(key="tr_g0_r").set_value(1)
    at.number_input(key="tr_target_len").set_value(400)
    at.number_input(key="tr_max_new").set_value(6).run()
    at.button(key="tr_run").click().run()
    work(cache)
    at.run()
    assert not at.exception
    md = " ".join(texts(at, "markdown"))
    assert "Untouched model" in md and "Truncated model" in md and "12 heads truncated" in md
    assert "truncated run: segment loop" in md  # CPU: the plain loop (CUDA: CUDA-graph windows)
    assert len(at.code) >= 2
    labels = [m.label for m in at.metric]
    assert labels.count("RULER score (string match, %)") == 2 and "Truncated (nats / token)" in labels
    assert chart_titles(at) == ["Loss change along the document"]


def test_truncate_settings_survive_leaving_the_page_and_a_changed_form_says_the_result_is_older(env, populated):
    cache, run = populated
    env(cache)
    at = app("truncate", run=run)
    at.run()
    at.selectbox(key="tr_g0_mode").set_value("layers").run()
    at.multiselect(key="tr_g0_layers").set_value([1])
    at.number_input(key="tr_g0_r").set_value(2).run()
    at.button(key="tr_add_group").click().run()
    at.number_input(key="tr_g1_r").set_value(3)
    at.number_input(key="tr_target_len").set_value(400)
    at.number_input(key="tr_max_new").set_value(4).run()
    # the target length is called a target, with the prompt's bound under it
    assert any("The length is a target" in c and "at most 272 tokens" in c for c in texts(at, "caption"))
    at.switch_page("pages/heatmap.py").run()
    at.switch_page("pages/truncate.py").run()
    assert not at.exception
    assert at.session_state["tr_groups"] == [0, 1]
    assert at.selectbox(key="tr_g0_mode").value == "layers" and at.multiselect(key="tr_g0_layers").value == [1]
    assert at.number_input(key="tr_g0_r").value == 2 and at.number_input(key="tr_g1_r").value == 3
    at.button(key="tr_run").click().run()
    work(cache)
    at.run()
    md = " ".join(texts(at, "markdown"))
    assert "prompt tokens (target length 400)" in md
    assert not [w for w in texts(at, "warning") if "other settings than the form" in w]
    at.number_input(key="tr_g1_r").set_value(5).run()
    assert [w for w in texts(at, "warning") if "other settings than the form" in w and "heads or ranks" in w]


def _upload_map(at, name: str, text: str) -> None:
    at.file_uploader(key="tr_map_file").set_value([(name, text.encode(), "application/json")]).run()


def _submitted_ranks(cache, at) -> list:
    return [list(x) for x in Store(cache).job(at.session_state["truncate_job"])["spec"]["ranks"]]


def test_truncate_groups_at_different_ranks_submit_one_per_head_rank_map(env, populated):
    """Whole layers, two head lists and a later group overriding one head: the job gets each head's own r."""
    cache, run = populated
    env(cache)
    at = app("truncate", run=run)
    at.run()
    at.selectbox(key="tr_g0_mode").set_value("layers").run()
    at.multiselect(key="tr_g0_layers").set_value([0])
    at.number_input(key="tr_g0_r").set_value(2).run()
    at.button(key="tr_add_group").click().run()
    at.selectbox(key="tr_g1_mode").set_value("heads").run()
    at.multiselect(key="tr_g1_list").set_value(["L1·H2", "L3·H0"])
    at.number_input(key="tr_g1_r").set_value(5).run()
    at.button(key="tr_add_group").click().run()
    at.selectbox(key="tr_g2_mode").set_value("heads").run()
    at.multiselect(key="tr_g2_list").set_value(["L0·H1"])
    at.number_input(key="tr_g2_r").set_value(7)
    at.number_input(key="tr_target_len").set_value(400).run()
    assert not at.exception and not texts(at, "error")
    assert any("6 of 12 heads" in c and "3 at r = 2, 2 at r = 5, 1 at r = 7" in c for c in texts(at, "caption"))
    at.button(key="tr_run").click().run()
    want = [[0, 0, 2], [0, 1, 7], [0, 2, 2], [0, 3, 2], [1, 2, 5], [3, 0, 5]]
    assert _submitted_ranks(cache, at) == want
    assert at.session_state["tr_rank_map"] == {f"{l}:{h}": r for l, h, r in want}


def test_truncate_opens_a_rank_map_json_and_keeps_it_across_pages(env, populated):
    """An uploaded rank_map.json becomes one head list per rank; the groups survive another page; Run submits the
    map's per-head ranks."""
    import json

    cache, run = populated
    env(cache)
    at = app("truncate", run=run)
    at.run()
    ranks = [[0, 0, 1], [1, 2, 4], [3, 3, 4]]
    _upload_map(at, "budget.json", json.dumps(dict(format="gdnviz-rank-map-v1", ranks=ranks)))
    assert not at.exception and not texts(at, "error")
    assert at.session_state["tr_groups"] == [0, 1]
    assert [at.selectbox(key=f"tr_g{g}_mode").value for g in (0, 1)] == ["heads", "heads"]
    assert at.multiselect(key="tr_g1_list").value == ["L1·H2", "L3·H3"] and at.number_input(key="tr_g1_r").value == 4
    assert any(c.startswith("budget.json: 3 heads at r = 1, 4, now the groups below") for c in texts(at, "caption"))
    # an edit after the upload is not undone by the file still in the uploader
    at.number_input(key="tr_g0_r").set_value(2).run()
    assert at.number_input(key="tr_g0_r").value == 2
    at.switch_page("pages/heatmap.py").run()
    at.switch_page("pages/truncate.py").run()
    assert not at.exception
    assert at.session_state["tr_groups"] == [0, 1]
    assert at.multiselect(key="tr_g0_list").value == ["L0·H0"] and at.number_input(key="tr_g0_r").value == 2
    assert at.multiselect(key="tr_g1_list").value == ["L1·H2", "L3·H3"] and at.number_input(key="tr_g1_r").value == 4
    at.number_input(key="tr_target_len").set_value(400).run()
    at.button(key="tr_run").click().run()
    assert _submitted_ranks(cache, at) == [[0, 0, 2], [1, 2, 4], [3, 3, 4]]


def test_truncate_refuses_a_bad_rank_map_and_submits_nothing(env, populated):
    cache, run = populated
    env(cache)
    store = Store(cache)
    at = app("truncate", run=run)
    at.run()
    queued = store.queued_count()
    for text, message in (("{not json", "the rank map is not JSON"),
                          ("[[0, 0, 40]]", "rank 40 for layer 0 head 0 is outside 1..16"),
                          ("[[2, 0, 4]]", "layer 2 is not a Gated DeltaNet layer"),
                          ("[[0, 7, 4]]", "head 7 out of range"),
                          ('{"ranks": []}', "the rank map lists no heads")):
        _upload_map(at, "bad.json", text)
        assert not at.exception
        errs = texts(at, "error")
        assert any(e.startswith(f"Cannot open bad.json: {message}") and "groups below are unchanged" in e
                   for e in errs), (text, errs)
        assert at.session_state["tr_groups"] == [0] and at.selectbox(key="tr_g0_mode").value == "all"
        assert at.button(key="tr_run").proto.disabled  # AppTest, like a browser, cannot click it
    assert store.queued_count() == queued and "truncate_job" not in at.session_state
    # the file removed: the groups as they were run again
    at.file_uploader(key="tr_map_file").set_value([]).run()
    assert not texts(at, "error") and not at.button(key="tr_run").proto.disabled


def test_truncate_a_one_group_rank_map_is_the_single_group_run(env, populated):
    """All heads at r = 2 as the old single group and as an opened rank map: the same job ranks, so the same memo
    key: the second run is the first one's result."""
    cache, run = populated
    env(cache)
    at = app("truncate", run=run)
    at.run()
    at.number_input(key="tr_g0_r").set_value(2)
    at.number_input(key="tr_target_len").set_value(400)
    at.number_input(key="tr_max_new").set_value(6)
    at.checkbox(key="tr_loss_docs").uncheck().run()
    at.button(key="tr_run").click().run()
    first = at.session_state["truncate_job"]
    work(cache)
    gl = [0, 1, 3]
    _upload_map(at, "all2.json", "[" + ", ".join(f"[{l}, {h}, 2]" for l in gl for h in range(4)) + "]")
    assert at.session_state["tr_groups"] == [0] and at.selectbox(key="tr_g0_mode").value == "heads"
    at.button(key="tr_run").click().run()
    second = at.session_state["truncate_job"]
    assert second != first and _submitted_ranks(cache, at) == [[l, h, 2] for l in gl for h in range(4)]
    work(cache)
    at.run()
    a, b = Store(cache).job(first)["result"], Store(cache).job(second)["result"]
    assert not a["memo_hit"] and b["memo_hit"] and b["memo_key"] == a["memo_key"]
    assert (b["untouched"], b["truncated"], b["scores"]) == (a["untouched"], a["truncated"], a["scores"])
    assert "12 heads truncated" in " ".join(texts(at, "markdown"))


def test_truncate_loss_box_unticked_computes_no_loss(env, populated):
    """Unticked, the job gets no loss documents, computes no loss (not even on the prompt) and the page shows none."""
    cache, run = populated
    env(cache)
    at = app("truncate", run=run)
    at.run()
    assert at.checkbox(key="tr_loss_docs").value  # ticked by default when there is a run
    at.number_input(key="tr_g0_r").set_value(1)
    at.number_input(key="tr_target_len").set_value(400)
    at.number_input(key="tr_max_new").set_value(6)
    at.checkbox(key="tr_loss_docs").uncheck().run()
    at.button(key="tr_run").click().run()
    jid = at.session_state["truncate_job"]
    assert list(Store(cache).job(jid)["spec"]["loss_documents"]) == []
    work(cache)
    at.run()
    assert not at.exception
    res = Store(cache).job(jid)["result"]
    assert res["loss"] is None and res["losses"] == [] and res["scores"]
    labels = [m.label for m in at.metric]
    assert "RULER score (string match, %)" in labels and not any("nats" in l or "Relative" in l for l in labels)
    assert chart_titles(at) == [] and not at.dataframe
    assert any(c.startswith("Next-token loss: not measured (tick") for c in texts(at, "caption"))
    # ticked: the loss on the run's documents, the mean of the per-document means
    at.checkbox(key="tr_loss_docs").check().run()
    at.button(key="tr_run").click().run()
    work(cache)
    at.run()
    res = Store(cache).job(at.session_state["truncate_job"])["result"]
    assert [l["document"] for l in res["losses"]] == ["alpha", "beta"] and res["loss"]["n_documents"] == 2
    assert res["loss"]["untouched"] == pytest.approx(sum(l["loss_untouched"] for l in res["losses"]) / 2)
    assert "Truncated (nats / token)" in [m.label for m in at.metric]
    assert any("on the run's 2 document(s) (mean of the per-document means)" in m for m in texts(at, "markdown"))


# =============================================================================================================
# Loss vs rank
# =============================================================================================================
def test_loss_page_bad_input_is_refused_with_specific_messages(env, populated, tmp_path, tiny_checkpoint):
    cache, run = populated
    env(cache)
    store = Store(cache)
    queued = store.queued_count()
    at = app("loss", run=run)
    at.run()
    assert not at.exception
    assert at.text_input(key="ls_ranks").value == "1, 4, 12" and at.number_input(key="ls_dist").value == 512
    assert not texts(at, "error") and not at.button(key="ls_run").proto.disabled
    assert any("2 document(s) × (4 ranks (1, 4, 12, 16 = untouched)) = **8 forward passes**" in c
               for c in texts(at, "caption")), texts(at, "caption")
    # a distance longer than every document: the page says the copy subsets will be empty
    longest = max(d["n_tokens"] for d in run["documents"])
    at.number_input(key="ls_dist").set_value(longest).run()
    assert any(f"Every document has at most {longest + 2:,} tokens" in w and "both copy subsets are empty" in w
               for w in texts(at, "warning")), texts(at, "warning")
    at.number_input(key="ls_dist").set_value(16).run()
    assert not any("copy subsets are empty" in w for w in texts(at, "warning"))
    for ranks, message in (("0, 4", "rank 0 is outside 1..16"), ("4, 17", "rank 17 is outside 1..16"),
                           ("4, x", "'x' is not one"), ("", "No ranks given")):
        at.text_input(key="ls_ranks").input(ranks).run()
        assert any(message in e for e in texts(at, "error")), (ranks, texts(at, "error"))
        assert at.button(key="ls_run").proto.disabled
    at.text_input(key="ls_ranks").input("4").run()
    at.selectbox(key="ls_heads").set_value("picked").run()
    assert any("No heads in this set" in e for e in texts(at, "error")) and at.button(key="ls_run").proto.disabled
    at.selectbox(key="ls_heads").set_value("layers").run()
    at.multiselect(key="ls_layers").select(3).run()
    assert not texts(at, "error") and any("**4 of 12 heads** cut to each r" in c for c in texts(at, "caption"))
    at.text_area(key="ls_rank_maps").input("early: 3:0:99").run()
    assert any("rank 99 for layer 3 head 0 (rank maps, line 1, early) is outside 1..16" in e for e in texts(at, "error"))
    at.text_area(key="ls_rank_maps").input("early: 3:0:1").run()
    assert any("+ 1 rank map(s)) = **6 forward passes**" in c for c in texts(at, "caption"))
    assert store.queued_count() == queued and "loss_job" not in at.session_state
    # a run holding a document too short for one prediction after the first boundary (L + 2 = 66 tokens)
    short = env(tmp_path / "short")
    short_run = capture(short, tiny_checkpoint, (("long", short_text(300, 0)), ("brief", "Just a few words here.")))
    at = app("loss", run=short_run)
    at.run()
    errs = texts(at, "error")
    assert any("Document 'brief' has" in e and "needs at least 66 (segment length L = 64 + 2)" in e for e in errs)
    assert not any("'long'" in e for e in errs) and at.button(key="ls_run").proto.disabled


def test_loss_page_runs_through_the_worker_shows_the_table_and_figure(env, populated):
    cache, run = populated
    env(cache)
    at = app("loss", run=run)
    at.run()
    at.text_input(key="ls_ranks").input("2")
    at.number_input(key="ls_dist").set_value(16).run()
    at.button(key="ls_run").click().run()
    jid = at.session_state["loss_job"]
    rec = Store(cache).job(jid)
    assert rec["kind"] == "loss" and rec["status"] == "queued" and at.button(key="ls_run").proto.disabled
    assert [d[0] for d in rec["spec"]["documents"]] == ["alpha", "beta"] and rec["spec"]["min_distance"] == 16
    assert any("Loss vs rank: queued" in t for t in progress(at))
    assert work(cache) == 1
    at.run()
    assert not at.exception
    res = Store(cache).job(jid)["result"]
    assert (res["computed"], res["reused"], res["n_results"]) == (4, 0, 4)  # 2 documents x (r = 2, untouched)
    table = at.dataframe[0].value
    assert list(table.columns) == ["r"] + [f"{s}: {q}" for s in ("all", "copy (any)", "copy (recent)")
                                           for q in ("loss", "Δ ± SE (Δ %)")]
    assert table["r"].tolist() == ["2", "16 (untouched)"]
    t = {(r["r"], r["subset"]): r for r in res["table"]}
    x = t[(2, "all")]
    assert table["all: Δ ± SE (Δ %)"][0] == f"{x['delta']:+.4f} ± {x['se']:.4f} ({x['delta_pct']:+.2f}%)".replace(
        "-", "−")
    assert table["all: loss"][1] == f"{t[(16, 'all')]['loss']:.4f}"
    assert chart_titles(at) == [f"{Path(str(res['model_name'])).name}: next-token loss vs rank"]
    assert {b.proto.label for b in at.get("download_button")} >= {"PNG", "SVG", "CSV", "Per-document losses (CSV)"}
    assert any("copy subsets, d = 16 tokens" in c and "all: " in c and "predictions in 2 document(s)" in c
               for c in texts(at, "caption"))

    # a new session, another head set: the untouched losses come from the store, only r = 2 on layer 3 runs
    at2 = app("loss", run=run)
    at2.run()
    at2.text_input(key="ls_ranks").input("2")
    at2.number_input(key="ls_dist").set_value(16)
    at2.selectbox(key="ls_heads").set_value("layers").run()
    at2.multiselect(key="ls_layers").select(3).run()
    at2.button(key="ls_run").click().run()
    work(cache)
    at2.run()
    res2 = Store(cache).job(at2.session_state["loss_job"])["result"]
    assert (res2["computed"], res2["reused"]) == (2, 2) and res2["n_heads"] == 4
    assert [r for r in res2["table"] if r["r"] == 16] == [r for r in res["table"] if r["r"] == 16]
    assert any("2 computed now, 2 read from the store" in m for m in texts(at2, "markdown"))

    # a third session reopens the first result from the list, without running anything
    at3 = app("loss", run=run)
    at3.run()
    sb = at3.selectbox(key="ls_prev")
    assert len(sb.options) == 2 and sb.value is None
    sb.set_value(jid).run()
    assert at3.session_state["loss_job"] == jid and not at3.exception
    assert at3.dataframe[0].value["r"].tolist() == ["2", "16 (untouched)"]


# =============================================================================================================
# Retrieval sweeps
# =============================================================================================================
def test_sweeps_without_a_model_and_from_a_deep_link(env, tmp_path, monkeypatch, tiny_checkpoint):
    """No model chosen (the demo default, not installed): the empty state. A default model and no capture: a new
    session opened on the page inspects it, then shows the form."""
    from gdnviz.ui.common import demo_installed

    cache = env(tmp_path / "c")
    if not demo_installed():
        monkeypatch.delenv("GDNVIZ_DEFAULT_MODEL")
        at = app("sweeps")
        at.run()
        assert not at.exception
        assert any("No model yet" in i for i in texts(at, "info"))
        assert "Go to Model & documents" in [l.proto.label for l in at.get("page_link")]
        assert not charts(at) and not at.get("progress") and Store(cache).queued_count() == 0
        monkeypatch.setenv("GDNVIZ_DEFAULT_MODEL", str(tiny_checkpoint))
    inspects_then_shows_the_form(cache, "sweeps", "sw_run")


def inspects_then_shows_the_form(cache, page: str, run_key: str) -> None:
    """A new session opened on ``page`` with a default model and no capture: it asks for the model's inspection,
    and once the worker has done it shows the form (``run_key``, no error) on the inspected model."""
    at = app(page)
    at.run()
    assert not at.exception
    assert any(t.startswith("Inspecting tiny-qwen3_5: queued") for t in progress(at)), progress(at)
    assert work(cache) == 1
    at.run()
    assert not at.exception and not at.get("progress")
    assert at.button(key=run_key) is not None and not texts(at, "error")
    assert any("the inspected model (tiny-qwen3_5)" in m for m in texts(at, "markdown"))


# --- uipolish: the job pages' one header (gdnviz.ui.common.page_model) -----------------------------------------
@pytest.mark.parametrize("page, run_key", [("truncate", "tr_run"), ("patching", "pt_run"), ("scans", "sc_run")])
def test_job_pages_without_a_run_inspect_the_default_model_then_show_the_form(env, tmp_path, page, run_key):
    """No capture, a default model: a new session opened on the page asks for its inspection (the empty state
    only when no model can be chosen, tested for sweeps above), then shows the form on the inspected model."""
    inspects_then_shows_the_form(env(tmp_path / "c"), page, run_key)


def test_sweep_preview_counts_the_memo_and_estimates_from_the_last_sweeps_throughput(env, tmp_path):
    """Before Run: the answers the job's own spec needs, how many the memo holds, and the time at the throughput
    the worker measured on this model and device (none before the first sweep)."""
    from types import SimpleNamespace

    from gdnviz.jobs import MemoMapping
    from gdnviz.probes import rates

    cache = env(tmp_path / "c")
    at = app("sweeps")
    at.run()
    work(cache)
    at.run()
    at.multiselect(key="sw_tasks").set_value(["niah_single_1"])
    at.text_input(key="sw_lengths").input("400")
    at.text_input(key="sw_ranks").input("2")
    at.number_input(key="sw_batch").set_value(2)
    at.number_input(key="sw_max_new").set_value(6)
    at.number_input(key="sw_n").set_value(2).run()
    assert not texts(at, "error")
    preview = [c for c in texts(at, "caption") if "answers**" in c]
    assert preview and ("1 task(s) × 1 length(s) × (2 ranks (2, 16 = untouched)) × 2 samples = **4 answers**: none "
                        "in the memo yet, **4 to run**, no estimate yet (no earlier run of niah_single_1 at 400 tokens"
                        in preview[0]), preview
    at.button(key="sw_run").click().run()
    assert work(cache) == 1
    at.number_input(key="sw_n").set_value(3).run()
    assert not at.exception and not texts(at, "error")
    preview = [c for c in texts(at, "caption") if "answers**" in c][0]
    assert "× 3 samples = **6 answers**: 4 of 6 already done (in the memo), **2 to run**, about " in preview, preview
    store = Store(cache)
    rec = store.job(at.session_state["sweep_job"])
    worker_info = SimpleNamespace(**rec["result"]["model"])  # the rate is the worker's measurement of its model
    got = rates.read(MemoMapping(store), worker_info, "niah_single_1", 400, rec["spec"]["segment_len"],
                     rec["spec"]["batch_size"])
    assert got["answers"] == 4 and f"{got['answers_per_second']:.2f} answers/s" in preview
# --- end uipolish ---------------------------------------------------------------------------------------------


def test_sweeps_bad_input_is_refused_with_specific_messages(env, populated):
    cache, run = populated
    env(cache)
    store = Store(cache)
    queued = store.queued_count()
    at = app("sweeps", run=run)
    at.run()
    assert not at.exception
    # defaults on the tiny model (d_k = d_v = 16): seed 000's ranks up to 16, two tasks, lengths 4L and 16L
    assert at.text_input(key="sw_ranks").value == "1, 4, 12"
    assert at.multiselect(key="sw_tasks").value == ["niah_single_1", "vt"]
    at.text_input(key="sw_lengths").input("1024").run()
    assert not texts(at, "error") and not at.button(key="sw_run").proto.disabled
    assert any("2 task(s) × 1 length(s) × (4 ranks (1, 4, 12, 16 = untouched)) × 20 samples = **160 answers**" in c
               for c in texts(at, "caption"))

    for ranks, message in (("0, 4", "rank 0 is outside 1..16"), ("4, 17", "rank 17 is outside 1..16"),
                           ("4, x", "'x' is not one"), ("", "No ranks given")):
        at.text_input(key="sw_ranks").input(ranks).run()
        errs = texts(at, "error")
        assert any(message in e for e in errs), (ranks, errs)
        assert at.button(key="sw_run").proto.disabled
    at.text_input(key="sw_ranks").input("4").run()
    at.text_input(key="sw_lengths").input("300, 1024").run()  # vt needs more than 300 tokens
    errs = texts(at, "error")
    assert any("Length 300 is too short for vt: it needs at least" in e for e in errs), errs
    assert not any("too short for niah_single_1" in e for e in errs), errs  # 300 tokens hold a needle
    at.text_input(key="sw_lengths").input("1024").run()
    at.multiselect(key="sw_tasks").set_value([]).run()
    assert any("No tasks chosen" in e for e in texts(at, "error"))
    assert at.button(key="sw_run").proto.disabled  # AppTest, like a browser, cannot click it
    assert store.queued_count() == queued and "sweep_job" not in at.session_state
    at.multiselect(key="sw_tasks").set_value(["niah_single_1"])
    at.selectbox(key="sw_heads").set_value("picked").run()
    assert any("No heads in this set" in e for e in texts(at, "error"))
    at.selectbox(key="sw_heads").set_value("layers").run()
    at.multiselect(key="sw_layers").select(3).run()
    assert not texts(at, "error")
    assert any("**4 of 12 heads** cut to each r" in c for c in texts(at, "caption"))
    # per-head rank maps: each bad line named, a good one adds a setting to the count
    for text, message in (("early heads", "line 1: expected NAME"), ("early: 2:0:1", "layer 2 is not a GDN layer"),
                          ("early: 3:0:99", "rank 99 for layer 3 head 0 (rank maps, line 1, early) is outside 1..16")):
        at.text_area(key="sw_rank_maps").input(text).run()
        assert any(message in e for e in texts(at, "error")), (text, texts(at, "error"))
        assert at.button(key="sw_run").proto.disabled
    at.text_area(key="sw_rank_maps").input("early: 3:0:1, 3:1:2").run()
    assert not texts(at, "error")
    assert any("1 rank map(s): **early** (2 heads)" in c for c in texts(at, "caption"))
    assert any("× (2 ranks (4, 16 = untouched) + 1 rank map(s)) × 20 samples = **60 answers**" in c
               for c in texts(at, "caption")), texts(at, "caption")
    at.text_area(key="sw_rank_maps").input("").run()
    # heads forgetting within a segment: the horizons come from the run's capture
    from gdnviz.summary import document_set_table

    hz = document_set_table(jobs.load_run_captures(store, run))["horizon"]
    within = int((hz < run["segment_len"]).sum())
    at.selectbox(key="sw_heads").set_value("within").run()
    if within:
        assert any(f"**{within} of 12 heads** cut to each r" in c for c in texts(at, "caption"))
    else:
        assert any("No heads in this set" in e for e in texts(at, "error"))


def test_sweeps_run_through_the_worker_shows_the_table_and_figure(env, populated):
    cache, run = populated
    env(cache)
    at = app("sweeps", run=run)
    at.run()
    at.multiselect(key="sw_tasks").set_value(["niah_single_1"])
    at.text_input(key="sw_lengths").input("400")
    at.text_input(key="sw_ranks").input("2")
    at.number_input(key="sw_n").set_value(2).run()
    assert at.number_input(key="sw_batch").value is None  # empty: chosen from free memory
    assert any("batch size chosen from free memory" in c for c in texts(at, "caption"))
    at.number_input(key="sw_batch").set_value(2)
    at.number_input(key="sw_max_new").set_value(6).run()
    assert not texts(at, "error")
    assert any("2 per forward pass" in c for c in texts(at, "caption"))
    at.button(key="sw_run").click().run()
    jid = at.session_state["sweep_job"]
    assert at.button(key="sw_run").proto.disabled  # one sweep at a time
    rec = Store(cache).job(jid)
    assert rec["kind"] == "sweep" and rec["status"] == "queued"
    assert rec["spec"]["tasks"] == ["niah_single_1"] or rec["spec"]["tasks"] == ("niah_single_1",)
    assert any("Sweep: queued" in t for t in progress(at))
    assert work(cache) == 1
    at.run()
    assert not at.exception
    res = Store(cache).job(jid)["result"]
    assert res["computed"] == 4 and res["reused"] == 0  # 2 samples x (r = 2, untouched r = 16)
    table = at.dataframe[0].value
    assert list(table.columns) == ["task", "length (tokens)", "r = 2", "r = 16 (untouched)", "n"]
    assert table["task"].tolist() == ["niah_single_1"] and table["n"].tolist() == [2]
    # the cell reads "score (Δ ± paired SE)" from the worker's table
    t = {r["r"]: r for r in res["table"]}
    assert table["r = 2"][0] == f"{t[2]['score']:.1f} ({t[2]['delta']:+.1f} ± {t[2]['se']:.1f})".replace("-", "−")
    floor = t[16]["untouched"] == 0  # a random tiny model: usually no retrieval to lose, and the page says so
    assert any("The untouched model scores 0 on niah_single_1 at 400 tokens" in w
               for w in texts(at, "warning")) == floor
    assert chart_titles(at) == [f"{Path(str(res['model_name'])).name}: RULER score vs rank"]
    sizes = sorted({r["n_tokens"] for r in res["rows"]})  # the target is 400: the page says what the prompts are
    span = f"{sizes[0]:,}" if len(sizes) == 1 else f"{sizes[0]:,}–{sizes[-1]:,}"
    assert any(c.startswith("Lengths are targets") and f"at length 400 the prompts have {span} tokens (2 prompts)" in c
               for c in texts(at, "caption")), texts(at, "caption")
    import json

    spec = json.loads(charts(at)[0].proto.spec)
    assert spec["facet"]["column"]["title"] == "target length (tokens)"
    assert {b.proto.label for b in at.get("download_button")} >= {"PNG", "SVG", "CSV", "Per-sample answers (CSV)"}

    # the same sweep from a new session, plus a per-head rank map: the 4 answers are read back from the store,
    # only the map's 2 are generated, and its own table pairs them with the untouched answers
    at2 = app("sweeps", run=run)
    at2.run()
    for k, v in (("sw_tasks", ["niah_single_1"]),):
        at2.multiselect(key=k).set_value(v)
    at2.text_input(key="sw_lengths").input("400")
    at2.text_input(key="sw_ranks").input("2")
    at2.number_input(key="sw_n").set_value(2)
    at2.text_area(key="sw_rank_maps").input("one_head: 3:1:1")
    at2.number_input(key="sw_max_new").set_value(6).run()
    at2.button(key="sw_run").click().run()
    work(cache)
    at2.run()
    jid2 = at2.session_state["sweep_job"]
    res2 = Store(cache).job(jid2)["result"]
    assert res2["computed"] == 2 and res2["reused"] == 4
    assert [r for r in res2["table"] if r["setting"] == "uniform"] == res["table"]
    assert any("2 generated now, 4 read from the store" in m for m in texts(at2, "markdown"))
    # the form (rank maps included) is kept when the session leaves the page and comes back
    at2.switch_page("pages/heatmap.py").run()
    at2.switch_page("pages/sweeps.py").run()
    assert at2.text_area(key="sw_rank_maps").value == "one_head: 3:1:1" and at2.text_input(key="sw_ranks").value == "2"
    assert not [w for w in texts(at2, "warning") if "other settings than the form" in w]
    # a sweep reopened from the store in another session does not claim its answers were generated now, and a
    # form that differs from it says so
    at3 = app("sweeps", run=run)
    at3.run()
    at3.multiselect(key="sw_tasks").set_value(["niah_single_1"])
    at3.text_input(key="sw_lengths").input("500")
    at3.text_input(key="sw_ranks").input("2").run()
    at3.selectbox(key="sw_prev").set_value(jid2).run()
    md = " ".join(texts(at3, "markdown"))
    assert "generated now" not in md and "2 generated when it ran" in md
    assert [w for w in texts(at3, "warning") if "other settings than the form" in w and "target lengths" in w], (texts(at3, "warning"), texts(at3, "error"))
    maps = at2.dataframe[1].value
    assert list(maps.columns) == ["task", "length (tokens)", "untouched", "one_head", "n"]
    assert maps["n"].tolist() == [2]
    assert Store(cache).job(jid2)["spec"]["rank_maps"] in ((("one_head", ((3, 1, 1),)),), [["one_head", [[3, 1, 1]]]])

    # a third session reopens either sweep from the list of previous sweeps, without running anything
    at3 = app("sweeps", run=run)
    at3.run()
    sb = at3.selectbox(key="sw_prev")
    assert sb.options and len(sb.options) == 2 and sb.value is None
    sb.set_value(jid).run()
    assert at3.session_state["sweep_job"] == jid and not at3.exception
    assert list(at3.dataframe[0].value.columns) == ["task", "length (tokens)", "r = 2", "r = 16 (untouched)", "n"]
    assert len(at3.dataframe) == 2  # no rank-map table for the first sweep (the other frame is the long table)
    at3.multiselect(key="sw_tasks").set_value(["niah_single_1"])
    at3.text_input(key="sw_lengths").input("500")
    at3.text_input(key="sw_ranks").input("2").run()
    at3.selectbox(key="sw_prev").set_value(jid2).run()
    assert at3.session_state["sweep_job"] == jid2
    assert list(at3.dataframe[1].value.columns)[3] == "one_head"


# =============================================================================================================
# Sessions: a page shows (and the sidebar exports) only this session's run or one the user picked
# =============================================================================================================
@pytest.mark.parametrize("page", ["heatmap", "head", "overview", "truncate", "budget", "sweeps"])
def test_a_new_session_is_shown_no_other_sessions_run(env, populated, page):
    """The store holds another session's run: a new session sees none of it until it picks it."""
    cache, run = populated
    env(cache)
    at = app(page)
    at.run()
    assert not at.exception
    shown = " ".join(texts(at, "markdown") + texts(at, "caption") + texts(at, "info"))
    assert run["run_id"] not in shown, shown
    assert at.selectbox(key="sb_run").value is None
    assert "Download this run (zip)" not in [b.proto.label for b in at.get("download_button")]
    if page in ("heatmap", "head", "overview"):
        assert not charts(at)
        assert any("No run chosen in this session" in i and "Previous runs" in i for i in texts(at, "info"))
    at.selectbox(key="sb_run").set_value(run["run_id"]).run()  # the user picks it: now it is shown
    assert not at.exception and at.session_state["run_id"] == run["run_id"]
    assert "Download this run (zip)" in [b.proto.label for b in at.get("download_button")]


def test_a_finished_capture_is_this_sessions_run_when_another_session_stored_a_newer_one(env, tmp_path,
                                                                                       tiny_checkpoint):
    """Session A captures and moves to the Heatmap while it runs; session B's capture finishes later (the newest run
    in the store). A's pages, its sidebar picker and its zip are A's run, from the first rerun on."""
    cache = env(tmp_path / "c")
    a = inspected(cache)
    a.text_input(key="paste_name").input("mine")
    a.text_area(key="paste_text").input(short_text(150, 1))
    a.button(key="paste_add").click().run()
    a.number_input(key="segment_len").set_value(64)
    a.button(key="run_capture").click().run()
    a.switch_page("pages/heatmap.py").run()
    work(cache)
    mine = Store(cache).job(a.session_state["capture_job"])["result"]["run_id"]
    theirs = capture(cache, tiny_checkpoint, (("theirs", short_text(170, 4)),))["run_id"]
    assert Store(cache).latest_run()["run_id"] == theirs != mine
    a.run()
    assert not a.exception
    assert a.selectbox(key="sb_run").value == mine and a.session_state["run_id"] == mine
    captions = " ".join(texts(a, "caption"))
    assert mine in captions and theirs not in captions


# =============================================================================================================
# Ranks and segment lengths typed in
# =============================================================================================================
def test_truncate_group_rank_that_is_not_an_integer_is_refused(env, populated):
    cache, run = populated
    env(cache)
    at = app("truncate", run=run)
    at.run()
    at.number_input(key="tr_g0_r").set_value(2.5).run()
    assert not at.exception
    errs = texts(at, "error")
    assert any("must be an integer ≥ 1; got 2.5" in e for e in errs), errs
    assert at.button(key="tr_run").proto.disabled


@pytest.mark.parametrize("value", [0, -64])
def test_segment_length_that_is_not_positive_is_refused_with_a_message(env, tmp_path, value):
    cache = env(tmp_path / "c")
    at = inspected(cache)
    at.text_area(key="paste_text").input(short_text(100))
    at.button(key="paste_add").click().run()
    at.number_input(key="segment_len").set_value(value).run()
    assert not at.exception
    errs = texts(at, "error")
    assert any(f"segment length must be a positive integer number of tokens, got {value}" in e for e in errs), errs
    assert at.button(key="run_capture").proto.disabled
    for page in ("truncate", "sweeps"):  # the pages that run the inspected model with that segment length
        at.switch_page(f"pages/{page}.py").run()
        assert not at.exception
        assert any(f"The segment length must be a positive integer number of tokens, got {value} (set on the Model"
                   in e for e in texts(at, "error")), (page, texts(at, "error"))
    at.switch_page("pages/documents.py").run()
    at.number_input(key="max_tokens").set_value(0).run()
    assert any("token limit per document must be a positive integer, got 0" in e for e in texts(at, "error"))


def test_two_uploads_with_the_same_name_are_both_kept_and_it_says_so(env, tmp_path):
    env(tmp_path / "c")
    at = app()
    at.run()
    at.file_uploader[0].set_value([("notes.txt", b"first version", "text/plain"),
                                   ("notes.txt", b"second version", "text/plain")])
    at.run()
    assert not at.exception
    docs = {d["name"]: d["text"] for d in at.session_state["user_docs"]}
    assert docs == {"notes.txt": "first version", "notes.txt (2)": "second version"}
    assert any("notes.txt" in i and "added as **notes.txt (2)**" in i for i in texts(at, "info")), texts(at, "info")
    # the same file again: not a third copy
    at.file_uploader[0].set_value([("notes.txt", b"first version", "text/plain")])
    at.run()
    assert len(at.session_state["user_docs"]) == 2
    assert any("already in the set" in i for i in texts(at, "info"))
    # a pasted document named like a bundled sample is kept beside it
    at.multiselect(key="sample_docs").select("genesis_1_2_kjv.txt").run()
    at.text_input(key="paste_name").input("genesis_1_2_kjv.txt")
    at.text_area(key="paste_text").input("my own genesis")
    at.button(key="paste_add").click().run()
    names = list(at.dataframe[0].value["document"])
    assert "genesis_1_2_kjv.txt" in names and "genesis_1_2_kjv.txt (2)" in names


def test_sweep_length_over_the_token_limit_is_refused(env, populated):
    cache, run = populated
    env(cache)
    at = app("sweeps", run=run)
    at.run()
    at.text_input(key="sw_lengths").input("1024, 99999999").run()
    assert not at.exception
    errs = texts(at, "error")
    assert any("Length 99,999,999 is over the token limit of 32,768 tokens" in e for e in errs), errs
    assert at.button(key="sw_run").proto.disabled


def test_sweep_length_a_later_seed_does_not_fit_is_refused_before_the_job(env, populated, tiny_checkpoint):
    """A form too large to preview (n = 1000): a length seed 0 fits but a later seed does not is named on the
    page, with the seed and the length that fits every seed checked; the job's own check (``generate_many``)
    agrees on that length."""
    from transformers import AutoTokenizer

    from gdnviz.errors import TaskTooShort
    from gdnviz.probes import ruler
    from gdnviz.ui.common import PREVIEW_TOKENS

    cache, run = populated
    env(cache)
    tok = AutoTokenizer.from_pretrained(str(tiny_checkpoint))
    task = "vt"
    with pytest.raises(TaskTooShort) as e:
        ruler.generate(task, tok, 1, 0)
    L = e.value.minimum
    assert _fits(task, tok, L, 1) and not _fits(task, tok, L, 200)  # seed 0 fits, not every one of seeds 0..199
    n = 1000
    assert n * L > PREVIEW_TOKENS  # the page builds none of the form's prompts
    at = app("sweeps", run=run)
    at.run()
    at.multiselect(key="sw_tasks").set_value([task])
    at.text_input(key="sw_lengths").input(str(L))
    at.number_input(key="sw_n").set_value(n).run()
    assert not at.exception
    errs = [e for e in texts(at, "error") if f"Length {L:,} is too short for {task} at sample seed" in e]
    assert len(errs) == 1 and at.button(key="sw_run").proto.disabled, texts(at, "error")
    need = int(errs[0].split("Raise it to ")[1].split(" ")[0].replace(",", ""))
    last = int(errs[0].split("seeds 0..")[1].split(" ")[0])
    assert 200 <= last + 1 < n
    assert _fits(task, tok, need, last + 1) and not _fits(task, tok, need - 1, last + 1)
    assert any(f"{task} seeds 0..{last} of seeds 0..{n - 1}; the job checks the other seeds" in c
               for c in texts(at, "caption")), texts(at, "caption")
    at.text_input(key="sw_lengths").input(str(need)).run()
    assert not any("too short" in e for e in texts(at, "error"))


def _fits(task, tok, length: int, n: int) -> bool:
    from gdnviz.errors import TaskTooShort
    from gdnviz.probes import ruler

    try:
        ruler.generate_many(task, tok, length, n)
    except TaskTooShort:
        return False
    return True


def test_sweep_job_over_its_token_limit_fails_before_building_prompts(env, tmp_path, tiny_checkpoint):
    cache = env(tmp_path / "c")
    store = Store(cache)
    jid = store.submit("sweep", jobs.spec_to_dict(jobs.SweepJob(model=str(tiny_checkpoint), tasks=("niah_single_1",),
                                                                lengths=(99_999_999,), n=1)))
    t0 = time.time()
    work(cache)
    rec = store.job(jid)
    assert rec["status"] == "failed" and rec["error_type"] == "DocumentTooLong", rec
    assert "length 99,999,999 is over the token limit of 32,768 tokens" in rec["error"]
    assert time.time() - t0 < 60


def test_an_upload_is_tokenised_once_and_one_too_large_is_refused_before_decoding(env, tmp_path, monkeypatch):
    from gdnviz import documents as D

    cache = env(tmp_path / "c")
    at = inspected(cache)
    calls = []
    real = D.tokenize
    monkeypatch.setattr(D, "tokenize", lambda tok, text: calls.append(len(text)) or real(tok, text))
    at.file_uploader[0].set_value([("doc.txt", short_text(300).encode(), "text/plain")])
    at.run()
    for _ in range(3):  # reruns (any click) do not tokenise it again
        at.run()
    assert len(calls) == 1, calls
    # far over the limit whatever the tokenizer does: refused by its size, never decoded (its last byte is not UTF-8)
    at.number_input(key="max_tokens").set_value(100).run()
    big = b"word " * 200_000 + b"\xff"
    at.file_uploader[0].set_value([("big.txt", big, "text/plain")])
    at.run()
    errs = texts(at, "error")
    assert any("'big.txt' is 1,000,001 bytes" in e and "over the limit of 100 tokens" in e for e in errs), errs
    assert not any("UTF-8" in e for e in errs)
    assert "big.txt" not in [d["name"] for d in at.session_state["user_docs"]]


# =============================================================================================================
# Compare two runs
# =============================================================================================================
@pytest.fixture(scope="module")
def three_runs(tmp_path_factory, tiny_checkpoint):
    """One cache: the tiny model on two document sets (A, B) and the demo model (another head grid)."""
    d = tmp_path_factory.mktemp("three")
    a = capture(d, tiny_checkpoint, (("alpha", short_text(300, 0)), ("beta", short_text(260, 3))))
    b = capture(d, tiny_checkpoint, (("gamma", short_text(280, 5)),))
    demo = str(ROOT / "gdnviz" / "assets" / "demo")
    c = capture(d, demo, (("delta", short_text(200, 7)),))
    return d, a, b, c


def test_compare_needs_two_runs(env, populated):
    cache, run = populated
    env(cache)
    at = app("compare", run=run)
    at.run()
    assert not at.exception and not charts(at)
    assert any("Two runs are needed" in m for m in texts(at, "info"))


def test_compare_two_runs_side_by_side_with_the_difference(env, three_runs):
    import json

    from gdnviz.summary import document_set_table

    cache, a, b, _ = three_runs
    env(cache)
    at = app("compare", run=a)
    at.run()
    assert not at.exception
    # A is this session's run; B is not chosen for the user (never another session's run unless picked)
    assert at.selectbox(key="cmp_a").value == a["run_id"] and at.selectbox(key="cmp_b").value is None
    assert not charts(at) and any("Pick two runs" in i for i in texts(at, "info"))
    at.selectbox(key="cmp_b").set_value(b["run_id"]).run()
    assert not at.exception
    titles = chart_titles(at)
    assert len(titles) == 4 and titles[0].startswith("A: ") and titles[1].startswith("B: ")
    assert titles[2].startswith("B − A: ") and titles[3] == "Effective rank vs decay horizon, two runs"
    sa, sb = (json.loads(c.proto.spec) for c in charts(at)[:2])
    assert sa["encoding"]["color"]["scale"]["domain"] == sb["encoding"]["color"]["scale"]["domain"]
    d = pa.ipc.open_stream(charts(at)[2].proto.datasets[0].data.data).read_all().to_pandas()
    ta = document_set_table(jobs.load_run_captures(Store(cache), a))
    tb = document_set_table(jobs.load_run_captures(Store(cache), b))
    want = tb.set_index(["layer", "head"])["erank"] - ta.set_index(["layer", "head"])["erank"]
    got = d.set_index(["layer", "head"])["value"]
    assert np.allclose(got.sort_index().to_numpy(), want.sort_index().to_numpy())
    at.radio(key="cmp_metric").set_value("energy_rank99").run()
    assert not at.exception and len(charts(at)) == 4
    assert {"cmp_heat_d_png", "cmp_heat_d_svg", "cmp_scatter_csv"} <= {x.key for x in at.get("download_button")}
    at.selectbox(key="cmp_b").set_value(a["run_id"]).run()
    assert any("the same run" in w for w in texts(at, "warning"))


def test_compare_runs_with_different_head_grids_says_so(env, three_runs):
    cache, a, _, c = three_runs
    env(cache)
    at = app("compare", run=a)
    at.run()
    at.selectbox(key="cmp_b").set_value(c["run_id"]).run()
    assert not at.exception
    warn = [w for w in texts(at, "warning") if "different head grids" in w]
    assert warn and "GDN layers [0, 1, 3] vs [0, 1, 2, 4, 5, 6]" in warn[0] and "4 vs 2 heads per layer" in warn[0]
    titles = chart_titles(at)
    assert len(titles) == 3 and not any(t.startswith("B − A") for t in titles)


def test_compare_two_stored_sweeps(env, three_runs, tiny_checkpoint):
    cache, a, b, _ = three_runs
    env(cache)
    store = Store(cache)
    demo = str(ROOT / "gdnviz" / "assets" / "demo")
    ids = []
    for model in (str(tiny_checkpoint), demo):  # two models, the same task, length and ranks
        ids.append(store.submit("sweep", jobs.spec_to_dict(jobs.SweepJob(
            model=model, tasks=("niah_single_1",), lengths=(300,), ranks=(2,), n=1, max_new_tokens=4,
            segment_len=64))))
        work(cache)
        assert store.job(ids[-1])["status"] == "done", store.job(ids[-1])["error"]
    at = app("compare", run=a)
    at.run()
    at.selectbox(key="cmp_b").set_value(b["run_id"]).run()
    at.selectbox(key="cmp_sw_a").set_value(ids[0]).run()
    at.selectbox(key="cmp_sw_b").set_value(ids[1]).run()
    assert not at.exception
    from gdnviz.probes import sweep

    ta, tb = (sweep.table_frame(store.job(j)["result"]["table"]) for j in ids)
    diff = [d.value for d in at.dataframe if "B − A (points)" in d.value.columns][0]
    common = sorted(set(ta["r"]) & set(tb["r"]))  # r = 2; the untouched r differs (16 vs 128)
    assert common == [2] and diff["r"].tolist() == common
    want = tb.set_index("r")["score"] - ta.set_index("r")["score"]
    assert np.allclose(diff.set_index("r")["B − A (points)"], want.loc[common])
    assert any("not a paired difference" in m for m in texts(at, "markdown"))


def test_figure_export_options_survive_page_switches_and_say_when_a_size_is_ignored(env, populated):
    cache, run = populated
    env(cache)
    at = app("overview", run=run)
    at.run()
    at.number_input(key="ex_width").set_value(30).run()
    assert any("A width of 30 px is below 50 px" in c for c in texts(at, "caption"))
    at.number_input(key="ex_width").set_value(800)
    at.select_slider(key="ex_scale").set_value(4.0).run()
    assert not at.exception
    assert (at.session_state["ex_width"], at.session_state["ex_scale"]) == (800, 4.0)
    at.switch_page("pages/head.py").run()  # sidebar widgets: the values survive a page switch
    assert (at.session_state["ex_width"], at.session_state["ex_scale"]) == (800, 4.0)


def test_head_page_what_this_state_holds_computes_in_the_worker_and_refuses_bad_positions(env, populated):
    """Not computed → Compute → the worker's job → numbers, figures and the top tokens; a position outside the
    document gets the library's message; another head or position never shows this result."""
    cache, run = populated
    env(cache)
    at = app("head", run=run, layer=2, head=1)
    at.run()
    assert not at.exception
    T = run["documents"][0]["n_tokens"]
    assert any("Not computed yet" in i and f"after {T:,} of {T:,} tokens" in i for i in texts(at, "info"))
    at.button(key="holds_compute").click().run()
    assert any("What this state holds" in p for p in progress(at)) or any("queued" in p for p in progress(at))
    jid = at.session_state["holds_job_now"]
    assert Store(cache).job(jid)["kind"] == "holds"
    assert work(cache) >= 1  # (the module's shared cache may hold another test's queued job too)
    assert Store(cache).job(jid)["status"] == "done"
    at.run()
    assert not at.exception
    titles = chart_titles(at)
    assert {"Contributions along the document", "Which tokens fill each top singular direction",
            "Rewrite rate between boundaries"} <= set(titles)
    metrics = {m.label: m.value for m in at.metric}
    assert "%" in metrics["From beyond 64 tokens"] and float(metrics["‖S_old‖ / ‖S‖"]) >= 0
    top = at.dataframe[-1].value
    assert list(top["rank"]) == list(range(1, 13)) and (top["norm"].diff().dropna() <= 0).all()
    # exported like every other figure: PNG, SVG and the CSV of the contributions / the rewrite rates
    buttons = {b.key: b.proto.label for b in at.get("download_button")}
    assert all(buttons.get(f"ch_holds_{f}_{x}") == x.upper() for f in ("along", "dirs", "rewrite")
               for x in ("png", "svg", "csv")), buttons
    # the same head at another position: not computed, nothing of the other result shown
    at.number_input(key="holds_pos").set_value(128).run()
    assert any("Not computed yet" in i and "after 128 of" in i for i in texts(at, "info"))
    assert "Rewrite rate between boundaries" not in chart_titles(at)
    at.number_input(key="holds_pos").set_value(10 ** 6).run()
    at.button(key="holds_compute").click().run()
    work(cache)
    at.run()
    errs = texts(at, "error")
    assert any("position 1000000 is outside the document" in e and f"1..{T}" in e for e in errs), errs
    at.number_input(key="holds_pos").set_value(0).run()  # back: the stored result, without recomputing
    assert "Rewrite rate between boundaries" in chart_titles(at) and work(cache) == 0


def test_sweep_whose_prompts_cannot_fit_in_memory_is_refused_on_the_page(env, populated):
    """Every task at 20 lengths near the token limit, n = 10,000: the page says the prompts would not fit in the
    memory available (before building any) and offers no Run."""
    cache, run = populated
    env(cache)
    at = app("sweeps", run=run)
    at.run()
    at.multiselect(key="sw_tasks").set_value(["niah_single_1", "vt", "cwe"])
    at.text_input(key="sw_lengths").input(", ".join(str(32_768 - i) for i in range(20)))
    at.number_input(key="sw_n").set_value(10_000).run()
    assert not at.exception
    errs = texts(at, "error")
    assert any("would not fit in memory" in e and "n = 10,000" in e for e in errs), errs
    assert at.button(key="sw_run").proto.disabled


def test_scan_and_budget_lengths_over_the_token_limit_are_refused_before_any_prompt(env, populated, monkeypatch):
    """Head scans & budgets: a scan length or a budget length over the token limit is refused on the page with the
    sweeps' message, before a prompt of it is built (a 99,999,999-token haystack would take minutes and the
    server's memory), and neither Run is offered."""
    from gdnviz.probes import ruler

    real = ruler.generate_many

    def guarded(task, tok, target_len, *a, **kw):
        assert target_len <= 32_768, f"a {target_len:,}-token prompt was built"
        return real(task, tok, target_len, *a, **kw)

    monkeypatch.setattr(ruler, "generate_many", guarded)
    cache, run = populated
    env(cache)
    at = app("scans", run=run)
    at.run()
    at.number_input(key="sc_length").set_value(99_999_999)
    at.text_input(key="bg_lengths").input("1024, 99999999").run()
    assert not at.exception, [e.proto for e in at.exception]
    errs = texts(at, "error")
    assert sum("Length 99,999,999 is over the token limit of 32,768 tokens" in e for e in errs) == 2, errs
    assert at.button(key="sc_run").proto.disabled and at.button(key="bg_run").proto.disabled


def test_scan_and_budget_jobs_over_their_token_limit_fail_before_building_prompts(env, tmp_path, tiny_checkpoint):
    cache = env(tmp_path / "c")
    store = Store(cache)
    ids = [store.submit(k, jobs.spec_to_dict(j)) for k, j in (
        ("scan", jobs.ScanJob(model=str(tiny_checkpoint), task="niah_single_1", length=99_999_999, n=1)),
        ("budget", jobs.BudgetJob(model=str(tiny_checkpoint), tasks=("vt",), lengths=(1024, 99_999_999), n=2)))]
    work(cache)
    for jid in ids:
        rec = store.job(jid)
        assert rec["status"] == "failed" and rec["error_type"] == "DocumentTooLong", rec
        assert "length 99,999,999 is over the token limit of 32,768 tokens" in rec["error"]
