"""The Head page's exact attention map (issue 31): the softmax weights against transformers' own eager attention
(an independent computation: ``output_attentions=True`` of a separately loaded model), the device/dtype path of the
map and of ``decompose`` against the float64 CPU reference, the AttnMapJob on the bundled demo model (through the
worker's job function, the memo a real diskcache) and its refusals, and the page's tables and heatmaps."""
import numpy as np
import pytest
import torch

from gdnviz import jobs
from gdnviz.attribution import decompose, head_inputs, weights
from gdnviz.attribution.softmax_map import softmax_weights, weights_from_qk
from gdnviz.errors import (HeadOutOfRange, LayerNotAttention, LayerNotGDN, ModelMismatch, PositionOutOfRange,
                           WindowTooLarge)
from gdnviz.store import Store


@pytest.fixture(scope="module")
def demo(one_thread):
    from gdnviz.models import load

    return load("demo", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 8000, (1, 300), generator=torch.Generator().manual_seed(0))


# --- softmax weights ------------------------------------------------------------------------------------------
def test_softmax_weights_are_transformers_eager_attention(demo, ids):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(demo.info.path, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        att = ref(ids, output_attentions=True, use_cache=False).attentions  # one per full-attention layer
    by_layer = dict(zip(demo.info.attn_layers, att, strict=True))
    for layer in demo.info.attn_layers:
        want = by_layer[layer][0].double()                                # [H, T, T]
        for h in range(want.shape[0]):
            got = softmax_weights(demo, ids, layer, 200, 300, head=h)
            torch.testing.assert_close(got, want[h, 200:300], rtol=0, atol=1e-5)
        mean = softmax_weights(demo, ids, layer, 0, 120)
        torch.testing.assert_close(mean, want[:, :120, :120].mean(0), rtol=0, atol=1e-5)
        torch.testing.assert_close(mean.sum(1), torch.ones(120, dtype=torch.float64), rtol=0, atol=1e-12)
        assert float(mean.triu(1).abs().max()) == 0.0


def test_weights_from_qk_is_a_per_head_softmax_with_grouped_keys():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(9, 4, 3, generator=g, dtype=torch.float64)
    k = torch.randn(9, 2, 3, generator=g, dtype=torch.float64)
    p = weights_from_qk(q, k, 0.5, 3, 9)
    for h in range(4):
        for i, t in enumerate(range(3, 9)):
            e = np.exp([0.5 * float(q[t, h] @ k[s, h // 2]) for s in range(t + 1)])
            np.testing.assert_allclose(p[h, i, :t + 1].numpy(), e / e.sum(), rtol=1e-12)
            assert float(p[h, i, t + 1:].abs().sum()) == 0.0


def test_softmax_weights_refuse_bad_layers_and_heads(demo, ids):
    with pytest.raises(LayerNotAttention,
                       match=r"layer 5 \(a Gated DeltaNet layer\) is not a full-attention layer.*\[3, 7\]"):
        softmax_weights(demo, ids, 5, 0, 10)
    with pytest.raises(HeadOutOfRange, match=r"attention head 4 is out of range: layer 3 has query heads 0..3"):
        softmax_weights(demo, ids, 3, 0, 10, head=4)
    with pytest.raises(PositionOutOfRange, match=r"window \[290, 301\)"):
        softmax_weights(demo, ids, 3, 290, 301)


# --- the device / dtype path, pinned to the float64 CPU reference -----------------------------------------------
TOL = {torch.float32: 2e-6, torch.float64: 1e-12}  # relative to the largest |w| (the map) / ‖S‖ (the state)
PATHS = [pytest.param("cpu", torch.float32, id="cpu-float32"),
         pytest.param("cuda", torch.float32, id="cuda-float32", marks=pytest.mark.gpu),
         pytest.param("cuda", torch.float64, id="cuda-float64", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device,dtype", PATHS)
def test_map_and_decomposition_on_a_device_match_the_float64_cpu_reference(demo, ids, device, dtype):
    from gdnviz.truncation import TruncationSpec

    plain = head_inputs(demo, ids, 5, 1, 300)
    cut = head_inputs(demo, ids, 5, 1, 300, TruncationSpec.uniform([(5, 1)], 4), segment_len=64)
    assert cut.rank == 4
    for inp in (plain, cut):
        ref = weights(inp, 100, 300)
        got = weights(inp, 100, 300, device, dtype)
        assert got.device.type == device and got.dtype == dtype
        assert float((got.double().cpu() - ref).abs().max()) <= TOL[dtype] * float(ref.abs().max())
        c_ref, c = decompose(inp, 300, 64), decompose(inp, 300, 64, device, dtype)
        n = float(c_ref.state.norm())
        assert c.vectors.dtype == torch.float64 and c.vectors.device.type == "cpu"
        assert float((c.total() - c_ref.state).norm()) <= TOL[dtype] * n * 10
        assert float((c.vectors - c_ref.vectors).norm()) <= TOL[dtype] * float(c_ref.vectors.norm()) * 10


def test_the_map_leaves_the_head_inputs_untouched(demo, ids):
    inp = head_inputs(demo, ids, 5, 1, 200)
    q = inp.q.clone()
    weights(inp, 0, 200)
    assert torch.equal(inp.q, q)


# --- the job on the demo model ------------------------------------------------------------------------------------
TEXT = ("The archive kept every letter in a numbered box. The code word for the vault is heliotrope. "
        "Later the clerks moved the boxes twice and lost the index. ") * 6


def map_spec(store, L=64, **kw):
    cap = jobs.run(jobs.CaptureJob(model="demo", documents=(("vault", TEXT),), segment_len=L, device="cpu",
                                   dtype="float32"), jobs.JobContext(store))
    run = store.run(cap["run_id"])
    d = run["documents"][0]
    T = d["n_tokens"]
    base = dict(model="demo", document=("vault", TEXT), doc_key=d["key"], layer=5, head=1, start=T - 100, end=T,
                attn_layer=7, attn_head=None, segment_len=L, device="cpu", dtype="float32")
    return run, jobs.AttnMapJob(**{**base, **kw})


def test_attnmap_job_on_the_demo_model_end_to_end(tmp_path, demo):
    from gdnviz.attribution.softmax_map import softmax_weights as sw
    from gdnviz.ui import attnmap_charts as AC

    store = Store(tmp_path)
    run, spec = map_spec(store)
    spec = jobs.spec_from_dict(jobs.spec_to_dict(spec))  # the queue's round trip
    T = run["documents"][0]["n_tokens"]
    seen = []
    res = jobs.run(spec, jobs.JobContext(store, progress=lambda d, n, t: seen.append(t)))
    assert not res["memo_hit"] and any("exact map of 100 queries" in s for s in seen)
    assert (res["gdn_key"], res["softmax_key"]) == jobs.attnmap_keys(spec.doc_key, 5, 1, T - 100, T, 7, None)
    w, meta = jobs.unpack_map(store.memo_get(res["gdn_key"]))
    p, pm = jobs.unpack_map(store.memo_get(res["softmax_key"]))
    assert w.shape == p.shape == (100, T) and len(meta["tokens"]) == T and pm["heads"] == 4
    # the map reproduces the head's output: o_t = Σ_s w_t,s v_s, against the float64 reference recurrence
    from gdnviz.attribution import recurrence

    ids = torch.tensor(demo.tokenizer(TEXT).input_ids)[None]
    assert ids.shape[1] == T
    inp = head_inputs(demo, ids, 5, 1, T, segment_len=64)
    o = recurrence.outputs(inp, T)[T - 100:]
    np.testing.assert_allclose(w @ inp.v.numpy(), o.numpy(), rtol=0, atol=1e-10 * float(o.abs().max()))
    assert 0 <= meta["output_check"] < 1e-10
    np.testing.assert_allclose(p, sw(demo, ids, 7, T - 100, T).numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(p.sum(1), 1.0, atol=1e-12)
    # the page's tables and figures of it
    top = AC.top_keys(w, T - 100, meta["tokens"], T - 1, 5)
    row = w[-1]
    assert list(top["key"]) == list(np.argsort(-np.abs(row), kind="stable")[:5])
    assert top["weight"].tolist() == row[top["key"]].tolist() and (top["tokens_back"] == T - 1 - top["key"]).all()
    assert top["token"].tolist() == [meta["tokens"][s] for s in top["key"]]
    long = AC.long_frame(w, T - 100)
    assert len(long) == sum(T - 100 + i + 1 for i in range(100)) and (long["key"] <= long["query"]).all()
    i = long.index[(long["query"] == T - 50) & (long["key"] == 7)][0]
    assert long.loc[i, "weight"] == w[50, 7]
    import io

    import pandas as pd

    from gdnviz.ui.attnmap import csv_bytes  # the page's CSV download: the stored map at full resolution
    back = pd.read_csv(io.BytesIO(csv_bytes(str(tmp_path), res["gdn_key"])))
    assert list(back.columns) == ["query", "key", "weight"] and len(back) == len(long)
    np.testing.assert_allclose(back["weight"], long["weight"], rtol=1e-15)
    for kind, m in (("gdn", w), ("softmax", p)):
        AC.heatmap(m, T - 100, kind, "t", ["s"]).to_dict(validate=True)
    again = jobs.run(spec, jobs.JobContext(store))
    assert again["memo_hit"]
    # another softmax head: the GDN map is not recomputed
    res2 = jobs.run(jobs.spec_from_dict({**jobs.spec_to_dict(spec), "attn_head": 2}), jobs.JobContext(store))
    assert not res2["memo_hit"] and set(res2["seconds"]) == {"softmax"}


def test_blocks_keep_the_largest_entry_of_each_block():
    from gdnviz.ui import attnmap_charts as AC

    rng = np.random.default_rng(0)
    start, n, end = 700, 300, 1000
    w = rng.standard_normal((n, end))
    w[np.arange(start, end)[:, None] < np.arange(end)[None]] = 0.0
    df = AC.blocks(w, start)
    br, bc = AC.block_sizes(n, end)
    assert (br, bc) == (3, 4) and len(df) <= AC.MAX_ROWS * AC.MAX_COLS
    for _, r in df.sample(50, random_state=0).iterrows():
        q0, q1, k0, k1 = (int(r[c]) for c in ("q0", "q1", "k0", "k1"))
        sub = w[q0 - start:q1 - start, k0:k1].copy()
        sub[np.arange(q0, q1)[:, None] < np.arange(k0, k1)[None]] = np.nan
        assert r["weight"] == sub.flat[np.nanargmax(np.abs(sub))]
        assert w[int(r["t"]) - start, int(r["s"])] == r["weight"] and int(r["s"]) <= int(r["t"])
    assert not ((df["k0"] > df["q1"] - 1)).any()   # no block wholly above the diagonal
    # a zoom on keys 600..899: blocks over that range only, finer (1 key per cell), the same rule inside
    z = AC.blocks(w, start, (600, 900))
    assert AC.block_sizes(n, 300) == (3, 2) and z["k0"].min() == 600 and z["k1"].max() == 900
    for _, r in z.sample(50, random_state=1).iterrows():
        q0, q1, k0, k1 = (int(r[c]) for c in ("q0", "q1", "k0", "k1"))
        assert 600 <= k0 < k1 <= 900
        sub = w[q0 - start:q1 - start, k0:k1].copy()
        sub[np.arange(q0, q1)[:, None] < np.arange(k0, k1)[None]] = np.nan
        assert r["weight"] == sub.flat[np.nanargmax(np.abs(sub))]
    for bad in ((0, 0), (900, 600), (-1, 10), (0, end + 1)):
        with pytest.raises(ValueError, match="key range"):
            AC.blocks(w, start, bad)
    # more cells than Altair's 5,000-row guard: importing attnmap_charts switched it off for the process, once
    assert len(AC.blocks(w, start)) > 5000
    spec = AC.heatmap(w, start, "gdn", "t", [], keys=(600, 900)).to_dict()
    full = AC.heatmap(w, start, "gdn", "t", []).to_dict()  # the colour scale stays the whole map's
    assert spec["layer"][0]["encoding"]["x"]["scale"]["domain"] == [600, 900]
    assert any("zoom: keys 600..899 of 0..999" in x for x in spec["title"]["subtitle"])
    # no line cut off with "…" at the chart's 440 px: in Chromium 66 characters fit, the 76 and 82 of earlier
    # wordings were cut
    assert all(len(x) <= 70 for x in spec["title"]["subtitle"]), spec["title"]["subtitle"]
    assert (spec["layer"][0]["encoding"]["color"]["scale"]["domain"]
            == full["layer"][0]["encoding"]["color"]["scale"]["domain"])


@pytest.mark.parametrize("change,error,match", [
    (dict(start=0, end=10 ** 6), PositionOutOfRange, r"window \[0, 1000000\) is outside the document"),
    (dict(start=50, end=40), PositionOutOfRange, r"window \[50, 40\)"),
    (dict(layer=3), LayerNotGDN, r"layer 3 \(a full-attention layer\) is not a Gated DeltaNet layer"),
    (dict(head=2), HeadOutOfRange, r"head 2 is out of range: layer 5 has heads 0..1"),
    (dict(attn_layer=5), LayerNotAttention, r"layer 5 \(a Gated DeltaNet layer\) is not a full-attention layer"),
    (dict(attn_head=4), HeadOutOfRange, r"attention head 4 is out of range: layer 7 has query heads 0..3"),
])
def test_attnmap_job_refuses_bad_input_before_computing(tmp_path, change, error, match):
    store = Store(tmp_path)
    _, spec = map_spec(store, **change)
    with pytest.raises(error, match=match):
        jobs.run(spec, jobs.JobContext(store))
    gk, sk = jobs.attnmap_keys(spec.doc_key, spec.layer, spec.head, spec.start, spec.end, spec.attn_layer,
                               spec.attn_head)
    assert not store.memo_has(gk) and not store.memo_has(sk)


def test_attnmap_job_refuses_a_window_over_the_stored_limit_and_another_text(tmp_path, monkeypatch):
    store = Store(tmp_path)
    _, spec = map_spec(store)
    monkeypatch.setattr(jobs, "MAX_STORED_MAP_BYTES", 8 * 100 * 100)
    with pytest.raises(WindowTooLarge, match=r"over the .* GiB limit"):
        jobs.run(spec, jobs.JobContext(store))
    _, other = map_spec(store, document=("vault", TEXT + " More."))
    with pytest.raises(ModelMismatch, match="not the document the run captured"):
        jobs.run(other, jobs.JobContext(store))
