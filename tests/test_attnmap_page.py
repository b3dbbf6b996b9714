"""AppTest of the Head page's "Exact attention map" section (gdnviz/ui/attnmap.py): Not computed → Compute → the
worker's AttnMapJob → the two heatmaps and the top-key tables; another request never shows this result; bad
windows get the library's message; going back shows the stored result without recomputing; a model without a
full-attention layer gets the GDN map alone."""
import json

import pytest

from app_fixtures import short_text, tiny_checkpoint  # noqa: F401  (fixture)
from test_app_pages import app, capture, chart_titles, env, populated, texts, work  # noqa: F401  (fixtures, helpers)
from gdnviz.store import Store

GDN_TITLE, SOFT_TITLE = "GDN layer 3 head 1: exact map", "Softmax: attention layer 2, mean over heads"


def test_head_page_exact_attention_map_computes_in_the_worker_and_refuses_bad_windows(env, populated):
    cache, run = populated
    env(cache)
    at = app("head", run=run, layer=3, head=1)
    at.run()
    assert not at.exception
    T = run["documents"][0]["n_tokens"]
    end = (T // 64) * 64
    start = max(0, end - 256)
    assert (at.number_input(key="am_start").value, at.number_input(key="am_end").value) == (start, end)
    assert at.selectbox(key="am_attn_layer").value == 2 and at.selectbox(key="am_attn_head").options == [
        "mean over heads", "head 0", "head 1", "head 2", "head 3"]
    assert any("Not computed yet" in i and f"queries {start:,}..{end - 1:,}" in i for i in texts(at, "info"))
    at.button(key="am_compute").click().run()
    jid = at.session_state["am_job_now"]
    assert Store(cache).job(jid)["kind"] == "attnmap"
    assert work(cache) >= 1
    assert Store(cache).job(jid)["status"] == "done", Store(cache).job(jid)["error"]
    at.run()
    assert not at.exception
    assert {GDN_TITLE, SOFT_TITLE} <= set(chart_titles(at))
    specs = {json.loads(c.proto.spec)["title"]["text"]: json.loads(c.proto.spec) for c in at.get("vega_lite_chart")
             if isinstance(json.loads(c.proto.spec).get("title"), dict)}
    for t in (GDN_TITLE, SOFT_TITLE):  # the same axes; the picked query (the last one) marked on both
        cells, rule = specs[t]["layer"]
        assert cells["encoding"]["x"]["scale"]["domain"] == [0, end]
        assert cells["encoding"]["y"]["scale"]["domain"] == [start, end]
        assert rule["encoding"]["y"]["datum"] == end - 1
    labels = {b.key: b.proto.label for b in at.get("download_button")}
    assert {labels.get(f"ch_am_{m}_{x}") for m in ("gdn", "soft") for x in ("png", "svg")} == {"PNG", "SVG"}
    assert labels["ch_am_gdn_csv"] == labels["ch_am_soft_csv"] == "CSV of the whole map (query, key, weight)"
    gdn_top, soft_top = at.dataframe[-2].value, at.dataframe[-1].value
    assert list(gdn_top["rank"]) == list(range(1, 11)) and (gdn_top["weight"].abs().diff().dropna() <= 0).all()
    assert (soft_top["weight"].diff().dropna() <= 0).all() and (soft_top["key"] <= end - 1).all()
    assert at.number_input(key="am_row").value == end - 1 and (gdn_top["tokens_back"] == end - 1 - gdn_top["key"]).all()
    at.number_input(key="am_row").set_value(start + 5).run()
    assert not at.exception
    assert (at.dataframe[-2].value["key"] <= start + 5).all() and (at.dataframe[-1].value["key"] <= start + 5).all()
    shown = [json.loads(c.proto.spec) for c in at.get("vega_lite_chart")]
    rules = [x["layer"][1]["encoding"]["y"]["datum"] for x in shown
             if isinstance(x.get("title"), dict) and x["title"]["text"] in (GDN_TITLE, SOFT_TITLE)]
    assert rules == [start + 5, start + 5]
    # a zoom on the key axis: both maps over keys start..end−1, the rest of the page as it was
    assert at.slider(key="am_keys").value == (0, end)
    at.slider(key="am_keys").set_value((start, end)).run()
    assert not at.exception
    zoomed = [json.loads(c.proto.spec) for c in at.get("vega_lite_chart")]
    zoomed = [x for x in zoomed if isinstance(x.get("title"), dict) and x["title"]["text"] in (GDN_TITLE, SOFT_TITLE)]
    assert len(zoomed) == 2 and all(x["layer"][0]["encoding"]["x"]["scale"]["domain"] == [start, end] for x in zoomed)
    assert all(any(f"zoom: keys {start:,}..{end - 1:,}" in t for t in x["title"]["subtitle"]) for x in zoomed)
    at.slider(key="am_keys").set_value((0, end)).run()
    # another softmax head: not computed, nothing of this result shown
    at.selectbox(key="am_attn_head").set_value(1).run()
    assert any("Not computed yet" in i and "softmax of layer 2 (head 1)" in i for i in texts(at, "info"))
    assert GDN_TITLE not in chart_titles(at)
    # no softmax layer: the GDN map alone, from the memo (nothing to compute)
    at.selectbox(key="am_attn_layer").set_value("none (GDN map only)").run()
    assert GDN_TITLE in chart_titles(at) and not any(t.startswith("Softmax") for t in chart_titles(at))
    assert work(cache) == 0
    at.selectbox(key="am_attn_layer").set_value(2).run()
    # a window outside the document: the library's message
    at.selectbox(key="am_attn_head").set_value("mean over heads").run()
    at.number_input(key="am_end").set_value(10 ** 6).run()
    at.button(key="am_compute").click().run()
    work(cache)
    at.run()
    errs = texts(at, "error")
    assert any("window" in e and "1000000) is outside the document" in e and f"<= {T}" in e for e in errs), errs
    at.number_input(key="am_end").set_value(end).run()  # back: the stored result, without recomputing
    assert not at.exception, [e.proto for e in at.exception]
    assert GDN_TITLE in chart_titles(at) and work(cache) == 0


@pytest.fixture(scope="module")
def all_gdn_checkpoint(tmp_path_factory):
    """A tiny Qwen3.5 checkpoint whose three layers are all Gated DeltaNet (no softmax attention to compare with)."""
    import tiny_models
    import tokenizers_for_tests

    root = tmp_path_factory.mktemp("all_gdn")
    _, chat = tokenizers_for_tests.build(root / "tok", vocab_size=1200)
    tok = tokenizers_for_tests.load(chat)
    out = root / "all-gdn-qwen3_5"
    tiny_models.qwen3_5(vocab=len(tok) + 16, layers=("linear_attention",) * 3).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_a_model_without_full_attention_shows_only_the_gdn_map(env, tmp_path, all_gdn_checkpoint):
    cache = env(tmp_path / "c")
    run = capture(cache, all_gdn_checkpoint, (("alpha", short_text(200, 0)),))
    at = app("head", run=run, layer=1, head=0)
    at.run()
    assert not at.exception
    assert any("no full-attention layer" in c for c in texts(at, "caption"))
    assert "am_attn_layer" not in [s.key for s in at.selectbox]
    at.button(key="am_compute").click().run()
    assert work(cache) >= 1
    at.run()
    assert not at.exception
    titles = chart_titles(at)
    assert "GDN layer 1 head 0: exact map" in titles and not any(t.startswith("Softmax") for t in titles)
    assert list(at.dataframe[-1].value["rank"]) == list(range(1, 11))
