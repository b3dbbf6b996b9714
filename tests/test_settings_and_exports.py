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


# =============================================================================================================
# exports
# =============================================================================================================
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
