"""How fast the app answers a click on results already computed, in headless Debian Chromium against a real
``streamlit run app.py``: the bundled demo model (12 GDN heads) and an untrained 288-head checkpoint (24 GDN layers ×
12 heads, ``app_fixtures.build_checkpoint(many_heads=True)``), three documents each, captured before the server
starts.

Each time is measured in the page, from the click event (a capture-phase listener on ``document``) to the element
being present (polled every animation frame; a chart counts once it shows the click's own content, e.g. the new
statistic's title, or is a chart drawn after the click): "useful" = the first thing that answers the click (the
head's title in the heatmap's panel or on the Head page, the new truncation set, the redrawn heatmap), "whole" =
every chart of the page drawn (the heatmap and its panel's spectrum; on the Head page: the charts of its open tab), no
stale element and the script finished. A heatmap click shows its head in the panel under the heatmap; the Head page
is timed from the panel's link "Open the full head page", the Overview from a click on a point of its scatter (open
mode) to that head's panel, and the sidebar's *Previous runs* picker from picking the other run to its id and its
heatmap. Medians of several clicks are printed and written to
``<tmp>/ui_speed.json``; they are reported, never asserted (docs/ui-speed.md has the numbers). What is asserted is
that each click did what it says.
"""
from __future__ import annotations

import json
import re
import statistics

import pytest

from app_fixtures import build_checkpoint, short_text
from gdnviz.figures import HEATMAP_METRICS
from test_browser import _CLEAR_POINTS, SLOW, pick_run, streamlit_server, wait_for_app

pytestmark = pytest.mark.browser
REPEATS = 5
CLICK_CLOCK = """
window.__t0 = null;
document.addEventListener('click', () => { window.__t0 = performance.now(); }, true);
"""
# charts of the click's run: the script finished, nothing stale, at least ``n`` charts, each drawn by vega-embed, and
# the text ``text`` (case-insensitive) in one of them. The text tells the click's charts from those of the run
# before it, which are on the page, finished and not stale until the click's run has started.
CHARTS_DRAWN = """([n, text]) => {
  const app = document.querySelector("[data-testid='stApp']");
  if (!app || app.getAttribute('data-test-script-state') !== 'notRunning') return false;
  if (document.querySelector("[data-testid='stMain'] [data-stale='true']")) return false;
  const cs = [...document.querySelectorAll("[data-testid='stMain'] [data-testid='stVegaLiteChart']")];
  if (cs.length < n || !cs.every(c => c.querySelector('svg.marks, canvas.marks'))) return false;
  return cs.some(c => c.textContent.toLowerCase().includes(text.toLowerCase()));
}"""
HEATMAP_HINT = "click a cell to see that head below"  # the heatmap's subtitle (not on the Head page)
# the Head page's tabs of figures: a head opens on the first (its spectrum and effective rank, two charts)
TAB_1, TAB_2, HEAD_CHARTS = "Spectrum & effective rank", "Decay α & key cone", 2
SPECTRUM, ALPHA = "Singular spectrum at the document end", "Per-token decay α of this head"  # the tabs' first charts


# the heatmap's head panel of ``title`` and its spectrum drawn: the page's charts as CHARTS_DRAWN, and the panel's
# chart drawn after the click: a new node (vega-embed draws another spec into a new one; ``_arm`` marks those on the
# page before the click) or the node of before, changed after the click (a spec that differs only in its data is
# redrawn in place; ``_arm`` watches the panel for that)
PANEL_DRAWN = """([title, n, text]) => {
  const hs = [...document.querySelectorAll("[data-testid='stMain'] .st-key-head_panel_box h3")];
  if (!hs.some(h => !h.closest("[data-stale='true']") && h.textContent.trim().startsWith(title))) return false;
  if (!(%s)([n, text])) return false;
  const m = document.querySelector(".st-key-head_panel_box [data-testid='stVegaLiteChart'] .marks");
  return !!m && (!m.__before_click || window.__panel_redrawn);
}""" % CHARTS_DRAWN
ARM = """() => {
  window.__t0 = null;
  window.__panel_redrawn = false;
  document.querySelectorAll('.marks').forEach(m => { m.__before_click = true; });
  if (window.__panel_watch) window.__panel_watch.disconnect();
  const box = document.querySelector('.st-key-head_panel_box');
  if (!box) return;
  window.__panel_watch = new MutationObserver(rs => {
    if (rs.some(r => r.target.closest && r.target.closest('.marks'))) window.__panel_redrawn = true;
  });
  window.__panel_watch.observe(box, {subtree: true, childList: true, attributes: true, characterData: true});
}"""
PANEL_CHARTS = 2  # the heatmap and the panel's spectrum


def _since_click(page, predicate: str, arg=None, timeout: float = 60_000) -> float:
    """ms from the last click to ``predicate(arg)`` being true (checked every animation frame)."""
    js = f"""(arg) => {{ if (window.__t0 === null) return false; const ok = ({predicate})(arg);
                        return ok ? Math.max(performance.now() - window.__t0, 0.001) : false; }}"""
    return float(page.wait_for_function(js, arg=arg, polling="raf", timeout=timeout).json_value())


def _arm(page) -> None:
    page.evaluate(ARM)


def _heading(text: str, panel: bool = False) -> str:
    """A predicate: an h3 starting with ``text``, not stale, in the heatmap's head panel (``panel``) or outside it
    (the Head page's)."""
    where = "" if panel else "!"
    return ("() => [...document.querySelectorAll(\"[data-testid='stMain'] h3\")].some(h => "
            "!h.closest(\"[data-stale='true']\") && " + where + "h.closest('.st-key-head_panel_box') && "
            "h.textContent.trim().startsWith(" + json.dumps(text) + "))")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A server (default model: the demo) whose store holds a demo run and a 288-head run, three documents each."""
    from gdnviz import jobs
    from gdnviz.store import Store
    from gdnviz.worker import Worker

    root = tmp_path_factory.mktemp("ui_speed")
    cache = root / "cache"
    store = Store(cache)
    docs = tuple((f"doc{i}", short_text(300, i)) for i in range(3))
    many = build_checkpoint(root / "ck", many_heads=True)
    runs = {}
    for name, model in (("demo", "demo"), ("288 heads", str(many))):
        jid = store.submit("capture", jobs.spec_to_dict(jobs.CaptureJob(model=model, documents=docs,
                                                                         segment_len=256)))
        Worker(store).run_pending()
        rec = store.job(jid)
        assert rec["status"] == "done", rec.get("error")
        runs[name] = store.run(rec["result"]["run_id"])
    with streamlit_server(cache, "demo") as base:
        yield base, runs, root


@pytest.fixture(scope="module")
def browser():
    from test_browser import ARGS, CHROMIUM
    from playwright.sync_api import sync_playwright

    pw = sync_playwright().start()
    b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
    yield b
    b.close()
    pw.stop()


def _open_run(browser, base: str, run: dict, path: str = "/heatmap"):
    ctx = browser.new_context(viewport={"width": 1400, "height": 1600})
    page = ctx.new_page()
    page.set_default_timeout(60_000)
    page.add_init_script(CLICK_CLOCK)
    page.goto(base + path)
    wait_for_app(page, SLOW)
    page.get_by_test_id("stSidebar").get_by_test_id("stSelectbox").click()
    page.get_by_role("option").filter(has_text=re.compile(re.escape(
        str(run["model_name"]).rstrip("/").split("/")[-1]))).first.click()
    # the pick's rerun may not have started when wait_for_app looks: wait for the run's id itself (TimeoutError if
    # it never shows), then for the rerun to finish
    page.get_by_text(run["run_id"]).first.wait_for(state="attached", timeout=60_000)
    wait_for_app(page)
    page.mouse.move(1300, 1500)
    return ctx, page


def _cell(page, layer: int, head: int):
    return page.get_by_test_id("stVegaLiteChart").first.locator(
        f"path[aria-label^='value head: {head}; layer (model index): {layer};']")


def _measure(browser, base: str, run: dict) -> dict:
    gl, H = list(run["model"]["gdn_layers"]), int(run["model"]["num_heads"])
    grid = [(layer, head) for layer in gl for head in range(H)]
    heads = [grid[(7 * i + 1) % len(grid)] for i in range(REPEATS)]  # distinct heads (7 is prime to 12 and 288)
    assert len(set(heads)) == REPEATS
    out: dict[str, list[float]] = {}

    def rec(k, v):
        out.setdefault(k, []).append(round(v, 1))

    ctx, page = _open_run(browser, base, run)
    try:
        for visit in ("first", "again"):
            for layer, head in heads:
                title = f"Layer {layer} · head {head}"
                cell = _cell(page, layer, head)
                cell.wait_for()
                _arm(page)
                cell.click()
                rec(f"heatmap cell → panel title ({visit} visit)", _since_click(page, _heading(title, panel=True)))
                rec(f"heatmap cell → whole panel ({visit} visit)",
                    _since_click(page, PANEL_DRAWN, [title, PANEL_CHARTS, SPECTRUM]))
                assert page.url.endswith(f"/heatmap?layer={layer}&head={head}")
                # the panel's link to the Head page
                _arm(page)
                page.get_by_role("link", name="Open the full head page").click()
                rec(f"panel link → head page title ({visit} visit)", _since_click(page, _heading(title)))
                rec(f"panel link → whole head page ({visit} visit)",
                    _since_click(page, CHARTS_DRAWN, [HEAD_CHARTS, "Effective rank along the document"]))
                assert page.url.endswith(f"/head?layer={layer}&head={head}")
                # another tab of figures, then back to the first (where the next head opens)
                for tab, n, text in ((TAB_2, 2, ALPHA), (TAB_1, HEAD_CHARTS, SPECTRUM)):
                    _arm(page)
                    page.get_by_role("tab", name=tab).click()
                    rec(f"head page tab “{tab}” → drawn" + (f" ({visit} visit)" if tab == TAB_2 else ""),
                        _since_click(page, CHARTS_DRAWN, [n, text]))
                _arm(page)
                page.get_by_role("link", name="Back to the heatmap").click()
                rec("head page → heatmap and its panel drawn",
                    _since_click(page, CHARTS_DRAWN, [PANEL_CHARTS, HEATMAP_HINT]))
        # the head page's layer select
        _cell(page, *heads[0]).click()
        wait_for_app(page)
        page.get_by_role("link", name="Open the full head page").click()
        wait_for_app(page)
        for i in range(REPEATS):
            layer = gl[(i + 2) % len(gl)] if gl[(i + 2) % len(gl)] != heads[0][0] else gl[(i + 3) % len(gl)]
            page.get_by_test_id("stSelectbox").filter(has_text="Layer").first.click()
            _arm(page)
            page.get_by_role("option", name=str(layer), exact=True).click()
            rec("head page layer select → head title", _since_click(page, _heading(f"Layer {layer} · head")))
            rec("head page layer select → whole page", _since_click(page, CHARTS_DRAWN, [HEAD_CHARTS, SPECTRUM]))
            heads[0] = (layer, heads[0][1])
        page.get_by_role("link", name="Back to the heatmap").click()
        wait_for_app(page)
        # the statistic and pick mode
        for label, m in list({"horizon": "horizon", "stable rank": "stable_rank", "effective rank": "erank",
                              "numerical rank": "numerical_rank", "key-cone norm": "mean_key_norm"}.items())[:REPEATS]:
            _arm(page)
            page.get_by_text(label, exact=True).click()
            rec("heatmap statistic → heatmap drawn", _since_click(page, CHARTS_DRAWN, [1, HEATMAP_METRICS[m][0]]))
        page.get_by_text("adds / removes it in the truncation set", exact=True).click()
        wait_for_app(page)
        for i, (layer, head) in enumerate(heads):
            _arm(page)
            _cell(page, layer, head).click()
            rec("pick-mode click → truncation set shown", _since_click(
                page, "(n) => [...document.querySelectorAll(\"[data-testid='stMain'] p\")].some(p => "
                      "p.textContent.startsWith('Truncation set (' + n + ' head'))", i + 1))
            wait_for_app(page)
        # the set's buttons show their whole label (no element of the link clips its text)
        link = page.get_by_role("link", name="Truncate these heads")
        assert link.evaluate("a => [a, ...a.querySelectorAll('*')].every(e => e.scrollWidth <= e.clientWidth + 1)")
    finally:
        ctx.close()
    return {k: dict(median_ms=statistics.median(v), all_ms=v) for k, v in out.items()}


# the heatmap of a run with ``n`` cells drawn: the page's charts as CHARTS_DRAWN, its first chart with exactly ``n``
# cells (the runs of this module have 12 and 288 heads, so the count tells the new run's heatmap from the old one's)
HEATMAP_OF = """([n, text]) => {
  if (!(%s)([1, text])) return false;
  const c = document.querySelector("[data-testid='stMain'] [data-testid='stVegaLiteChart']");
  return c.querySelectorAll("path[aria-label^='value head: ']").length === n;
}""" % CHARTS_DRAWN


def _measure_run_switch(browser, base: str, runs: dict) -> dict:
    """The sidebar's *Previous runs* picker on the Heatmap, back and forth between the two runs: to the picked
    run's id on the page (useful) and to its heatmap drawn (whole)."""
    order = list(runs.values())
    ctx, page = _open_run(browser, base, order[0])
    out: dict[str, list[float]] = {}
    try:
        for i in range(2 * REPEATS):
            run = order[(i + 1) % 2]
            name = str(run["model_name"]).rstrip("/").split("/")[-1]
            page.get_by_test_id("stSidebar").get_by_test_id("stSelectbox").click()
            _arm(page)
            page.get_by_role("option").filter(has_text=re.compile(re.escape(name))).first.click()
            rid = json.dumps(run["run_id"])
            out.setdefault("previous run → its id shown", []).append(round(_since_click(
                page, "() => [...document.querySelectorAll(\"[data-testid='stMain'] *\")].some(e => "
                      "!e.closest(\"[data-stale='true']\") && e.children.length === 0 && e.textContent.includes("
                      + rid + "))"), 1))
            cells = len(run["model"]["gdn_layers"]) * int(run["model"]["num_heads"])
            out.setdefault("previous run → its heatmap drawn", []).append(round(_since_click(
                page, HEATMAP_OF, [cells, HEATMAP_HINT]), 1))
            wait_for_app(page)
            page.mouse.move(1300, 1500)
    finally:
        ctx.close()
    return {k: dict(median_ms=statistics.median(v), all_ms=v) for k, v in out.items()}


def _measure_overview(browser, base: str, run: dict) -> dict:
    """The Overview's erank-vs-horizon scatter in open mode: a click on a point (points no other mark covers, in
    turn) to the head's title in the panel under the figures (useful) and to the panel's spectrum drawn (whole)."""
    ctx, page = _open_run(browser, base, run, "/overview")
    out: dict[str, list[float]] = {}
    try:
        chart = page.get_by_test_id("stVegaLiteChart").filter(has_text="Effective rank vs decay horizon")
        points = chart.locator("path[aria-label^='horizon: ']")
        points.first.wait_for()
        chart.scroll_into_view_if_needed()
        page.get_by_text("shows it below these figures", exact=True).click()
        wait_for_app(page)
        last = None
        for k in range(REPEATS):
            # the points no other mark covers, read again before each click (the open head's ring is redrawn)
            chart.scroll_into_view_if_needed()
            clear = [(i, tuple(int(v) for v in re.search(r"; layer: (\d+); head: (\d+);", label).groups()))
                     for i, label in points.evaluate_all(_CLEAR_POINTS)]
            clear = [c for c in clear if c[1] != last]
            assert clear, "no point of the scatter is clear of other marks"
            i, (layer, head) = clear[(k * 5) % len(clear)]
            title = f"Layer {layer} · head {head}"
            _arm(page)
            points.nth(i).click()
            out.setdefault("overview point → panel title", []).append(
                round(_since_click(page, _heading(title, panel=True)), 1))
            out.setdefault("overview point → whole panel", []).append(round(_since_click(
                page, PANEL_DRAWN, [title, 1, SPECTRUM]), 1))
            assert page.url.endswith(f"/overview?layer={layer}&head={head}")
            last = (layer, head)
            wait_for_app(page)
    finally:
        ctx.close()
    return {k: dict(median_ms=statistics.median(v), all_ms=v) for k, v in out.items()}


def test_click_to_screen_times(served, browser):
    base, runs, root = served
    res = {name: dict(run_id=run["run_id"], heads=len(run["model"]["gdn_layers"]) * int(run["model"]["num_heads"]),
                      times={**_measure(browser, base, run), **_measure_overview(browser, base, run)})
           for name, run in runs.items()}
    res["both runs"] = dict(run_id=" / ".join(r["run_id"] for r in runs.values()), heads=" / ".join(str(len(r["model"]["gdn_layers"]) * int(r["model"]["num_heads"]))
                                                                   for r in runs.values()),
                            times=_measure_run_switch(browser, base, runs))
    (root / "ui_speed.json").write_text(json.dumps(res, indent=2))
    print(f"\nclick → screen, median of {REPEATS} (ms); all times in {root / 'ui_speed.json'}")
    for name, r in res.items():
        print(f"  {name} ({r['heads']} heads, {r['run_id']}):")
        for k, v in r["times"].items():
            print(f"    {k:55s} {v['median_ms']:8.0f}")
