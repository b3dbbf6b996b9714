"""End to end in headless Debian Chromium against a real ``streamlit run app.py`` on 127.0.0.1 (with its real
worker process) on a tmp cache directory and the tiny checkpoint.

Flows: a deep link opened before any other session of a fresh server; a capture on a sample document; clicks on
heatmap cells that show their head under the heatmap (and one in pick mode that picks), kept in the page's URL
across a reload, whose link opens the Head page, whose tabs of figures each draw their charts (and the same URL pasted into a new browser session, which first
picks the run); a click on a point of the overview scatter, in pick mode and in
open mode (the same panel); a click on a row of a head's exact attention map; a truncation with both answers; a PNG download checked
byte by byte; a binary upload refused with a message; two sessions capturing at once, each shown and exporting only
its own run.
The tests of this module run in order and share the server (each later flow uses the earlier capture).
"""
from __future__ import annotations

import os
import re
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from app_fixtures import tiny_checkpoint  # noqa: F401  (fixture)

pytestmark = pytest.mark.browser
ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
SLOW = 300_000  # ms: the worker's first start imports torch + transformers on 2 busy cores

if not Path(CHROMIUM).exists():
    pytest.skip("needs Debian chromium at /usr/bin/chromium (apt-get install chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def streamlit_server(cache: Path, default_model: str):
    """``streamlit run app.py`` on a free port of 127.0.0.1 with ``cache`` as its store; yields its base URL. Its
    log and pid are in ``cache``/streamlit.log and streamlit.pid."""
    port = _free_port()
    env = dict(os.environ, GDNVIZ_DEFAULT_MODEL=default_model, GDNVIZ_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    for k in ("GDNVIZ_NO_WORKER", "GDNVIZ_TEST_OOM", "GDNVIZ_TEST_CRASH", "GDNVIZ_TEST_JOB_DELAY",
              "GDNVIZ_POLL_SECONDS"):
        env.pop(k, None)
    log = open(cache / "streamlit.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", "app.py", "--server.address", "127.0.0.1", "--server.port",
         str(port), "--server.headless", "true", "--browser.gatherUsageStats", "false",
         "--server.fileWatcherType", "none"], cwd=str(ROOT), env=env, stdout=log, stderr=subprocess.STDOUT)
    (cache / "streamlit.pid").write_text(str(proc.pid))
    base = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while True:
        try:
            if urllib.request.urlopen(base + "/_stcore/health", timeout=2).read() == b"ok":
                break
        except OSError:
            pass
        if proc.poll() is not None or time.time() - t0 > 120:
            raise RuntimeError(f"streamlit did not start: {(cache / 'streamlit.log').read_text()[-3000:]}")
        time.sleep(0.3)
    try:
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_checkpoint):
    cache = tmp_path_factory.mktemp("browser_cache")
    with streamlit_server(cache, str(tiny_checkpoint)) as base:
        yield base, cache


@pytest.fixture(scope="module")
def browser():
    pw = sync_api.sync_playwright().start()
    b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
    yield b
    b.close()
    pw.stop()


@pytest.fixture
def page(browser):
    ctx = browser.new_context(viewport={"width": 1400, "height": 1400}, accept_downloads=True)
    p = ctx.new_page()
    p.set_default_timeout(60_000)
    yield p
    ctx.close()


def wait_for_app(page, timeout: int = 120_000) -> None:
    """Streamlit's own readiness check: connected, script not running, no skeleton."""
    page.wait_for_selector("[data-testid='stAppViewContainer']", state="attached", timeout=timeout)
    page.wait_for_selector("[data-testid='stApp'][data-test-connection-state='CONNECTED']", timeout=timeout)
    page.wait_for_selector("[data-testid='stApp'][data-test-script-state='notRunning']", timeout=timeout)
    page.wait_for_function("document.querySelectorAll(\"[data-testid='stSkeleton']\").length === 0",
                           timeout=timeout)


def settled(locator, n: int, timeout: int = 30_000) -> None:
    """Assert that ``locator`` matches ``n`` elements once the page has settled: the frontend removes the elements
    of a finished run's earlier output (stale) a moment after the script state says "not running", so a count
    read at once can still include them under load."""
    sync_api.expect(locator).to_have_count(n, timeout=timeout)


def pick_run(page, index: int) -> None:
    """Open the ``index``-th run (newest first) of the sidebar's *Previous runs* picker."""
    page.get_by_test_id("stSidebar").get_by_test_id("stSelectbox").click()
    page.get_by_role("option").nth(index).click()
    wait_for_app(page)
    page.mouse.move(1300, 1300)  # off the sidebar: the zip button's tooltip would cover what is clicked next


def paste_document(page, name: str, text: str) -> None:
    page.get_by_role("tab", name="Paste text").click()
    page.locator("input[aria-label='Name']").fill(name)
    page.keyboard.press("Enter")
    wait_for_app(page)
    page.locator("textarea[aria-label='Text']").fill(text)
    page.keyboard.press("Control+Enter")
    wait_for_app(page)
    page.get_by_role("button", name="Add to the document set").click()
    wait_for_app(page)
    page.get_by_text(name).first.wait_for(state="attached")


def test_deep_link_on_a_fresh_server(server, page):
    """The very first session opens /head?layer=..: it gets the app (navigation, sidebar), not the bare page."""
    base, _ = server
    page.goto(base + "/head?layer=1&head=2")
    wait_for_app(page)
    page.get_by_text("No capture yet.").wait_for()
    nav = page.get_by_test_id("stSidebarNav")
    for title in ("Model & documents", "Heatmap", "Head", "Overview figures", "Truncate & compare", "Retrieval sweeps",
                  "Loss vs rank", "Head scans & budgets", "State patching", "Compare two runs", "Cache budget"):
        assert nav.get_by_text(title, exact=True).count() == 1
    assert page.get_by_text("Worker", exact=False).count() >= 1


def test_capture_on_a_sample_document(server, page):
    base, cache = server
    page.goto(base + "/")
    wait_for_app(page)
    page.get_by_text("Heads per GDN layer").wait_for(timeout=SLOW)  # the worker inspected the model
    page.get_by_test_id("stMultiSelect").first.click()
    page.get_by_role("option", name=re.compile("Abraham Lincoln")).click()
    page.keyboard.press("Escape")
    wait_for_app(page)
    page.get_by_text("lincoln_two_speeches.txt").first.wait_for(state="attached")  # a cell of the data grid
    page.get_by_role("button", name="Run capture").click()
    page.get_by_text("Captured 1 document").wait_for(timeout=SLOW)
    wait_for_app(page)
    assert page.get_by_role("link", name="Open the heatmap").count() == 1


def test_heatmap_click_shows_the_head_below_and_links_to_its_page(server, page, browser):
    """A click on a heatmap cell shows that head in the panel under the heatmap (same page): its heading, six key
    numbers and spectrum; a click on another cell replaces it; a click in pick mode picks and leaves the panel; the
    panel's link opens the Head page of that head."""
    base, _ = server
    page.goto(base + "/heatmap")
    wait_for_app(page)
    pick_run(page, 0)  # a new browser session: it opens the capture of the session before
    chart = page.get_by_test_id("stVegaLiteChart").first
    panel = page.locator(".st-key-head_panel_box")
    assert panel.count() == 0

    def cell(layer, head):
        return chart.locator(f"path[aria-label^='value head: {head}; layer (model index): {layer};']")

    for layer, head, before in ((1, 2, None), (3, 0, (1, 2))):
        cell(layer, head).click()
        panel.get_by_role("heading", name=f"Layer {layer} · head {head}").wait_for()
        wait_for_app(page)
        page.wait_for_url(re.compile(rf"/heatmap\?layer={layer}&head={head}$"))  # the URL holds the open head
        panel.get_by_test_id("stVegaLiteChart").filter(has_text="Singular spectrum at the document end").wait_for()
        settled(panel.get_by_test_id("stVegaLiteChart"), 1)
        settled(panel.get_by_test_id("stMetric"), 6)
        settled(page.get_by_role("heading", name=re.compile(r"^Layer \d+ · head \d+")), 1)
        if before:
            settled(page.get_by_role("heading", name=f"Layer {before[0]} · head {before[1]}"), 0)
    # pick mode: a click picks the cell, the panel stays on its head
    page.get_by_text("adds / removes it in the truncation set", exact=True).click()
    wait_for_app(page)
    cell(0, 1).click()
    page.get_by_text("Truncation set (1 head): L0·H1").wait_for()
    wait_for_app(page)
    settled(panel.get_by_role("heading", name="Layer 3 · head 0"), 1)
    assert page.url.endswith("/heatmap?layer=3&head=0")
    # a reload (a new session) reopens the same panel once the run is picked; Close takes the head out of the URL
    page.reload()
    wait_for_app(page)
    pick_run(page, 0)
    panel.get_by_role("heading", name="Layer 3 · head 0").wait_for()
    panel.get_by_role("button", name="Close").click()
    wait_for_app(page)
    page.wait_for_url(re.compile(r"/heatmap$"))
    settled(panel, 0)
    page.reload()
    wait_for_app(page)
    pick_run(page, 0)
    settled(panel, 0)
    cell(3, 0).click()
    panel.get_by_role("heading", name="Layer 3 · head 0").wait_for()
    wait_for_app(page)
    page.get_by_role("link", name="Open the full head page").click()
    page.wait_for_url(re.compile(r"/head\?layer=3&head=0$"), timeout=60_000)
    wait_for_app(page)
    page.get_by_role("heading", name="Layer 3 · head 0").wait_for()
    # the figures in tabs: the head opens on its spectrum and effective rank; each tab draws its own when opened
    charts = page.get_by_test_id("stVegaLiteChart")
    settled(charts, 2)
    for tab, titles in (("Energy kept", ["Energy kept by rank-r truncation"]),
                        ("Decay α & key cone", ["Per-token decay α of this head", "Key cone of this head"]),
                        ("Over the documents", ["Per-document spread of this head"]),
                        ("Spectrum & effective rank", ["Singular spectrum at the document end",
                                                       "Effective rank along the document"])):
        page.get_by_role("tab", name=tab).click()
        for t in titles:
            charts.filter(has_text=t).wait_for()
        wait_for_app(page)
        settled(charts, len(titles))
    url = page.url

    # the same link pasted into a new browser session
    ctx = browser.new_context(viewport={"width": 1400, "height": 1400})
    other = ctx.new_page()
    other.goto(url)
    wait_for_app(other)
    other.get_by_text("No run chosen in this session.").wait_for()  # another session's run is not shown unasked
    pick_run(other, 0)
    other.get_by_role("heading", name="Layer 3 · head 0").wait_for()
    ctx.close()


# the scatter's points: one per head, "horizon: …; erank: …; layer: l; head: h; …" (the min–max bars are <line>s)
_CLEAR_POINTS = """els => els.flatMap((e, i) => {
  const r = e.getBoundingClientRect(), x = r.x + r.width / 2, y = r.y + r.height / 2;
  return document.elementFromPoint(x, y) === e ? [[i, e.getAttribute('aria-label')]] : [];
})"""


def test_a_click_scrolls_the_panel_numbers_into_view_under_a_tall_chart(server, browser):
    """In a window too short for the heatmap and the panel (the panel starts below the fold), a click on a cell
    scrolls the page just far enough to show the panel's key numbers, the heading above them; a later click on a
    cell that is in view leaves the numbers in view."""
    base, _ = server
    ctx = browser.new_context(viewport={"width": 1400, "height": 1400})
    page = ctx.new_page()
    page.set_default_timeout(60_000)
    try:
        page.goto(base + "/heatmap")
        wait_for_app(page)
        pick_run(page, 0)
        page.set_viewport_size({"width": 1400, "height": 640})  # short: the panel will start below the fold
        chart = page.get_by_test_id("stVegaLiteChart").first
        chart.locator("path[aria-label^='value head: ']").first.wait_for()
        panel = page.locator(".st-key-head_panel_box")

        def in_view(locator) -> bool:
            b = locator.bounding_box()
            return b is not None and b["y"] >= 0 and b["y"] + b["height"] <= 640 + 1

        for layer, head in ((1, 2), (0, 1)):
            cell = chart.locator(f"path[aria-label^='value head: {head}; layer (model index): {layer};']")
            cell.scroll_into_view_if_needed()
            cell.click()
            panel.get_by_role("heading", name=f"Layer {layer} · head {head}").wait_for()
            wait_for_app(page)
            settled(panel.get_by_test_id("stMetric"), 6)
            numbers = panel.get_by_test_id("stMetric").last
            page.wait_for_function("el => { const b = el.getBoundingClientRect(); return b.top >= 0 && "
                                   "b.bottom <= window.innerHeight + 1; }", arg=numbers.element_handle(),
                                   timeout=10_000)
            assert in_view(numbers)
    finally:
        ctx.close()


def test_overview_scatter_click_picks_or_opens_that_head(server, page):
    """Overview figures, erank vs horizon: in pick mode a click on a point adds its head to the truncation set (the
    page stays); in open mode a click on another point shows that head in the panel under the figures (the page
    stays), whose link opens its Head page."""
    base, _ = server
    page.goto(base + "/overview")
    wait_for_app(page)
    pick_run(page, 0)
    chart = page.get_by_test_id("stVegaLiteChart").filter(has_text="Effective rank vs decay horizon")
    points = chart.locator("path[aria-label^='horizon: ']")
    points.first.wait_for()
    chart.scroll_into_view_if_needed()
    # two points that no other mark covers at their centre (heads with close statistics overlap)
    clear = [(i, tuple(int(v) for v in re.search(r"; layer: (\d+); head: (\d+);", label).groups()))
             for i, label in points.evaluate_all(_CLEAR_POINTS)]
    assert len(clear) >= 2, clear
    (i_pick, picked), (i_open, opened) = clear[0], clear[-1]

    page.get_by_text("adds / removes it in the truncation set", exact=True).click()
    wait_for_app(page)
    points.nth(i_pick).click()
    page.get_by_text(f"Truncation set (1 head): L{picked[0]}·H{picked[1]}").wait_for()
    wait_for_app(page)
    assert "/overview" in page.url

    page.get_by_text("shows it below these figures", exact=True).click()
    wait_for_app(page)
    points.nth(i_open).click()
    panel = page.locator(".st-key-head_panel_box")
    panel.get_by_role("heading", name=f"Layer {opened[0]} · head {opened[1]}").wait_for()
    wait_for_app(page)
    page.wait_for_url(re.compile(rf"/overview\?layer={opened[0]}&head={opened[1]}$"))  # no page switch
    panel.get_by_test_id("stVegaLiteChart").filter(has_text="Singular spectrum at the document end").wait_for()
    settled(panel.get_by_test_id("stMetric"), 6)
    # the open-mode click did not add the opened head to the truncation set
    page.get_by_text(f"Truncation set (1 head): L{picked[0]}·H{picked[1]}").wait_for()
    panel.get_by_role("link", name="Open the full head page").click()
    page.wait_for_url(re.compile(rf"/head\?layer={opened[0]}&head={opened[1]}$"), timeout=60_000)
    page.get_by_role("heading", name=f"Layer {opened[0]} · head {opened[1]}").wait_for()


def test_a_click_on_a_row_of_the_exact_attention_map_shows_that_querys_top_keys(server, page):
    """Head page, *Exact attention map* over queries 64..127 (one drawn cell per query and key): a click on a cell of
    query row t of the GDN map makes t the query of the top-key tables (the number box, the query's text, the
    orange rule), on the server's rerun."""
    base, _ = server
    page.goto(base + "/head?layer=3&head=1")
    wait_for_app(page)
    pick_run(page, 0)
    page.get_by_role("heading", name="Layer 3 · head 1").wait_for()
    for label, value in (("First query position", "64"), ("End (exclusive)", "128")):
        box = page.locator(f"input[aria-label='{label}']")
        box.fill(value)
        box.press("Enter")
        wait_for_app(page)
    page.locator(".st-key-am_compute button").click()  # the map's Compute (the holds section has one too)
    gdn = page.get_by_test_id("stVegaLiteChart").filter(has_text="GDN layer 3 head 1: exact map")
    gdn.wait_for(timeout=SLOW)
    wait_for_app(page)
    query = page.locator("input[aria-label='Query position t (or click a row of a map)']")
    assert query.input_value() == "127"  # a new map starts at its last query
    t = 70
    cell = gdn.locator(f"path[aria-label^='key position s (token index): 3; query position t (token index): {t};']")
    cell.click()
    page.get_by_text(f"Query t = {t}").wait_for()
    wait_for_app(page)
    assert query.input_value() == str(t)
    assert page.get_by_text("Query t = 127").count() == 0


def test_quick_presses_on_the_key_zoom_leave_both_maps_at_the_sliders_zoom(server, page):
    """Head page, *Exact attention map* at its default window (more keys than drawn cells, so the key zoom is
    offered): 40 quick arrow-key presses on the zoom's lower end, then the page settles, every map shows the zoom the
    slider shows and nothing is left stale. The top-key tables and *What this state holds*' token table show all
    their rows."""
    base, _ = server
    page.set_viewport_size({"width": 1400, "height": 5000})  # the whole page in view
    page.goto(base + "/head?layer=3&head=2")
    wait_for_app(page)
    pick_run(page, 0)
    page.get_by_role("heading", name="Layer 3 · head 2").wait_for()
    main = page.get_by_test_id("stMain")
    page.locator(".st-key-am_compute button").click()
    main.get_by_text("GDN map: top keys").wait_for(timeout=SLOW)
    wait_for_app(page)
    maps = main.get_by_test_id("stVegaLiteChart").filter(has_text="query position t")
    n_maps = maps.count()
    assert n_maps == 2  # the GDN map and the softmax map of the model's attention layer
    slider = main.get_by_test_id("stSlider").filter(has_text="Key positions shown (zoom)")
    slider.get_by_role("slider").first.focus()
    for _ in range(40):
        page.keyboard.press("ArrowRight")
    wait_for_app(page, 180_000)  # settles (TimeoutError if runs keep coming)
    page.wait_for_timeout(1000)
    wait_for_app(page)
    k0 = int(slider.get_by_test_id("stSliderThumbValue").first.text_content().replace(",", ""))
    assert k0 > 0
    zooms = [re.findall(r"zoom: keys ([\d,]+)\.\.", maps.nth(i).text_content()) for i in range(n_maps)]
    assert zooms == [[f"{k0:,}"]] * n_maps, (k0, zooms)
    assert page.locator("[data-testid='stMain'] [data-stale='true']").count() == 0
    # every row of the tables on screen (no inner scrolling): header + rows of 35 px
    tables = main.get_by_test_id("stDataFrame")
    keys = [tables.nth(i) for i in range(tables.count())][-n_maps:]  # the top-key tables end the section
    for tb in keys:
        assert tb.bounding_box()["height"] >= 11 * 35
    page.locator(".st-key-holds_compute button").click()
    main.get_by_text("Tokens contributing most").wait_for(timeout=SLOW)
    wait_for_app(page)
    top = main.get_by_test_id("stDataFrame").first  # the section's first table
    assert top.bounding_box()["height"] >= 13 * 35


def test_truncation_shows_both_answers(server, page):
    base, _ = server
    page.goto(base + "/truncate")
    wait_for_app(page)
    pick_run(page, 0)
    page.locator("input[aria-label='Target length (tokens)']").fill("600")
    page.keyboard.press("Enter")
    wait_for_app(page)
    page.locator("input[aria-label=\"New tokens (0 = the task's own)\"]").fill("8")
    page.keyboard.press("Enter")
    wait_for_app(page)
    page.get_by_role("button", name="Run untouched and truncated").click()
    page.get_by_text("Untouched model", exact=True).wait_for(timeout=SLOW)
    page.get_by_text("Truncated model", exact=True).wait_for()
    wait_for_app(page)
    # the whole page is redrawn when the job finishes (a rerun from the polling fragment): wait for the summary line
    # rather than counting at once (CI once counted 0 in the middle of that redraw)
    page.get_by_text("12 heads truncated").wait_for(timeout=30_000)
    assert page.get_by_text("12 heads truncated").count() == 1
    assert page.locator("[data-testid='stCode']").count() >= 2
    assert page.get_by_text("Expected answer(s):").count() == 1


def test_png_download(server, page, tmp_path):
    base, _ = server
    page.goto(base + "/heatmap")
    wait_for_app(page)
    pick_run(page, 0)
    page.get_by_test_id("stVegaLiteChart").first.wait_for()
    with page.expect_download(timeout=120_000) as d:
        page.get_by_test_id("stDownloadButton").get_by_role("button", name="PNG").first.click()
    dl = d.value
    assert dl.suggested_filename == "heatmap_erank.png"
    path = tmp_path / "h.png"
    dl.save_as(path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    w, h = struct.unpack(">II", data[16:24])
    assert w > 200 and h > 100 and len(data) > 5_000
    # the exported figure carries no on-screen hint (the chart on the page does)
    assert page.get_by_text("click a cell to see that head below").count() >= 1
    with page.expect_download(timeout=120_000) as d:
        page.get_by_test_id("stDownloadButton").get_by_role("button", name="SVG").first.click()
    svg = (tmp_path / "h.svg")
    d.value.save_as(svg)
    text = svg.read_text()
    assert "Effective rank (directions)" in text and "click a cell" not in text and "…" not in text


def test_binary_upload_is_refused_with_a_message(server, page, tmp_path):
    base, _ = server
    page.goto(base + "/")
    wait_for_app(page)
    page.get_by_role("tab", name="Upload files").click()
    bad = tmp_path / "scan.txt"
    bad.write_bytes(b"%PDF-1.7\n\x00\x01\x02\x03 binary")
    page.locator("input[type='file']").set_input_files(str(bad))
    page.get_by_text("looks like a binary file (a NUL byte at byte offset 9)", exact=False).wait_for()


def _wait_jobs_done(cache: Path, timeout: float = 300.0) -> None:
    from gdnviz.store import TERMINAL, Store, iter_jobs

    store, t0 = Store(cache), time.time()
    while any(r["status"] not in TERMINAL for r in iter_jobs(store)):
        assert time.time() - t0 < timeout, "the worker did not finish its jobs"
        time.sleep(0.3)


def test_two_sessions_each_see_and_export_only_their_own_run(server, browser, tmp_path):
    """Session A starts a capture and goes to the Heatmap before it finishes; session B captures after it, so B's
    run is the newest in the shared store. A's heatmap and A's sidebar zip are A's run; a third session is shown
    no run until it picks one."""
    import io
    import json
    import zipfile

    from app_fixtures import short_text
    from gdnviz.store import Store

    base, cache = server
    ctxs = [browser.new_context(viewport={"width": 1400, "height": 1400}, accept_downloads=True) for _ in range(3)]
    a, b, c = (x.new_page() for x in ctxs)
    for p in (a, b, c):
        p.set_default_timeout(60_000)
    try:
        a.goto(base + "/")
        wait_for_app(a)
        a.get_by_text("Heads per GDN layer").wait_for(timeout=SLOW)
        paste_document(a, "doc-of-a", short_text(150, 7))
        a.get_by_role("button", name="Run capture").click()
        wait_for_app(a)
        a.get_by_test_id("stSidebarNav").get_by_text("Heatmap", exact=True).click()
        wait_for_app(a)
        _wait_jobs_done(cache)

        b.goto(base + "/")
        wait_for_app(b)
        b.get_by_text("Heads per GDN layer").wait_for(timeout=SLOW)
        paste_document(b, "doc-of-b", short_text(160, 11))
        b.get_by_role("button", name="Run capture").click()
        b.get_by_text("Captured 1 document").wait_for(timeout=SLOW)
        runs = Store(cache).list_runs()
        run_b = runs[0]["run_id"]
        assert [d["name"] for d in runs[0]["documents"]] == ["doc-of-b"]
        run_a = next(r["run_id"] for r in runs if [d["name"] for d in r["documents"]] == ["doc-of-a"])

        a.get_by_test_id("stSidebarNav").get_by_text("Heatmap", exact=True).click()  # A's next rerun
        wait_for_app(a)
        a.get_by_test_id("stVegaLiteChart").first.wait_for()
        assert a.get_by_text(run_a).count() >= 1 and a.get_by_text(run_b).count() == 0
        with a.expect_download(timeout=120_000) as d:
            a.get_by_role("button", name="Download this run (zip)").click()
        path = tmp_path / "a.zip"
        d.value.save_as(path)
        assert d.value.suggested_filename == f"gdnviz-{run_a}.zip"
        settings = json.loads(zipfile.ZipFile(io.BytesIO(path.read_bytes())).read("settings.json"))
        assert settings["run_id"] == run_a and [x["name"] for x in settings["documents"]] == ["doc-of-a"]

        c.goto(base + "/heatmap")
        wait_for_app(c)
        c.get_by_text("No run chosen in this session.").wait_for()
        assert c.get_by_role("button", name="Download this run (zip)").count() == 0
        assert c.get_by_test_id("stVegaLiteChart").count() == 0
        assert c.get_by_text(run_a).count() == 0 and c.get_by_text(run_b).count() == 0
    finally:
        for x in ctxs:
            x.close()


def test_a_killed_idle_worker_is_noticed_without_a_click(server, page):
    """kill -9 the idle worker: within seconds, with nobody clicking, the sidebar stops showing its pid as alive
    (the server restarts it and says so)."""
    import signal

    from gdnviz.store import Store

    base, cache = server
    page.goto(base + "/")
    wait_for_app(page)
    page.get_by_text("Worker idle · pid", exact=False).wait_for(timeout=SLOW)
    pid = int(re.search(r"pid (\d+)", page.get_by_text("Worker idle · pid", exact=False).inner_text()).group(1))
    assert pid in [h["pid"] for h in Store(cache).live_workers()]
    os.kill(pid, signal.SIGKILL)
    page.get_by_text("restarted 1×", exact=False).wait_for(timeout=20_000)
    assert page.get_by_text(f"pid {pid}", exact=False).count() == 0
