"""Figures that must stay readable on degenerate heads (the demo's rank-1 heads)."""
from types import SimpleNamespace

import numpy as np

from gdnviz import figures as F


def _capture(sv_end: np.ndarray):
    sv = np.zeros((2, 1, 1, sv_end.size), np.float32)
    sv[-1, 0, 0] = sv_end
    return SimpleNamespace(sv=sv, positions=np.array([256, 300]))


def test_spectrum_of_a_rank_one_head_draws_only_positive_sigma_and_says_so():
    sv = np.zeros(128, np.float32)
    sv[0] = 3.0
    df = F.spectrum_frame([_capture(sv)], ["doc"], 0, 0)
    assert len(df) == 128 and (df["sigma"] == 0).sum() == 127  # the CSV keeps every value
    chart = F.spectrum_chart(df)
    spec = chart.to_dict()
    drawn = {r["sigma"] for ds in spec["datasets"].values() for r in ds if "sigma" in r}
    assert drawn == {3.0}  # no σ = 0 reaches the log axis (it would blank the axis)
    assert any("127 singular values are 0" in line for line in spec["title"]["subtitle"])
    svg = F.to_svg(chart)
    assert "singular value σ_i (log scale)" in svg and "127 singular values are 0" in svg


def test_spectrum_of_a_full_rank_head_has_no_zero_note():
    sv = np.geomspace(1.0, 1e-6, 128).astype(np.float32)
    chart = F.spectrum_chart(F.spectrum_frame([_capture(sv)], ["doc"], 0, 0))
    assert not any("singular value" in line and "are 0" in line for line in chart.to_dict()["title"]["subtitle"])


# =============================================================================================================
# r keeping 99% of the energy, against an independent numpy SVD
# =============================================================================================================
import io  # noqa: E402
import re  # noqa: E402

import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import tiny_models  # noqa: E402
from gdnviz import compare as K  # noqa: E402
from gdnviz import plotstyle as PS  # noqa: E402
from gdnviz import summary  # noqa: E402
from gdnviz.analysis import rank_for_energy, spearman_ci  # noqa: E402


def _r99_by_loop(M: np.ndarray, q: float = 0.99) -> int:
    s = np.linalg.svd(M.astype(np.float64), compute_uv=False)
    total, acc = float(np.sum(s ** 2)), 0.0
    for r, x in enumerate(s, start=1):
        acc += float(x) ** 2
        if acc >= q * total:
            return r
    return len(s)


def test_rank_for_energy_matches_a_numpy_svd_of_random_states():
    rng = np.random.default_rng(3)
    for true_rank in (1, 3, 17, 64, 128):
        M = rng.standard_normal((128, true_rank)) @ rng.standard_normal((true_rank, 128))
        M += 1e-3 * rng.standard_normal((128, 128)) * (true_rank < 128)
        s = np.linalg.svd(M, compute_uv=False)
        assert rank_for_energy(s, 0.99) == _r99_by_loop(M)
        assert rank_for_energy(s[::-1], 0.99) == _r99_by_loop(M)  # order does not matter
    assert rank_for_energy(np.zeros(8)) == 0
    assert rank_for_energy(np.array([1.0, 0.0, 0.0]), 1.0) == 1
    with pytest.raises(ValueError, match="share must be in"):
        rank_for_energy(np.ones(4), 1.5)


def test_head_table_energy_rank99_is_the_numpy_svd_of_each_final_state():
    from gdnviz.capture import capture_document
    from gdnviz.models import from_model

    lm = from_model(tiny_models.qwen3_5(), "tiny")
    x = torch.randint(0, 97, (300,), generator=torch.Generator().manual_seed(5))
    cap = capture_document(lm, x, 64)
    t = summary.head_table(cap)
    NL, H = cap.final_state.shape[:2]
    want = [_r99_by_loop(cap.final_state[li, h]) for li in range(NL) for h in range(H)]
    assert t["energy_rank99"].astype(int).tolist() == want
    assert len(set(want)) > 1  # the heads differ: the test can tell a wrong head order
    ds = summary.document_set_table([cap, cap])
    assert {"energy_rank99", "energy_rank99_min", "energy_rank99_max"} <= set(ds.columns)
    for li, h in ((0, 0), (NL - 1, H - 1), (NL // 2, H // 2)):  # one head's row alone: the same numbers
        one = summary.head_table(cap, only=(li, h))
        pd.testing.assert_frame_equal(one.reset_index(drop=True), t.iloc[[li * H + h]].reset_index(drop=True))


# =============================================================================================================
# Spearman ρ's bootstrap interval, against scipy on the documented resamples
# =============================================================================================================
def test_spearman_ci_is_the_percentile_bootstrap_over_heads():
    from scipy.stats import spearmanr

    rng = np.random.default_rng(1)
    x = rng.standard_normal(60)
    y = x + rng.standard_normal(60)
    y[:5] = np.round(y[:5])  # some ties
    lo, hi = spearman_ci(x, y, n_boot=400, seed=7)
    idx = np.random.default_rng(7).integers(0, 60, size=(400, 60))
    rhos = np.array([spearmanr(x[i], y[i]).statistic for i in idx])
    want = np.quantile(rhos[np.isfinite(rhos)], [0.025, 0.975])
    np.testing.assert_allclose([lo, hi], want, atol=1e-12)
    rho = spearmanr(x, y).statistic
    assert lo < rho < hi


def test_spearman_ci_agrees_with_fisher_z_on_a_large_sample():
    rng = np.random.default_rng(2)
    n = 400
    x = rng.standard_normal(n)
    y = 0.6 * x + 0.8 * rng.standard_normal(n)
    lo, hi = spearman_ci(x, y)
    from scipy.stats import spearmanr

    z = np.arctanh(spearmanr(x, y).statistic)
    se = 1.06 / np.sqrt(n - 3)  # Fieller et al.'s variance of Fisher's z for Spearman's ρ
    flo, fhi = np.tanh(z - 1.96 * se), np.tanh(z + 1.96 * se)
    assert abs(lo - flo) < 0.02 and abs(hi - fhi) < 0.02
    assert all(np.isnan(spearman_ci([1, 2], [2, 1])))
    with pytest.raises(ValueError, match="level"):
        spearman_ci(x, y, level=1.0)


# =============================================================================================================
# figures fit to publish
# =============================================================================================================
def _table(layers=(0, 1, 2, 4, 5, 6), heads=2, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for l in layers:
        for h in range(heads):
            r = dict(layer=l, head=h, erank=rng.uniform(1, 60), numerical_rank=float(rng.integers(20, 129)),
                     stable_rank=rng.uniform(1, 3), energy_rank99=float(rng.integers(1, 129)),
                     horizon=322.373498245 * rng.uniform(0.01, 30), mean_key_norm=rng.uniform(0, 1),
                     key_cov_erank=rng.uniform(1, 20), decayed_P_erank=rng.uniform(1, 50))
            rows.append(r)
    t = pd.DataFrame(rows)
    t["n_docs"] = 3
    return t


def _hex_rgb(c):
    return np.array([int(c[i:i + 2], 16) for i in (1, 3, 5)], float)


@pytest.mark.parametrize("n", [2, 6, 10, 18, 24, 48])
def test_layer_palette_tells_neighbouring_layers_apart(n):
    cols = PS.layer_colors(n)
    assert len(cols) == n == len(set(cols))
    for a, b in zip(cols, cols[1:]):
        assert np.linalg.norm(_hex_rgb(a) - _hex_rgb(b)) > 60, (a, b)


def test_erank_vs_horizon_colours_layers_qualitatively_and_shows_the_interval():
    t = _table()
    spec = F.erank_vs_horizon_chart(t, 0.9, 128, (0.8, 0.95)).to_dict()
    pts = [l for l in spec["layer"] if l["encoding"].get("color", {}).get("field") == "layer"][0]
    sc = pts["encoding"]["color"]["scale"]
    assert "scheme" not in sc and sc["domain"] == [0, 1, 2, 4, 5, 6] and sc["range"] == PS.layer_colors(6)
    assert any("95% CI 0.80 to 0.95" in s for s in spec["title"]["subtitle"])


@pytest.mark.parametrize("metric", list(F.HEATMAP_METRICS))
def test_exported_heatmap_has_no_ui_hints_no_outlines_and_no_cut_text(metric):
    t = _table()
    df = F.heatmap_frame(t, metric)
    shown = F.heatmap(df, metric, selected=(1, 0), picked=[(2, 1)])
    out = F.heatmap(df, metric, selected=(1, 0), picked=[(2, 1)], interactive=False)
    assert "click a cell" in str(shown.to_dict()["title"])
    spec = out.to_dict()
    assert "click" not in json_text(spec) and "params" not in spec
    frames = {r["frame"] for ds in spec["datasets"].values() for r in ds}
    assert frames == {"none"}  # no open-head or truncation-set outline
    svg = F.to_svg(out)
    assert "…" not in svg
    for line in spec["encoding"]["color"]["title"]:
        assert line.replace("&", "&amp;") in svg
    for num in re.findall(r">\s*(-?[\d,]*\.\d+)\s*<", svg):  # no raw floats such as 322.373498245 in a label
        assert len(num.replace(",", "").replace(".", "").replace("-", "").lstrip("0")) <= 4, num


def json_text(spec) -> str:
    import json

    return json.dumps({k: v for k, v in spec.items() if k != "datasets"}, ensure_ascii=False)


def test_log_axes_use_one_notation_and_ticks_that_do_not_collide():
    assert PS.log_ticks(1, 100) == [1, 2, 5, 10, 20, 50, 100]
    assert PS.log_ticks(1e-8, 1) == [10.0 ** e for e in range(-8, 1)]
    assert PS.log_format(PS.log_ticks(1e-8, 1)) == ".0e" and PS.log_format([1, 10, 1000]) == ",~g"
    assert len(PS.log_ticks(1e-12, 1e6)) <= 10
    t = _table()
    spec = F.erank_vs_horizon_chart(t, 0.9, 128).to_dict()
    pts = [l for l in spec["layer"] if l["encoding"].get("color", {}).get("field") == "layer"][0]
    for ax in ("x", "y"):
        vals = pts["encoding"][ax]["axis"]["values"]
        assert all(b / a >= 2 for a, b in zip(vals, vals[1:]))  # at most 1-2-5 steps: no label on 3, 4, 6 …


def test_the_scatter_rings_the_open_head_only_when_interactive():
    t = _table()
    l, h = int(t["layer"].iloc[0]), int(t["head"].iloc[0])

    def rings(spec):
        return [x for x in spec["layer"] if isinstance(x.get("mark"), dict) and x["mark"].get("filled") is False]

    assert len(rings(F.erank_vs_horizon_chart(t, 0.9, 128, interactive=True, selected=(l, h)).to_dict())) == 1
    assert not rings(F.erank_vs_horizon_chart(t, 0.9, 128, selected=(l, h)).to_dict())  # an export: no UI hints
    assert not rings(F.erank_vs_horizon_chart(t, 0.9, 128, interactive=True, selected=(99, 0)).to_dict())


def test_human_bytes():
    assert PS.human_bytes(0) == "0 B" and PS.human_bytes(512) == "512 B"
    assert PS.human_bytes(12 * 1024) == "12.0 KiB" and PS.human_bytes(1.5 * 2 ** 30) == "1.50 GiB"
    assert PS.human_bytes(131 * 1024) == "131 KiB"
    with pytest.raises(ValueError):
        PS.human_bytes(-1)


def test_export_takes_a_size_and_a_scale():
    from PIL import Image

    ch = F.erank_vs_horizon_chart(_table(), 0.9, 128)
    im = Image.open(io.BytesIO(F.to_png(ch, 3.0, width=700, height=400)))
    assert abs(im.width - 3 * 700) <= 3 * 2
    im1 = Image.open(io.BytesIO(F.to_png(ch, 1.0, width=700, height=400)))
    assert abs(im.width - 3 * im1.width) <= 3 and abs(im.height - 3 * im1.height) <= 3
    assert 'width="700"' in F.to_svg(ch, width=700)
    with pytest.raises(ValueError, match="scale"):
        F.to_png(ch, 0)
    with pytest.raises(ValueError, match="width"):
        F.to_png(ch, 1, width=10)


def test_per_document_spread_does_not_zoom_noise_into_spread():
    dom = F.spread_domain([127, 128, 128], "numerical_rank", rank_max=128)
    assert 128 < dom[1] <= 128 * 1.01 and dom[1] - dom[0] >= 0.1 * 128
    dom = F.spread_domain([0.91, 0.912], "mean_key_norm")
    assert dom[0] < 0.91 and 0.912 < dom[1] <= 1.01 and dom[1] - dom[0] >= 0.09
    assert F.spread_domain([0.99, 1.0], "mean_key_norm")[1] <= 1.01
    wide = F.spread_domain([5.0, 40.0], "erank")
    assert wide[0] <= 5 and wide[1] >= 40 and wide[1] - wide[0] < 40  # a real spread is drawn as is
    df = pd.DataFrame([dict(document=d, metric=m, label=F.SHORT_LABELS[m], value=v)
                       for d, v in (("a", 127.0), ("b", 128.0)) for m in ("numerical_rank", "erank")])
    spec = F.per_document_chart(df, 128).to_dict()
    nr = spec["vconcat"][0]["layer"][0]["encoding"]["x"]
    assert nr["axis"]["format"] == "d" and nr["axis"]["tickMinStep"] == 1
    assert "median over documents" in " ".join(spec["title"]["subtitle"])


def test_energy_and_keycone_ceiling_figures():
    from types import SimpleNamespace

    sv = np.geomspace(1, 1e-3, 128)
    cap = SimpleNamespace(sv=np.tile(sv, (2, 1, 1, 1)).astype(np.float32), positions=np.array([64, 100]))
    df = F.energy_frame([cap], ["doc"], 0, 0)
    assert len(df) == 128 and df["energy"].iloc[-1] == pytest.approx(1.0)
    assert (df["r_share"] == _r99_by_loop(np.diag(sv))).all()
    F.to_svg(F.energy_chart(df, marked_r=(1, 4, 12, 32)))
    t = _table()
    ch = F.keycone_ceiling_chart(t)
    spec = ch.to_dict()
    enc = [c["encoding"] for row in spec["vconcat"] for c in row["hconcat"]]
    assert [(e["x"]["field"], e["y"]["field"]) for e in enc] == [
        ("erank", "mean_key_norm"), ("horizon", "mean_key_norm"), ("erank", "key_cov_erank"),
        ("horizon", "key_cov_erank")]
    assert "The key cone's ceiling" in F.to_svg(ch)


# =============================================================================================================
# two runs
# =============================================================================================================
def test_compare_difference_mismatch_and_sweeps():
    ta, tb = _table(seed=0), _table(seed=1)
    d = K.difference_frame(ta, tb, "erank")
    np.testing.assert_allclose(d["value"], tb["erank"] - ta["erank"])
    svg = F.to_svg(K.difference_heatmap(d, "erank", ("model A", "model B")))
    assert "B − A" in svg and "click" not in svg
    m = dict(gdn_layers=[0, 1, 2], num_heads=4, d_k=16, d_v=16)
    assert K.grid_mismatch(m, dict(m)) is None
    msg = K.grid_mismatch(m, dict(m, num_heads=2, gdn_layers=[0, 1]))
    assert "GDN layers [0, 1, 2] vs [0, 1]" in msg and "4 vs 2 heads per layer" in msg
    ov = K.overlay_frame({"A": ta, "B": _table(layers=(0, 3), heads=4)})
    assert set(ov["run"]) == {"A", "B"} and len(ov) == 12 + 8
    F.to_svg(K.overlay_scatter(ov, {"A": "0.90", "B": "n/a"}, 128))
    two = K.overlay_frame({"A": ta, "B": tb})
    spec = K.overlay_scatter(two, {"A": "0.9", "B": "0.8"}, 128, paired=True).to_dict()
    assert any(l["mark"]["type"] == "line" and l["encoding"].get("detail") for l in spec["layer"])
    assert "grey: the same head in A and B" in spec["title"]["subtitle"][0]
    sa = pd.DataFrame(dict(task=["niah", "niah", "vt"], length=[1024, 1024, 1024], setting="uniform", r=[1, 128, 1],
                           score=[10.0, 100.0, 0.0], n=[20, 20, 20]))
    sb = sa.assign(score=[40.0, 100.0, 5.0]).iloc[:2]
    sd = K.sweep_difference(sa, sb)
    assert sd["delta"].tolist() == [30.0, 0.0] and len(sd) == 2


def test_one_class_table_builds_the_same_specs_and_builds_the_table_once():
    """``specs._one_class_table`` (Altair's class table built once, not per channel): in a fresh interpreter, the
    Head page's figures come out identical with and without it, and with it the table is built once."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    code = r'''
import json, numpy as np, pandas as pd
from altair.utils import schemapi
from gdnviz import figures as F
from gdnviz.ui import specs
sv = np.geomspace(1, 1e-3, 16)
sp = pd.DataFrame([dict(document=d, index=i + 1, sigma=s * (1 + k), floor=1e-6, numerical_rank=16, erank=7.5,
                        position=300) for k, d in enumerate("ab") for i, s in enumerate(sv)])
pdf = pd.DataFrame([dict(document=d, metric=m, label=F.SHORT_LABELS[m], value=v + k)
                    for k, d in enumerate("ab") for m, v in (("numerical_rank", 12.0), ("erank", 5.5))])
def build():
    return [F.spectrum_chart(sp, "a").to_dict(validate=False), F.per_document_chart(pdf, 16).to_dict(validate=False)]
plain = build()
specs._one_class_table()
shared = build()
n, hash_schema = [0], schemapi._FromDict.hash_schema
def counted(schema, use_json=True):
    n[0] += 1
    return hash_schema(schema, use_json)
schemapi._FromDict.hash_schema = staticmethod(counted)
build()
classes = len(list(schemapi._subclasses(schemapi.SchemaBase)))
print(json.dumps([plain == shared, n[0], classes]))
'''
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-2000:]
    same, hashed, classes = json.loads(out.stdout.strip().splitlines()[-1])
    assert same
    assert hashed < classes  # lookups only; a table built per channel hashes every class each time
