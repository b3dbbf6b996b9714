"""Per-head rank budgets: the one-sided paired test against scipy's t test, the state-memory accounting against the
Cache budget page's, the search on the demo model (CPU, float32) checked from its rows, JSON, bad input."""
import json

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from gdnviz.errors import EmptyDocumentSet, GDNVizError, RankOutOfRange, TooFewSamples, TooManyPrompts, UnknownTask
from gdnviz.probes import budget, sweep


@pytest.fixture(scope="module")
def lm():
    from gdnviz.models import load

    return load("demo", device="cpu", dtype="float32")


def bspec(**kw):
    d = dict(model="demo", tasks=("niah_single_1",), lengths=(512,), n=3, tolerance=5.0, ladder=(12, 1),
             max_new_tokens=10, batch_size=4)
    d.update(kw)
    return budget.BudgetSpec(**d)


@pytest.mark.parametrize("seed", range(6))
def test_noninferiority_is_scipys_one_sided_t_test(seed):
    """bound ≥ −δ exactly when the one-sided t test of H0: mean ≤ −δ rejects at α (scipy, another route)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 40))
    d = rng.choice([-100.0, 0.0, 100.0], size=n, p=[0.1, 0.85, 0.05]) + rng.normal(0, 3, size=n)
    for tol in (1.0, 5.0, 20.0):
        got = budget.noninferiority(d, tol, 0.05)
        assert got["n"] == n and got["delta"] == pytest.approx(d.mean())
        assert got["se"] == pytest.approx(np.sqrt(((d - d.mean()) ** 2).sum() / (n - 1) / n))
        p = stats.ttest_1samp(d + tol, 0.0, alternative="greater").pvalue
        assert got["passed"] == (p < 0.05), (tol, got, p)


def test_noninferiority_edge_cases():
    assert budget.noninferiority([0.0] * 5, 1.0, 0.05)["passed"]  # nothing changed: SE = 0, bound = 0
    one_flip = budget.noninferiority([-100.0] + [0.0] * 49, 1.0, 0.05)  # mean −2: fails δ = 1
    assert not one_flip["passed"] and one_flip["se"] == pytest.approx(100 / 50)
    with pytest.raises(TooFewSamples, match="needs n ≥ 2 samples"):
        budget.noninferiority([0.0], 1.0, 0.05)


def test_state_memory_by_hand_and_against_the_cache_budget_page(lm):
    from gdnviz.figures import cache_budget_frame

    info = lm.info
    assert (budget.head_numbers(1, 128, 128), budget.head_numbers(12, 128, 128)) == (256, 3072)
    assert budget.head_numbers(64, 128, 128) == 128 * 128  # 64·256 is not smaller than 128·128: kept full
    assert budget.head_numbers(128, 128, 128) == 128 * 128
    mem = budget.state_memory(info, {(5, 1): 12, (0, 0): 1, (0, 1): 1})
    assert mem["full_bytes"].tolist() == [2 * 128 * 128 * 4] * 6
    by_layer = dict(zip(mem["layer"], mem["budget_bytes"]))
    assert by_layer[0] == 2 * 256 * 4 and by_layer[5] == (3072 + 128 * 128) * 4 and by_layer[1] == 2 * 128 * 128 * 4
    page = cache_budget_frame(n_gdn=6, h_v=2, h_k=2, d_k=128, d_v=128, n_attn=2, h_kv=2, d_h=64, conv_kernel=4,
                              batch=1, b_state=4, b_kv=2, b_conv=2, contexts=[4096])
    assert mem["full_bytes"].sum() == page[page["cache"] == "GDN recurrent state"]["bytes"].iloc[0]
    assert budget.kv_bytes(info, (4096,)) == {4096: 2 * 2 * 2 * 64 * 4096 * 2}
    assert budget.state_memory(info, {}, "bfloat16")["full_bytes"].sum() == 6 * 2 * 128 * 128 * 2


def test_bad_input(lm, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(sweep, "batched_greedy", lambda *a, **k: calls.append(1))
    cases = [
        (dict(tasks=("vt", "nope")), UnknownTask, "Unknown RULER task 'nope'"),
        (dict(tasks=()), EmptyDocumentSet, "no tasks"),
        (dict(tolerance=0), ValueError, "tolerance must be a number of points > 0, got 0"),
        (dict(tolerance=-1.5), ValueError, "got -1.5"),
        (dict(n=1), TooFewSamples, "n = 1 is too small for the one-sided paired t test"),
        (dict(n_heldout=1), TooFewSamples, "held-out check needs n_heldout ≥ 2"),
        (dict(ladder=(12, 0)), RankOutOfRange, "rank 0 of the ladder is outside 1..128"),
        (dict(ladder=(200,)), RankOutOfRange, "rank 200 of the ladder"),
        (dict(ladder=(128,)), ValueError, "has no rank below 128"),
        (dict(max_prompts=10), TooManyPrompts, "over the limit of 10"),
    ]
    for kw, err, msg in cases:
        with pytest.raises(err, match=msg.replace("(", r"\(").replace(")", r"\)")):
            budget.find_budget(lm, bspec(**kw), store=tmp_path)
    assert not calls


def test_rank_map_json_round_trip(lm):
    text = budget.rank_map_json({(5, 1): 12, (0, 0): 1}, lm.info, tolerance=1.0)
    d = json.loads(text)
    assert d["format"] == "gdnviz-rank-map-v1" and d["ranks"] == [[0, 0, 1], [5, 1, 12]] and d["tolerance"] == 1.0
    assert budget.rank_map_from_json(text, lm.info) == {(0, 0): 1, (5, 1): 12}
    assert budget.rank_map_from_json("[[4, 1, 4]]", lm.info) == {(4, 1): 4}
    with pytest.raises(ValueError, match="layer 3 is not a Gated DeltaNet layer"):
        budget.rank_map_from_json('{"ranks": [[3, 0, 4]]}', lm.info)
    with pytest.raises(RankOutOfRange, match="rank 300 for layer 0 head 0 is outside 1..128"):
        budget.rank_map_from_json('{"ranks": [[0, 0, 300]]}', lm.info)
    with pytest.raises(GDNVizError, match="not JSON"):
        budget.rank_map_from_json("{", lm.info)


@pytest.mark.slow
def test_budget_search_on_the_demo_model(lm, tmp_path):
    """Every test the search reports is recomputed from the memoised rows; the final budget passes on the search
    samples; the held-out seeds are disjoint; a second call reads the stored result."""
    s = bspec(n=2, ladder=(1,), lengths=(384,))
    res = budget.find_budget(lm, s, store=tmp_path)
    rmax = 128
    assert all(1 <= r < rmax for r in res.ranks.values())
    assert res.search and all(x["passed"] for x in res.search)
    assert [x["n"] for x in res.heldout] == [2] and s.heldout_seed == 2
    # sensitivities: one row per head at the ladder's bottom rung
    assert len(res.sensitivity) == 12 and set(res.sensitivity["task"]) == {"niah_single_1"}
    # recompute every evaluation's test from the rows in the memo (all cached now)
    for ev in res.evaluations:
        ranks = {(l, h): r for l, h, r in ev["ranks"]}
        sw = sweep.SweepSpec(model="demo", tasks=s.tasks, lengths=s.lengths, ranks=(rmax,), n=s.n,
                             rank_maps=(("m", ranks),) if ranks else (), max_new_tokens=10, batch_size=4)
        assert sweep.count_cached(lm.info, lm.tokenizer, sw, tmp_path) == ((2 if ranks else 1) * 2,) * 2
        rows = sweep.run_sweep(lm, sw, store=tmp_path)
        a = rows[rows["setting"] == ("m" if ranks else "uniform")].set_index("seed")["score"]
        b = rows[(rows["setting"] == "uniform") & (rows["r"] == rmax)].set_index("seed")["score"]
        d = (a - b.loc[a.index]).to_numpy()
        p = stats.ttest_1samp(d + s.tolerance, 0.0, alternative="greater").pvalue if d.std() > 0 else \
            (0.0 if d.mean() > -s.tolerance else 1.0)
        assert ev["passed"] == (p < s.alpha), ev
    again = budget.find_budget(lm, s, store=tmp_path)
    assert again.extra.get("memo_hit") and again.ranks == res.ranks
    summ = budget.summary(res, lm.info)
    assert summ["state_bytes_full"] == 6 * 2 * 128 * 128 * 4
    assert summ["state_bytes_budget"] == int(res.memory["budget_bytes"].sum()) < summ["state_bytes_full"]
    t = budget.budget_table(res, lm.info)
    assert list(t.columns) == ["layer", "head", "r"] and len(t) == 12
    curve = budget.curve_frame([res], lm.info)
    assert set(curve["tolerance"]) == {0.0, 5.0}
    budget.curve_figure(curve).to_dict()


def test_curve_figure_reads_memory_in_a_human_unit():
    """The memory axis picks KiB / MiB / GiB from the largest state and says it in its title; the tooltip has the
    size as human_bytes writes it (docs/figures.md: numbers for people)."""
    from gdnviz.plotstyle import human_bytes

    def frame(kibs):
        return pd.DataFrame([dict(tolerance=float(i), state_kib=k, samples="search", task="vt", length=4096,
                                  score=90.0 - i, untouched=90.0, delta=-float(i), se=1.0, n=20)
                             for i, k in enumerate(kibs)])

    for kibs, unit, scale in (([24576.0, 6000.0], "MiB", 1024.0), ([96.0, 12.0], "KiB", 1.0),
                              ([3 * 2 ** 20, 2 ** 19], "GiB", 2.0 ** 20)):
        spec = budget.curve_figure(frame(kibs)).to_dict()
        pts = spec["layer"][1]["encoding"]
        assert pts["x"]["title"] == f"recurrent state per sequence ({unit}, all GDN heads)"
        data = next(iter(spec["datasets"].values()))
        assert [d["state"] for d in data] == pytest.approx([k / scale for k in kibs])
        assert [d["state_text"] for d in data] == [human_bytes(k * 1024) for k in kibs]
