"""Settings that survive leaving a page (Head page's state and attention-map sections, Cache budget's per-model
fields, Compare's picks), the export size in the run zip, redraw.py's layer colours, and the Compare page's
downloads: a CSV per table and the whole comparison as one zip (``gdnviz.compare.comparison_zip``)."""
from __future__ import annotations

import ast
import io
import json
import re
import struct
import subprocess
import sys
import zipfile

import numpy as np
import pandas as pd
import pytest

from app_fixtures import tiny_checkpoint  # noqa: F401  (fixture)
from test_app_pages import ROOT, app, env, populated, texts, three_runs, work  # noqa: F401  (fixtures)
from gdnviz import jobs
from gdnviz.store import Store


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def _svg_size(svg: str) -> tuple[float, float]:
    m = re.match(r'<svg [^>]*?width="([\d.]+)" height="([\d.]+)"', svg)
    assert m, svg[:200]
    return float(m[1]), float(m[2])


def _away_and_back(at, page: str) -> None:
    at.switch_page("pages/heatmap.py").run()
    at.switch_page(f"pages/{page}.py").run()
    assert not at.exception, [e.proto for e in at.exception]


# =============================================================================================================
# settings survive leaving a page
# =============================================================================================================
def test_head_page_state_and_attention_map_settings_survive_leaving_the_page(env, populated):
    cache, run = populated
    env(cache)
    at = app("head", run=run, layer=3, head=1)
    at.run()
    assert not at.exception
    at.selectbox(key="holds_doc").set_value("beta")
    at.number_input(key="holds_pos").set_value(128)
    at.number_input(key="holds_top").set_value(6)
    at.selectbox(key="am_doc").set_value("beta").run()  # a new document resets the window: pick it first
    at.number_input(key="am_start").set_value(64)
    at.number_input(key="am_end").set_value(192)
    at.selectbox(key="am_attn_layer").set_value(2).run()
    at.selectbox(key="am_attn_head").set_value(1).run()
    assert not at.exception
    _away_and_back(at, "head")
    assert at.selectbox(key="holds_doc").value == "beta"
    assert (at.number_input(key="holds_pos").value, at.number_input(key="holds_top").value) == (128, 6)
    assert at.selectbox(key="am_doc").value == "beta"
    assert (at.number_input(key="am_start").value, at.number_input(key="am_end").value) == (64, 192)
    assert (at.selectbox(key="am_attn_layer").value, at.selectbox(key="am_attn_head").value) == (2, 1)
    assert any("Not computed yet" in i and "after 128 of" in i for i in texts(at, "info"))


def test_cache_budget_model_fields_survive_leaving_the_page(env, populated):
    cache, run = populated
    env(cache)
    at = app("budget", run=run)
    at.run()
    fp = run["model"]["fingerprint"]
    hv = at.number_input(key=f"bud_hv_{fp}")
    assert hv.value == run["model"]["num_heads"]
    hv.set_value(7)
    at.number_input(key=f"bud_dk_{fp}").set_value(32).run()
    rec = {m.label: m.value for m in at.metric}["Recurrent state"]
    _away_and_back(at, "budget")
    assert (at.number_input(key=f"bud_hv_{fp}").value, at.number_input(key=f"bud_dk_{fp}").value) == (7, 32)
    assert {m.label: m.value for m in at.metric}["Recurrent state"] == rec


@pytest.fixture(scope="module")
def two_sweeps(three_runs, tiny_checkpoint):
    """Two finished sweeps in ``three_runs``' cache: the tiny model and the demo model, the same task, length, r."""
    cache = three_runs[0]
    store = Store(cache)
    ids = []
    for model in (str(tiny_checkpoint), str(ROOT / "gdnviz" / "assets" / "demo")):
        ids.append(store.submit("sweep", jobs.spec_to_dict(jobs.SweepJob(
            model=model, tasks=("niah_single_1",), lengths=(300,), ranks=(2,), n=1, max_new_tokens=4,
            segment_len=64))))
        work(cache)
        assert store.job(ids[-1])["status"] == "done", store.job(ids[-1])["error"]
    return ids


def test_compare_picks_survive_leaving_the_page_and_a_run_gone_from_the_store_is_unpicked(env, three_runs,
                                                                                         two_sweeps):
    cache, a, b, _ = three_runs
    env(cache)
    at = app("compare", run=a)
    at.run()
    at.selectbox(key="cmp_b").set_value(b["run_id"]).run()
    at.radio(key="cmp_metric").set_value("horizon")
    at.selectbox(key="cmp_sw_a").set_value(two_sweeps[0])
    at.selectbox(key="cmp_sw_b").set_value(two_sweeps[1]).run()
    assert not at.exception
    _away_and_back(at, "compare")
    assert (at.selectbox(key="cmp_a").value, at.selectbox(key="cmp_b").value) == (a["run_id"], b["run_id"])
    assert at.radio(key="cmp_metric").value == "horizon"
    assert (at.selectbox(key="cmp_sw_a").value, at.selectbox(key="cmp_sw_b").value) == tuple(two_sweeps)
    # every table has its CSV, the whole comparison its zip
    keys = {x.key: x.proto.label for x in at.get("download_button")}
    assert keys["cmp_zip"] == "Download this comparison (zip)"
    assert keys["cmp_sw_a_csv"] == keys["cmp_sw_b_csv"] == keys["cmp_sw_csv"] == "CSV"
    # B deleted from the store: no longer a valid choice, so picked no more
    store = Store(cache)
    store.delete_run(b["run_id"])
    try:
        at.run()
    finally:
        store.add_run(b)
    assert not at.exception
    assert at.session_state["cmp_b"] is None and any("Pick two runs" in i for i in texts(at, "info"))


# =============================================================================================================
# exports
# =============================================================================================================
def test_comparison_zip_holds_every_figure_at_the_export_size_and_the_tables(env, three_runs, two_sweeps):
    from gdnviz import compare as K
    from gdnviz import figures as F
    from gdnviz.probes import sweep
    from gdnviz.summary import document_set_table, overview

    cache, a, b, _ = three_runs
    store = Store(cache)
    ta, tb = (document_set_table(jobs.load_run_captures(store, r)) for r in (a, b))
    ov = tuple(overview(t, int(r["segment_len"])) for t, r in ((ta, a), (tb, b)))
    sa, sb = (sweep.table_frame(store.job(j)["result"]["table"]) for j in two_sweeps)
    ex = dict(scale=1.0, width=600, height=420)
    data = K.comparison_zip((a, b), (ta, tb), ov, "erank", ((two_sweeps[0], sa), (two_sweeps[1], sb)), **ex)
    z = zipfile.ZipFile(io.BytesIO(data))
    names = ["compare_A_erank", "compare_B_erank", "compare_diff_erank", "compare_erank_vs_horizon"]
    assert set(z.namelist()) == {"settings.json"} | {f"figures/{n}.{x}" for n in names for x in ("png", "svg")} | \
        {f"data/{n}.csv" for n in names} | {f"tables/compare_sweep_{t}.csv" for t in ("A", "B", "B_minus_A")}

    def csv(name):
        return pd.read_csv(io.BytesIO(z.read(name)))

    want = tb.set_index(["layer", "head"])["erank"] - ta.set_index(["layer", "head"])["erank"]
    got = csv("data/compare_diff_erank.csv").set_index(["layer", "head"])["value"]
    assert np.allclose(got.sort_index().to_numpy(), want.sort_index().to_numpy())
    pd.testing.assert_frame_equal(csv("tables/compare_sweep_A.csv"), sa.reset_index(drop=True), check_dtype=False)
    pd.testing.assert_frame_equal(csv("tables/compare_sweep_B.csv"), sb.reset_index(drop=True), check_dtype=False)
    diff = csv("tables/compare_sweep_B_minus_A.csv")
    assert diff["r"].tolist() == [2] and np.allclose(diff["delta"], diff["score_b"] - diff["score_a"])
    assert np.allclose(diff["delta"], sb.set_index("r")["score"].loc[[2]].to_numpy()
                       - sa.set_index("r")["score"].loc[[2]].to_numpy())
    settings = json.loads(z.read("settings.json"))
    assert settings["runs"]["A"]["run_id"] == a["run_id"] and settings["runs"]["B"]["run_id"] == b["run_id"]
    assert settings["metric"] == "erank" and settings["sweeps"] == {"A": two_sweeps[0], "B": two_sweeps[1]}
    # the figures at the export size: the scatter resized to 600 × 420, as a single download of it would be
    scatter = K.comparison_figures((a, b), (ta, tb), ov, "erank")["compare_erank_vs_horizon"][0]
    png = z.read("figures/compare_erank_vs_horizon.png")
    assert _png_size(png) == _png_size(F.to_png(scatter, 1.0, 600, 420)) != _png_size(F.to_png(scatter, 1.0))
    assert _svg_size(z.read("figures/compare_erank_vs_horizon.svg").decode()) == _svg_size(F.to_svg(scatter, 600, 420))
    # without sweeps: no tables
    z2 = zipfile.ZipFile(io.BytesIO(K.comparison_zip((a, b), (ta, tb), ov, "horizon")))
    assert not [n for n in z2.namelist() if n.startswith("tables/")] and "data/compare_diff_horizon.csv" in z2.namelist()


def test_run_zip_figures_use_the_export_size_and_scale(env, populated):
    from gdnviz import figures as F
    from gdnviz.ui.common import run_zip_bytes

    cache, run = populated
    env(cache)
    z = zipfile.ZipFile(io.BytesIO(run_zip_bytes(run, export=dict(width=700, height=300, scale=1.0))))
    fl = pd.read_csv(io.BytesIO(z.read("data/forgetting_by_layer.csv")))
    ch = F.forgetting_chart(fl, int(run["segment_len"]))
    assert _png_size(z.read("figures/forgetting_by_layer.png")) == _png_size(F.to_png(ch, 1.0, 700, 300)) \
        != _png_size(F.to_png(ch, 1.0))
    assert _svg_size(z.read("figures/forgetting_by_layer.svg").decode()) == _svg_size(F.to_svg(ch, 700, 300))
    default = zipfile.ZipFile(io.BytesIO(run_zip_bytes(run)))
    assert _png_size(default.read("figures/forgetting_by_layer.png")) == _png_size(F.to_png(ch, 2.0))


def test_redraw_script_colours_layers_with_the_apps_palette(tmp_path):
    """12 layers (more than category10's 10 colours): redraw.py carries plotstyle's colours for them, imports no
    gdnviz, and the figure it writes uses them."""
    from gdnviz.plotstyle import layer_colors
    from gdnviz.run_export import redraw_py

    layers = list(range(0, 24, 2))
    script = redraw_py(layers)
    assert "category10" not in script and "gdnviz" not in [
        n.names[0].name.split(".")[0] if isinstance(n, ast.Import) else (n.module or "").split(".")[0]
        for n in ast.walk(ast.parse(script)) if isinstance(n, (ast.Import, ast.ImportFrom))]
    colors = next(ast.literal_eval(n.value) for n in ast.parse(script).body
                  if isinstance(n, ast.Assign) and [t.id for t in n.targets] == ["LAYER_COLORS"])
    assert colors == dict(zip(layers, layer_colors(12))) and len(set(colors.values())) == 12
    (tmp_path / "tables").mkdir()
    heads = pd.DataFrame([dict(layer=l, head=h, erank=2.0 + h, erank_min=1.5 + h, erank_max=2.5 + h, horizon=10.0 * (l + 1))
                          for l in layers for h in range(2)])
    heads.to_csv(tmp_path / "tables" / "heads.csv", index=False)
    pd.DataFrame(columns=["job", "kind"]).to_csv(tmp_path / "jobs.csv", index=False)
    (tmp_path / "settings.json").write_text(json.dumps({"run_id": "r", "overview": {}}))
    (tmp_path / "redraw.py").write_text(script)
    done = subprocess.run([sys.executable, "redraw.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    html = (tmp_path / "redrawn_erank_vs_horizon.html").read_text()
    assert all(c in html for c in layer_colors(12))
