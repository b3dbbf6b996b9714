"""Next-token loss under truncation: token_nll against the model's own logits; both copy-subset readings against a
brute-force search on random and adversarial sequences; the loss sweep on the bundled demo model against an
independent computation of the per-document paired statistics; its memo (a second run calls the model zero
times, the untouched losses are shared across head sets, an interrupted run resumes); bad input."""
import itertools
import math

import numpy as np
import pytest
import torch

import tiny_models
from gdnviz.documents import sample_documents, tokenize
from gdnviz.errors import DocumentTooShort, EmptyDocumentSet, RankOutOfRange
from gdnviz.models import from_model, load
from gdnviz.probes.loss import COPY_READINGS, copy_mask, token_nll
from gdnviz.probes.loss_sweep import (SUBSETS, TABLE_COLUMNS, LossSweepSpec, doc_key, loss_figure, loss_table,
                                      min_tokens, rows_frame, run_loss_sweep, table_frame)
from gdnviz.probes.sweep import records
from gdnviz.truncation import TruncationSpec


@pytest.fixture(scope="module")
def lm():
    return from_model(tiny_models.qwen3_5(), "qwen3_5")


def doc(T, seed, vocab=97):
    return torch.randint(0, vocab, (T,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_token_nll_is_cross_entropy_of_plain_logits(lm):
    x = doc(200, 0)
    with torch.no_grad():
        logits = lm.model(input_ids=torch.tensor([x])).logits[0].float()
    ref = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(x[1:]), reduction="none").double().numpy()
    rmax = min(lm.info.d_k, lm.info.d_v)
    for spec in (None, TruncationSpec.all_heads(lm.info, rmax)):
        nll = token_nll(lm, x, segment_len=64, spec=spec, chunk=37)  # chunking must not matter
        assert nll.shape == (199,) and nll.dtype == np.float64
        np.testing.assert_allclose(nll, ref, atol=5e-5, rtol=1e-5)
    cut = token_nll(lm, x, segment_len=64, spec=TruncationSpec.all_heads(lm.info, 1))
    assert np.abs(cut - ref).max() > 1e-4, "rank 1 must change the loss"


# --- the copy subsets ---------------------------------------------------------------------------------------------
def brute_copy_mask(x, d, reading):
    """The definitions of gdnviz.probes.loss, by exhaustive search over every earlier position."""
    T = len(x)
    out = []
    for t in range(T - 1):
        ends = [j for j in range(1, t) if (x[j - 1], x[j]) == (x[t - 1], x[t])] if t >= 1 else []
        if reading == "any":
            out.append(any(t - j > d for j in ends))
        else:
            out.append(bool(ends) and t - max(ends) > d)
    return np.array(out, dtype=bool)


def test_copy_mask_by_hand():
    #        t: 0  1  2  3  4  5  6  7  8
    x = [1, 2, 3, 4, 5, 1, 2, 9, 3, 4]
    # bigram (1,2) ends at 1, again at 6: 6 - 1 > 2 -> prediction 6 in the subset;
    # bigram (3,4) ends at 3, again at 9 = T-1: no next token to predict -> not in the mask (length T-1 = 9)
    for reading in COPY_READINGS:
        m = copy_mask(x, min_distance=2, reading=reading)
        assert m.shape == (9,) and m.dtype == bool
        assert m.tolist() == [False] * 6 + [True] + [False] * 2
        assert not copy_mask(x, min_distance=5, reading=reading).any()  # 5 back is not more than 5 back
    y = [7, 8, 0, 7, 8, 0]  # (7,8) at 1 and 4: distance 3; more than 2 back counts, 3 back does not
    assert copy_mask(y, min_distance=2)[4] and not copy_mask(y, min_distance=3)[4]
    assert copy_mask([5], 2).shape == (0,) and copy_mask([], 2).shape == (0,)
    # the readings differ: (1,2) at 1, 4 and 9; at 9 the first copy is 8 back, the most recent only 5
    z = [1, 2, 0, 1, 2, 0, 0, 0, 1, 2, 6]
    assert copy_mask(z, 6, "any")[9] and not copy_mask(z, 6, "recent")[9]
    assert copy_mask(z, 4, "recent")[9]


@pytest.mark.parametrize("reading", COPY_READINGS)
def test_copy_mask_matches_brute_force(reading):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, v, size=T).tolist() for v, T in ((2, 60), (3, 90), (5, 150), (50, 200), (400, 120))]
    seqs += [
        [7] * 40,                                       # one bigram everywhere (overlapping copies, distance 1)
        [1, 2] * 30,                                    # period 2
        list(range(9)) * 6,                             # period 9: every copy exactly 9 back
        list(range(10)) * 5 + [0, 1],                   # period 10, ending on a repeat
        [3, 4] + [0] * 9 + [3, 4] + [5] * 3 + [3, 4],   # copies 11 back then 5 back
        [1, 1, 2, 1, 1, 2, 1, 1],                       # (1,1) and (1,2) interleaved
        [5, 6], [5, 6, 5], [9, 9, 9],                   # the shortest documents
    ]
    for x, d in itertools.product(seqs, (0, 1, 2, 8, 9, 10, 30)):
        got = copy_mask(np.array(x), d, reading)  # numpy in, like a tensor or a list
        np.testing.assert_array_equal(got, brute_copy_mask(x, d, reading), err_msg=f"{x[:20]} d={d}")
        assert np.array_equal(got, copy_mask(torch.tensor(x), d, reading))
    for x in seqs:  # "recent" is a subset of "any"
        assert not (copy_mask(x, 5, "recent") & ~copy_mask(x, 5, "any")).any()


def test_copy_mask_bad_arguments():
    with pytest.raises(ValueError, match="'latest'"):
        copy_mask([1, 2, 3], 2, "latest")
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="min_distance"):
            copy_mask([1, 2, 3], bad)


# --- the sweep on the demo model ----------------------------------------------------------------------------------
L = 64  # segment length of these tests: documents of ~200 tokens cross 3 boundaries
D = 24  # copy-subset distance: short documents still have copies


class CountingStore(dict):
    """A plain dict memo that counts its writes."""

    def __init__(self):
        super().__init__()
        self.writes = 0

    def __setitem__(self, k, v):
        self.writes += 1
        super().__setitem__(k, v)


@pytest.fixture(scope="module")
def demo(one_thread):
    lm = load("demo", device="cpu", dtype="float32")
    calls = {"n": 0}
    lm.model.get_input_embeddings().register_forward_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
    return lm, calls


@pytest.fixture(scope="module")
def docs(demo):
    lm, _ = demo
    texts = [d.text for d in sample_documents()][:3]
    return [(f"doc{i}", tokenize(lm.tokenizer, t)[:n]) for i, (t, n) in enumerate(zip(texts, (210, 170, 150)))]


def independent_table(lm, docs, settings, d):
    """Per (setting, subset): per-document means, paired differences, their mean and std(ddof=1)/sqrt(n)."""
    per = {}
    for name, spec in settings.items():
        for j, (_, ids) in enumerate(docs):
            nll = token_nll(lm, ids, segment_len=L, spec=spec)
            for sub in SUBSETS:
                m = np.ones(len(nll), bool) if sub == "all" else brute_copy_mask(ids, d, sub[5:])
                per[(name, sub, j)] = nll[m].mean() if m.any() else None
    out = {}
    for name, sub in itertools.product(settings, SUBSETS):
        js = [j for j in range(len(docs)) if per[(name, sub, j)] is not None]
        diff = [per[(name, sub, j)] - per[("untouched", sub, j)] for j in js]
        loss = sum(per[(name, sub, j)] for j in js) / len(js)
        mean = sum(diff) / len(diff)
        var = sum((x - mean) ** 2 for x in diff) / (len(diff) - 1)
        out[(name, sub)] = dict(n_docs=len(js), loss=loss, delta=mean, se=math.sqrt(var / len(diff)))
    return out


def test_loss_sweep_table_against_an_independent_computation(demo, docs):
    lm, calls = demo
    spec = LossSweepSpec(ranks=(1, 4), segment_len=L, min_distance=D)
    store, prog = CountingStore(), []
    rows = run_loss_sweep(lm, docs, spec, store=store, progress=lambda a, b: prog.append((a, b)))
    assert len(rows) == 9 and store.writes == 9 and prog[-1] == (9, 9)  # 3 documents x (1, 4, untouched 128)
    assert rows["r"].tolist() == [1, 4, 128] * 3 and rows["n_all"].tolist() == [209] * 3 + [169] * 3 + [149] * 3
    table = loss_table(rows)
    assert list(table.columns) == TABLE_COLUMNS and len(table) == 9
    assert table["r"].tolist() == [1] * 3 + [4] * 3 + [128] * 3 and table["subset"].tolist() == list(SUBSETS) * 3
    ref = independent_table(lm, docs, {"untouched": None, 1: TruncationSpec.all_heads(lm.info, 1),
                                       4: TruncationSpec.all_heads(lm.info, 4)}, D)
    for _, t in table.iterrows():
        name = "untouched" if t["r"] == 128 else int(t["r"])
        want = ref[(name, t["subset"])]
        assert t["n_docs"] == want["n_docs"] and t["n_docs"] >= 2, t.to_dict()
        assert t["loss"] == pytest.approx(want["loss"], abs=1e-9)
        assert t["delta"] == pytest.approx(want["delta"], abs=1e-9)
        assert t["se"] == pytest.approx(want["se"], abs=1e-9)
        assert t["delta_pct"] == pytest.approx(100 * t["delta"] / t["untouched"])
    assert (table[table.r == 128][["delta", "se"]] == 0).all().all()
    assert table.loc[(table.r == 1) & (table.subset == "all"), "delta"].item() > 0  # rank 1 costs loss
    # the copy subsets are those of copy_mask, and "recent" has no more predictions than "any"
    n = {s: table.loc[(table.r == 128) & (table.subset == s), "n_predictions"].item() for s in SUBSETS}
    assert n["all"] == 209 + 169 + 149 and 0 < n["copy_recent"] <= n["copy_any"] < n["all"]
    assert n["copy_any"] == sum(int(copy_mask(ids, D, "any").sum()) for _, ids in docs)
    # worker results round-trip through JSON records
    import pandas as pd

    pd.testing.assert_frame_equal(table_frame(records(table)), table)
    pd.testing.assert_frame_equal(rows_frame(records(rows)), rows)
    chart = loss_figure(table, title="demo", min_distance=D).to_dict()
    assert chart["hconcat"][0]["title"] == "loss" and "paired standard error over 3 documents" in \
        chart["title"]["subtitle"][0]

    # the same sweep again: every (document, setting) from the memo, no model call, the same rows
    before = calls["n"]
    again = run_loss_sweep(lm, docs, spec, store=store)
    assert calls["n"] == before and store.writes == 9
    pd.testing.assert_frame_equal(again, rows)
    # another head set and a rank map: the untouched losses are reused, only the new settings run
    spec2 = LossSweepSpec(ranks=(1,), heads="layers:0,1", rank_maps={"early": {(0, 0): 2, (0, 1): 2}},
                          segment_len=L, min_distance=D)
    rows2 = run_loss_sweep(lm, docs, spec2, store=store)
    assert store.writes == 9 + 3 * 2 and calls["n"] == before + 3 * 2
    t2 = loss_table(rows2)
    assert set(t2["setting"]) == {"uniform", "early"} and t2["r"].isna().sum() == 3
    untouched = table[table.r == 128].reset_index(drop=True)
    pd.testing.assert_frame_equal(t2[t2.r == 128].reset_index(drop=True), untouched)
    # a different copy distance needs no model call either: the subsets come from the stored per-token losses
    t3 = loss_table(run_loss_sweep(lm, docs, LossSweepSpec(ranks=(1, 4), segment_len=L, min_distance=5),
                                   store=store))
    assert calls["n"] == before + 6 and (t3["n_predictions"] >= table["n_predictions"]).all()


def test_interrupted_loss_sweep_resumes(demo, docs, tmp_path):
    """A cancel (a progress callback that raises) after 4 of 6 entries; the rerun on the same diskcache directory
    computes only the other 2."""
    lm, calls = demo
    spec = LossSweepSpec(ranks=(12,), segment_len=L, min_distance=D)

    def stop_at_4(done, total):
        if done == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_loss_sweep(lm, docs, spec, store=tmp_path / "memo", progress=stop_at_4)
    before = calls["n"]
    rows = run_loss_sweep(lm, docs, spec, store=tmp_path / "memo")
    assert calls["n"] == before + 2 and len(rows) == 6
    # keys: one per (document, truncation); the untouched key does not depend on the head set
    ids = docs[0][1]
    assert doc_key(lm.info, ids, None, L) == doc_key(lm.info, list(ids), None, L)
    assert len({doc_key(lm.info, ids, None, L), doc_key(lm.info, ids, None, 128), doc_key(lm.info, ids[:-1], None, L),
                doc_key(lm.info, ids, TruncationSpec.all_heads(lm.info, 4), L)}) == 4


def test_loss_sweep_bad_input(demo, docs):
    lm, calls = demo
    before = calls["n"]
    spec = LossSweepSpec(ranks=(1,), segment_len=L)
    with pytest.raises(EmptyDocumentSet, match="at least one document"):
        run_loss_sweep(lm, [], spec)
    for bad in (0, 129, 2.5):  # 2.5 is refused, not rounded to 2
        with pytest.raises(RankOutOfRange, match=f"rank {bad}|got {bad}"):
            run_loss_sweep(lm, docs, LossSweepSpec(ranks=(bad,), segment_len=L))
    with pytest.raises(RankOutOfRange, match="rank 300 for layer 0 head 0"):
        run_loss_sweep(lm, docs, LossSweepSpec(rank_maps={"big": {(0, 0): 300}}, segment_len=L))
    with pytest.raises(ValueError, match="layer 3 is not a Gated DeltaNet layer"):
        run_loss_sweep(lm, docs, LossSweepSpec(heads="3:0", segment_len=L))
    short = [docs[0], ("tiny", docs[1][1][:L + 1])]
    assert min_tokens(L) == L + 2
    with pytest.raises(DocumentTooShort, match=r"document 'tiny' has 65 tokens; loss vs rank needs at least 66"):
        run_loss_sweep(lm, short, spec)
    with pytest.raises(ValueError, match="copy-subset distance"):
        run_loss_sweep(lm, docs, LossSweepSpec(segment_len=L, min_distance=-1))
    assert calls["n"] == before  # every refusal comes before any model call
    with pytest.raises(EmptyDocumentSet):
        loss_table(rows_frame([]))
