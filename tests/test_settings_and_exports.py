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
