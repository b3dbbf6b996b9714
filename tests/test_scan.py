"""Head sensitivity scans on the bundled demo model (CPU, float32): the table against an independent computation
from the per-sample rows, memo sharing with sweeps, keep-one baselines, narrowing, the plan, bad input."""
import math

import numpy as np
import pandas as pd
import pytest

from gdnviz.errors import EmptyHeadSet, RankOutOfRange, TaskTooShort, TooManyPrompts, UnknownTask
from gdnviz.probes import scan, sweep

TASK, LENGTH = "niah_single_1", 512  # two segments of 256: one boundary inside every prompt


@pytest.fixture(scope="module")
def lm():
    from gdnviz.models import load

    return load("demo", device="cpu", dtype="float32")


def spec(**kw):
    d = dict(model="demo", task=TASK, length=LENGTH, r=1, by="layer", n=3, max_new_tokens=10, batch_size=4)
    d.update(kw)
    return scan.ScanSpec(**d)


def by_hand(rows: pd.DataFrame, setting: str, base_rows: pd.DataFrame) -> dict:
    """Mean score, baseline, paired mean difference and SE of one setting, from the rows, without sweep_table."""
    a = rows[rows["setting"] == setting].set_index("seed")["score"].sort_index()
    b = base_rows.set_index("seed")["score"].sort_index()
    d = [a[s] - b[s] for s in a.index]
    n = len(d)
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / (n - 1)
    return dict(n=n, score=sum(a) / n, baseline=sum(b[s] for s in a.index) / n, delta=mean, se=math.sqrt(var / n))


def test_layer_scan_table_against_the_rows(lm, tmp_path):
    res = scan.run_scan(lm, spec(), store=tmp_path)
    t = res.table
    assert list(t.columns) == scan.TABLE_COLUMNS == ["layer", "head", "r", "n", "score", "baseline", "delta", "se"]
    assert t["layer"].tolist() == list(lm.info.gdn_layers) and t["head"].isna().all()
    assert (t["r"] == 1).all() and (t["n"] == 3).all()
    rmax = min(lm.info.d_k, lm.info.d_v)
    untouched = res.rows[(res.rows["setting"] == sweep.UNIFORM) & (res.rows["r"] == rmax)]
    assert len(untouched) == 3 and res.untouched == pytest.approx(untouched["score"].mean())
    for _, x in t.iterrows():
        want = by_hand(res.rows, f"L{x['layer']}", untouched)
        for k in ("n", "score", "baseline", "delta", "se"):
            assert x[k] == pytest.approx(want[k], abs=1e-9), (x["layer"], k)
    # every answer stored: one per sample and setting (6 layers + untouched)
    assert res.computed == 7 * 3
    assert res.rows.groupby("setting").size().to_dict() == {**{f"L{l}": 3 for l in lm.info.gdn_layers},
                                                           sweep.UNIFORM: 3}


def test_scan_answers_are_the_sweeps_answers(lm, tmp_path):
    """A layer scan's cells are the cells of a sweep of that layer at r (and of the untouched model): a sweep after
    the scan finds all of them in the memo, and the scan run again generates nothing."""
    s = spec(n=2, layers=(5,))
    res = scan.run_scan(lm, s, store=tmp_path)
    assert res.computed == 2 * 2
    sw = sweep.SweepSpec(model="demo", tasks=(TASK,), lengths=(LENGTH,), ranks=(1,), n=2, heads="layers:5",
                         max_new_tokens=10)
    assert sweep.count_cached(lm.info, lm.tokenizer, sw, tmp_path) == (4, 4)
    rows = sweep.run_sweep(lm, sw, store=tmp_path)
    got = rows[rows["r"] == 1].set_index("seed")["score"]
    mine = res.rows[res.rows["setting"] == "L5"].set_index("seed")["score"]
    pd.testing.assert_series_equal(got, mine, check_names=False)
    again = scan.run_scan(lm, s, store=tmp_path)
    assert again.computed == 0
    pd.testing.assert_frame_equal(again.table, res.table)


def test_keep_one_is_paired_with_all_cut(lm, tmp_path):
    s = spec(keep=True, by="head", layers=(5,), n=3)
    res = scan.run_scan(lm, s, store=tmp_path)
    t = res.table
    assert t[["layer", "head"]].values.tolist() == [[5, 0], [5, 1]]
    all_cut = res.rows[(res.rows["setting"] == sweep.UNIFORM) & (res.rows["r"] == 1)]
    assert res.all_cut == pytest.approx(all_cut["score"].mean())
    for _, x in t.iterrows():
        want = by_hand(res.rows, f"L5H{x['head']}", all_cut)
        assert (x["baseline"], x["delta"], x["se"]) == pytest.approx((want["baseline"], want["delta"], want["se"]))
    # the kept head is absent from its map, every other GDN head is at r
    maps = dict(scan.unit_maps(s, lm.info))
    assert (5, 0) not in maps["L5H0"] and len(maps["L5H0"]) == 11 and set(maps["L5H0"].values()) == {1}
    # the all-cut baseline is a sweep of all heads at r = 1
    sw = sweep.SweepSpec(model="demo", tasks=(TASK,), lengths=(LENGTH,), ranks=(1,), n=3, max_new_tokens=10)
    assert sweep.count_cached(lm.info, lm.tokenizer, sw, tmp_path) == (6, 6)
    assert scan.ranked(t, keep=True)["delta"].is_monotonic_decreasing


def test_plan_counts_the_memo_and_uses_a_measured_rate(lm, tmp_path):
    s = spec(n=2, by="head", layers=(0,))
    p = scan.plan_scan(lm.info, lm.tokenizer, s, tmp_path)
    assert {k: p[k] for k in ("answers", "cached", "to_run", "settings", "units", "seconds", "missing")} == dict(
        answers=6, cached=0, to_run=6, settings=3, units=2, seconds=None, missing=[[TASK, LENGTH]])
    scan.run_scan(lm, spec(n=1, by="head", layers=(0,)), store=tmp_path)  # seed 0 of every setting
    p = scan.plan_scan(lm.info, lm.tokenizer, s, tmp_path)
    assert (p["cached"], p["to_run"]) == (3, 3)
    assert p["answers_per_second"] > 0 and p["seconds"] == pytest.approx(3 / p["answers_per_second"])


def test_bad_input_is_refused_before_running(lm, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(sweep, "batched_greedy", lambda *a, **k: calls.append(1))
    cases = [
        (dict(task="niah_single_9"), UnknownTask, "Unknown RULER task 'niah_single_9'"),
        (dict(layers=()), EmptyHeadSet, "no layers to scan"),
        (dict(r=0), RankOutOfRange, "rank 0 of the scan is outside 1..128"),
        (dict(r=129), RankOutOfRange, "rank 129 of the scan is outside 1..128"),
        (dict(r=128), RankOutOfRange, "r = 128 keeps every state untouched"),
        (dict(r=2.5), RankOutOfRange, "must be an integer"),
        (dict(layers=(3,)), ValueError, "layer 3 is not a Gated DeltaNet layer"),
        (dict(by="row"), ValueError, "not 'row'"),
        (dict(length=20), TaskTooShort, "needs a target length of at least"),
        (dict(n=3, max_prompts=20), TooManyPrompts, "would generate 21 answers (0 of 21 are in the memo), over the "
                                                    "limit of 20"),
    ]
    for kw, err, msg in cases:
        with pytest.raises(err, match=msg.replace("(", r"\(").replace(")", r"\)")):
            scan.run_scan(lm, spec(**kw), store=tmp_path)
    assert not calls and len(__import__("diskcache").Cache(str(tmp_path))) == 0


def test_ranked_orders_by_effect():
    t = pd.DataFrame(dict(layer=[0, 1, 2], head=pd.array([None] * 3, dtype="Int64"), r=1, n=5,
                          score=[90.0, 10.0, 50.0], baseline=100.0, delta=[-10.0, -90.0, -50.0], se=1.0))
    assert scan.ranked(t, keep=False)["layer"].tolist() == [1, 2, 0]
    assert scan.ranked(t, keep=True)["layer"].tolist() == [0, 2, 1]
    back = scan.table_frame(scan.table_records(t))
    pd.testing.assert_frame_equal(back, t.astype({"layer": int, "r": int, "n": int}))


def test_scan_heatmap_frame_fills_layer_rows():
    from gdnviz import figures as F

    t = pd.DataFrame(dict(layer=[0, 5], head=pd.array([None, 1], dtype="Int64"), r=1, n=4, score=[50.0, 0.0],
                          baseline=100.0, delta=[-50.0, -100.0], se=[np.nan, 0.0]))
    df = F.scan_heatmap_frame(t, (0, 1, 5), 2)
    assert df[["layer", "head", "unit"]].values.tolist() == [[0, 0, "layer 0"], [0, 1, "layer 0"], [5, 1, "5:1"]]
    spec_ = F.scan_heatmap(df, keep=False, title="t").to_dict()
    enc = spec_["encoding"]["color"]
    assert enc["scale"]["domainMid"] == 0 and enc["scale"]["domain"] == [-100.0, 100.0]
    assert any(t.get("field") == "se" for t in spec_["encoding"]["tooltip"])
