"""Regenerate the app screenshots in this folder: a real ``streamlit run app.py`` in headless Chromium.

    .venv/bin/python docs/screenshots/make_screenshots.py [--model DIR_OR_demo] [--out docs/screenshots]

Without ``--model`` it builds a small random Qwen3.5-architecture checkpoint (9 GDN layers x 8 heads of 32x32,
decays spread from a few tokens to thousands, the tests' byte-level BPE tokenizer) in a temporary folder: the
pictures then show the app, not a trained model's science. Pass ``--model demo`` once the bundled demo model is
installed. ``--only compare`` captures two pairs of sample documents and shoots only the Compare two runs page;
``--only heatmap`` captures the four documents and shoots only the Heatmap page: ``heatmap.png`` (the README's
picture), then ``heatmap_panel.png`` (after a click on the cell of ``--head``: that head in the panel under the
heatmap);
``--only overview`` captures them and shoots only the Overview figures: ``overview.png``, then
``overview_panel.png`` (after a click on the point of ``--head``: the head panel under the figures);
``--only head`` captures them and shoots only the Head page: ``head.png`` (its first tab of figures), then
``head_holds.png`` (What this state holds, computed at the document end), ``head_attnmap.png`` (the Exact
attention map at its default window, query t = 1,838) and ``head_attnmap_zoom.png`` (the lower end of its key zoom
moved about 612 keys up; the slider and the maps' subtitles say where it landed), the
pictures of docs/attribution.md. Those three are cut to their section of the page.
Each PNG is palette-quantised to stay a few hundred KB.
"""
from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


def build_model(root: Path) -> Path:
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    import tokenizers_for_tests

    out = root / "screenshot-qwen3_5"
    _, chat = tokenizers_for_tests.build(root / "tok")
    tok = tokenizers_for_tests.load(chat)
    torch.manual_seed(0)
    layers = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 3
    cfg = Qwen3_5TextConfig(
        vocab_size=len(tok) + 16, hidden_size=128, intermediate_size=256, num_hidden_layers=len(layers),
        layer_types=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
        max_position_embeddings=8192, tie_word_embeddings=True)
    m = Qwen3_5ForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in m.model.layers:
            la = getattr(layer, "linear_attn", None)
            if la is not None:  # per-token decays from ~0.3 to ~0.9999: horizons from 1 to thousands of tokens
                n = la.A_log.numel()
                la.A_log.copy_(torch.empty(n).uniform_(-9.0, 0.5, generator=g))
                la.dt_bias.copy_(torch.randn(n, generator=g) * 0.5 - 1.0)
    m.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shrink(path: Path) -> None:
    from PIL import Image

    im = Image.open(path).convert("RGB")
    # octree, not median cut: median cut gives the rare colours of a colour legend a handful of bands
    im.quantize(colors=256, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE).save(path, optimize=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=str(ROOT / "docs" / "screenshots"))
    ap.add_argument("--head", default=None,
                    help="LAYER,HEAD for the Head page and the Heatmap's panel (default 5,1 with --model demo: its "
                         "longest-lived head; else 4,3)")
    ap.add_argument("--only", choices=["sweeps", "compare", "heatmap", "head", "overview"], default=None,
                    help="only the Retrieval sweeps page (no capture; a tiny sweep on the inspected model), only "
                         "Compare two runs (two captures of the model, two sample documents each), or only the "
                         "Heatmap (after the four documents' capture), or only the Head page and its two computed "
                         "sections, or only the Overview figures (and its head panel)")
    args = ap.parse_args()
    args.head = [int(x) for x in (args.head or ("5,1" if args.model == "demo" else "4,3")).split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="gdnviz-shots-"))
    model = args.model or str(build_model(tmp))
    port = free_port()
    env = dict(os.environ, GDNVIZ_DEFAULT_MODEL=model, GDNVIZ_CACHE_DIR=str(tmp / "cache"), PYTHONPATH=str(ROOT))
    server = subprocess.Popen([sys.executable, "-m", "streamlit", "run", "app.py", "--server.port", str(port),
                               "--server.address", "127.0.0.1", "--server.headless", "true"], cwd=str(ROOT),
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                if urllib.request.urlopen(base + "/_stcore/health", timeout=2).read() == b"ok":
                    break
            except OSError:
                time.sleep(0.5)
        from playwright.sync_api import sync_playwright

        with sync_playwright() as pw:
            b = pw.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
            page = b.new_page(viewport={"width": 1440, "height": 1000})
            page.set_default_timeout(600_000)

            def idle():
                page.wait_for_selector("[data-testid='stApp'][data-test-script-state='notRunning']")
                time.sleep(2.5)

            def open_run_page(path: str):  # a page load is a new session: it picks the stored run in the sidebar
                page.goto(base + path)
                idle()
                if page.get_by_text("No run chosen in this session.").count():
                    page.get_by_test_id("stSidebar").get_by_test_id("stSelectbox").click()
                    page.get_by_role("option").first.click()
                    page.mouse.move(1400, 50)  # no tooltip of the sidebar's buttons in the picture
                    idle()

            def shot(name: str, height: int):
                page.set_viewport_size({"width": 1440, "height": height})
                idle()
                p = out / f"{name}.png"
                page.screenshot(path=str(p))
                shrink(p)
                print(f"{p}: {p.stat().st_size // 1024} KB")

            def clip_shot(name: str, top, bottom):  # the main column from locator top's top to bottom's top
                t, b = top.bounding_box(timeout=60_000), bottom.bounding_box(timeout=60_000)
                m = page.get_by_test_id("stMainBlockContainer").bounding_box()
                x0, x1 = max(0, t["x"] - 12), min(m["x"] + m["width"], t["x"] + t["width"] + 12)
                p = out / f"{name}.png"
                page.screenshot(path=str(p), clip=dict(x=x0, y=max(0, t["y"] - 12), width=x1 - x0,
                                                       height=b["y"] - t["y"]))
                shrink(p)
                print(f"{p}: {p.stat().st_size // 1024} KB")

            def head_sections():  # What this state holds and the Exact attention map, computed in the worker
                main = page.get_by_test_id("stMain")
                page.set_viewport_size({"width": 1440, "height": 7000})  # the whole page in view: clips by boxes
                idle()
                page.locator(".st-key-holds_compute button").click()
                main.get_by_text("Tokens contributing most").wait_for(timeout=1_800_000)
                idle()
                page.locator(".st-key-am_compute button").click()
                main.get_by_text("GDN map: top keys").wait_for(timeout=1_800_000)
                idle()
                q = page.locator("input[aria-label='Query position t (or click a row of a map)']")
                q.fill("1838")
                q.press("Enter")
                main.get_by_text("Query t = 1,838").wait_for(timeout=60_000)
                page.mouse.move(1400, 5)  # no chart toolbar or tooltip in the picture
                idle()
                holds_h = main.locator("h4", has_text="What this state holds")
                am_h = main.locator("h4", has_text="Exact attention map")
                clip_shot("head_holds", holds_h, am_h)
                clip_shot("head_attnmap", main.get_by_test_id("stCaptionContainer").filter(has_text="over keys 0.."),
                          main.get_by_test_id("stPageLink"))
                q.blur()
                thumb = main.get_by_test_id("stSlider").get_by_role("slider").first  # the zoom's lower end
                thumb.focus(timeout=30_000)
                for _ in range(612 // 4):  # towards keys 612..2,047 (a step is 4 keys); a rerun can swallow a few
                    page.keyboard.press("ArrowRight")
                page.mouse.move(1400, 5)
                idle()
                print(f"zoom: keys {thumb.input_value()}..2047")  # the slider and the subtitles say it too
                clip_shot("head_attnmap_zoom", am_h, page.locator(".st-key-ch_am_gdn_png"))

            def overview():  # the page, then a click on the point of --head: that head in the panel under the figures
                open_run_page("/overview")
                shot("overview", 1250)
                layer, head = args.head
                page.get_by_test_id("stVegaLiteChart").filter(has_text="Effective rank vs decay horizon").locator(
                    f"path[aria-label*='; layer: {layer}; head: {head};']").click(force=True)  # a point over it wins
                page.locator(".st-key-head_panel_box").get_by_role("heading").first.wait_for()
                page.mouse.move(1400, 50)
                shot("overview_panel", 2000)

            def sweeps():  # a small sweep: two tasks, two lengths, seed 000's ranks up to d_k, 2 samples each
                page.goto(base + "/sweeps")
                idle()
                for label, value in (("Target lengths (tokens, comma-separated)", "1024, 2048"), ("Samples n", "2"),
                                     ("Batch size", "4")):
                    page.locator(f"input[aria-label='{label}']").fill(value)
                    page.keyboard.press("Enter")
                    idle()
                page.get_by_text("More settings").click()
                page.locator("input[aria-label=\"New tokens (0 = each task's own)\"]").fill("0")
                page.keyboard.press("Enter")
                idle()
                page.get_by_role("button", name="Run the sweep").click()
                page.get_by_text("Score per task, length and r").wait_for(timeout=1_800_000)
                shot("sweeps", 1900)

            def compare(n_runs: int):  # n_runs more captures (two samples each) through the server's worker
                from gdnviz import jobs
                from gdnviz.documents import sample_documents
                from gdnviz.store import Store

                store = Store(tmp / "cache")
                docs = sample_documents()
                for i in range(n_runs):
                    pair = tuple((d.name, d.text) for d in docs[2 * i:2 * i + 2])
                    jid = store.submit("capture", jobs.spec_to_dict(jobs.CaptureJob(model=model, documents=pair)))
                    rec = store.wait(jid, timeout=1800)
                    assert rec["status"] == "done", rec.get("error")
                page.goto(base + "/compare")
                idle()
                sel = page.get_by_test_id("stMain").get_by_test_id("stSelectbox")
                for i, option in ((0, 1), (1, 0)):  # A: the older run, B: the newest
                    sel.nth(i).click()
                    page.get_by_role("option").nth(option).click()
                    idle()
                page.mouse.move(1400, 50)
                shot("compare", 2100)

            page.goto(base + "/")
            page.get_by_text("Heads per GDN layer").wait_for()
            if args.only == "compare":
                compare(2)
                b.close()
                return 0
            if args.only == "sweeps":
                sweeps()
                b.close()
                return 0
            for title in ("Declaration", "Genesis", "Lincoln", "Notes on a fixed-size memory"):
                page.get_by_test_id("stMultiSelect").first.locator("input").click()
                page.get_by_role("option", name=re.compile(title)).click()
                page.keyboard.press("Escape")
                idle()
            if args.only is None:
                shot("documents", 1500)
            page.get_by_role("button", name="Run capture").click()
            page.get_by_text("Captured 4 document").wait_for()
            if args.only == "overview":
                overview()
                b.close()
                return 0
            if args.only != "head":
                open_run_page("/heatmap")
                shot("heatmap", 1000)
                layer, head = args.head
                page.get_by_test_id("stVegaLiteChart").first.locator(
                    f"path[aria-label^='value head: {head}; layer (model index): {layer};']").click()
                page.locator(".st-key-head_panel_box").get_by_role("heading", name=f"Layer {layer} · head {head}").wait_for()
                page.mouse.move(1400, 50)  # no tooltip of the heatmap in the picture
                shot("heatmap_panel", 1600)
            if args.only == "heatmap":
                b.close()
                return 0
            open_run_page(f"/head?layer={args.head[0]}&head={args.head[1]}")
            shot("head", 1900)
            head_sections()
            if args.only == "head":
                b.close()
                return 0
            overview()
            open_run_page("/truncate")
            page.locator("input[aria-label='Target length (tokens)']").fill("1500")
            page.keyboard.press("Enter")
            idle()
            page.locator("input[aria-label=\"New tokens (0 = the task's own)\"]").fill("16")
            page.keyboard.press("Enter")
            idle()
            page.get_by_role("button", name="Run untouched and truncated").click()
            page.get_by_text("Untouched model", exact=True).wait_for()
            shot("truncate", 2000)
            sweeps()
            page.goto(base + "/budget")
            shot("budget", 1150)
            compare(1)
            b.close()
    finally:
        server.terminate()
        server.wait(30)
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
