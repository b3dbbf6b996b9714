"""Next-token loss under truncation: token_nll against the model's own logits, copy_mask, loss_vs_rank."""
import numpy as np
import pytest
import torch

import tiny_models
from gdnviz.errors import EmptyDocumentSet, RankOutOfRange
from gdnviz.truncation import TruncationSpec
from gdnviz.models import from_model
from gdnviz.probes.loss import copy_mask, loss_vs_rank, token_nll


@pytest.fixture(scope="module")
def lm():
    return from_model(tiny_models.qwen3_5(), "qwen3_5")


def doc(T, seed):
    return torch.randint(0, 97, (T,), generator=torch.Generator().manual_seed(seed)).tolist()


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


def test_copy_mask_by_hand():
    #        t: 0  1  2  3  4  5  6  7  8
    x = [1, 2, 3, 4, 5, 1, 2, 9, 3, 4]
    # bigram (1,2) ends at 1, again at 6: 1 < 6 - 2 -> prediction 6 in the subset;
    # bigram (3,4) ends at 3, again at 9 = T-1: no next token to predict -> not in the mask (length T-1 = 9)
    m = copy_mask(x, min_distance=2)
    assert m.shape == (9,) and m.dtype == bool
    assert m.tolist() == [False] * 6 + [True] + [False] * 2
    # the same repeat closer than min_distance does not count
    assert not copy_mask(x, min_distance=5).any()
    # exactly min_distance + 1 earlier counts, min_distance earlier does not
    y = [7, 8, 0, 7, 8, 0]  # (7,8) at 1 and 4: distance 3
    assert copy_mask(y, min_distance=2)[4] and not copy_mask(y, min_distance=3)[4]
    assert copy_mask([5], 2).shape == (0,)


def test_loss_vs_rank(lm):
    docs = [doc(150, 1), doc(90, 2)]
    calls = []
    df = loss_vs_rank(lm, docs, ranks=[1, 4], segment_len=32, min_distance=8,
                      progress=lambda d, n: calls.append((d, n)))
    rmax = min(lm.info.d_k, lm.info.d_v)
    assert list(df.columns) == ["r", "loss", "delta", "copy_loss", "copy_delta", "n_tokens", "n_copy"]
    assert df["r"].tolist() == [1, 4, rmax]
    base = df[df.r == rmax].iloc[0]
    assert base["delta"] == 0 and base["copy_delta"] == 0
    assert (df["n_tokens"] == 149 + 89).all()
    plain = np.concatenate([token_nll(lm, d, segment_len=32) for d in docs])
    assert base["loss"] == pytest.approx(plain.mean(), abs=1e-9)
    np.testing.assert_allclose(df["delta"], df["loss"] - base["loss"])
    assert calls[-1] == (6, 6)


def test_loss_bad_inputs(lm):
    with pytest.raises(EmptyDocumentSet):
        loss_vs_rank(lm, [], ranks=[1])
    for bad in (0, 17, 2.5):  # 2.5 is refused, not rounded to 2
        with pytest.raises(RankOutOfRange):
            loss_vs_rank(lm, [doc(20, 0)], ranks=[bad])
