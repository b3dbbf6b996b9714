"""gdnviz.attribution: the per-token decomposition of a GDN head's state and the head's exact attention map.

Float64 against the reference recurrence (gdnviz.gdn.reference) on random inputs, including gate endpoints
(α = 0, β = 0, β = 1) and a nonzero carried-in state; seed 003's worked examples through the decomposition; the
bundled demo model, whose float32 capture (gdnviz.capture) the float64 decomposition must match to float32
rounding; the bad inputs.
"""
import math

import numpy as np
import pytest
import torch

from gdnviz import attribution, runner
from gdnviz.attribution import HeadInputs, decompose, weights
from gdnviz.capture import capture_document
from gdnviz.errors import HeadOutOfRange, LayerNotGDN, PositionOutOfRange, WindowTooLarge
from gdnviz.gdn import reference
from gdnviz.models import load

F64 = dict(dtype=torch.float64)


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def random_inputs(T=120, K=12, V=7, seed=0, endpoints=False) -> HeadInputs:
    g = torch.Generator().manual_seed(seed)
    k = reference.l2_normalise(torch.randn(T, K, generator=g, **F64))
    q = reference.l2_normalise(torch.randn(T, K, generator=g, **F64)) * K ** -0.5
    v = torch.randn(T, V, generator=g, **F64)
    logd = -torch.rand(T, generator=g, **F64) * 0.2
    beta = torch.rand(T, generator=g, **F64)
    if endpoints:  # α = 0 (g = -inf) clears, β = 0 writes nothing, β = 1 overwrites
        logd[T // 3] = -math.inf
        beta[T // 2] = 0.0
        beta[T // 4] = 1.0
    return HeadInputs(q=q, k=k, v=v, g=logd, beta=beta)


def reference_run(inp: HeadInputs, p: int):
    return reference.recurrent(inp.q[:p, None], inp.k[:p, None], inp.v[:p, None], inp.g[:p, None],
                               inp.beta[:p, None])


# --- random inputs of the reference recurrence --------------------------------------------------------------
@pytest.mark.parametrize("endpoints", [False, True])
@pytest.mark.parametrize("position,start", [(120, 0), (77, 0), (120, 60), (1, 0), (5, 4)])
def test_contributions_sum_to_the_reference_state(position, start, endpoints):
    inp = random_inputs(endpoints=endpoints)
    c = decompose(inp, position, start)
    _, S = reference_run(inp, position)
    assert rel(c.total(), S[0]) < 1e-10 and rel(c.state, S[0]) < 1e-13
    assert c.tokens.tolist() == list(range(start, position))
    assert c.vectors.shape == (position - start, 12) and c.values.shape == (position - start, 7)
    torch.testing.assert_close(c.values, inp.beta[start:position, None] * inp.v[start:position], rtol=0, atol=0)
    if start == 0:
        assert not c.carried.any()
    else:  # carried = the start state pushed through the later transitions: the recurrence with zero values
        _, S0 = reference_run(inp, start)
        sl = slice(start, position)
        _, pushed = reference.recurrent(inp.q[sl, None], inp.k[sl, None], torch.zeros_like(inp.v[sl, None]),
                                        inp.g[sl, None], inp.beta[sl, None], initial_state=S0)
        assert rel(c.carried, pushed[0]) < 1e-10


def test_transported_keys_match_explicit_products():
    """vectors_t = A_{p-1} ⋯ A_{t+1} k_t with the transitions multiplied out as dense matrices."""
    inp = random_inputs(T=30, endpoints=True)
    c = decompose(inp, 30)
    K = inp.k.shape[1]
    P = torch.eye(K, **F64)
    for t in range(29, -1, -1):
        torch.testing.assert_close(c.vectors[t], P @ inp.k[t], rtol=1e-12, atol=1e-14)
        A = inp.g[t].exp() * (torch.eye(K, **F64) - inp.beta[t] * torch.outer(inp.k[t], inp.k[t]))
        P = P @ A


def test_norms_and_shares():
    inp = random_inputs(seed=3)
    c = decompose(inp, 100, 40)
    outer = torch.einsum("nk,nv->nkv", c.vectors, c.values)
    torch.testing.assert_close(c.norms, outer.flatten(1).norm(dim=1), rtol=1e-12, atol=0)
    shares, carried, sigma = c.shares(4)
    torch.testing.assert_close(sigma, torch.linalg.svdvals(c.state)[:4], rtol=1e-12, atol=0)
    torch.testing.assert_close(shares.sum(0) + carried, sigma, rtol=1e-10, atol=0)
    U, _, Wh = torch.linalg.svd(c.state)
    for i in range(4):  # ⟨c_t, u_i w_iᵀ⟩_F computed as the Frobenius inner product itself
        direct = (outer * torch.outer(U[:, i], Wh[i])).sum((1, 2))
        torch.testing.assert_close(shares[:, i], direct, rtol=1e-10, atol=1e-14)
    assert c.shares()[0].shape == (60, 7)
    with pytest.raises(ValueError, match="top must be in 1..7"):
        c.shares(8)


@pytest.mark.parametrize("endpoints", [False, True])
@pytest.mark.parametrize("start,end", [(0, 120), (50, 90), (119, 120), (0, 1)])
def test_map_reproduces_the_reference_output(start, end, endpoints):
    inp = random_inputs(endpoints=endpoints)
    w = weights(inp, start, end)
    assert w.shape == (end - start, end) and w.dtype == torch.float64
    out, _ = reference_run(inp, end)
    assert rel(w @ inp.v[:end], out[start:end, 0]) < 1e-10
    causal = torch.arange(end)[None, :] > torch.arange(start, end)[:, None]
    assert not w[causal].any()  # no query reads a later key


def test_map_entries_are_transported_key_reads():
    """w_{t,s} = β_s q_tᵀ P k_s with P the dense product, for a few (t, s); the diagonal is β_t q_tᵀ k_t."""
    inp = random_inputs(T=40, seed=5)
    w = weights(inp, 0, 40)
    K = inp.k.shape[1]
    for t, s in [(39, 0), (20, 13), (7, 7)]:
        P = torch.eye(K, **F64)
        for m in range(t, s, -1):
            P = P @ (inp.g[m].exp() * (torch.eye(K, **F64) - inp.beta[m] * torch.outer(inp.k[m], inp.k[m])))
        want = inp.beta[s] * inp.q[t] @ P @ inp.k[s]
        assert abs(float(w[t, s] - want)) <= 1e-13 * max(1.0, abs(float(want)))


def truncated_outputs_and_states(inp: HeadInputs, p: int):
    """Token-by-token recurrence with gdnviz.truncation.exact_truncate at every boundary b < p: outputs [p, V] and
    {b: pre-cut state after b tokens} including b = p."""
    from gdnviz.truncation import exact_truncate

    S = torch.zeros(1, 1, inp.k.shape[1], inp.v.shape[1], **F64)[0]
    outs, states = [], {}
    for t in range(p):
        o, S = reference.recurrent(inp.q[t:t + 1, None], inp.k[t:t + 1, None], inp.v[t:t + 1, None],
                                   inp.g[t:t + 1, None], inp.beta[t:t + 1, None], initial_state=S)
        outs.append(o[0, 0])
        states[t + 1] = S[0].clone()
        if inp.rank is not None and (t + 1) % inp.segment_len == 0 and t + 1 < p:
            S = exact_truncate(S, inp.rank)
    return torch.stack(outs), states


def truncated_outputs(inp: HeadInputs, p: int) -> torch.Tensor:
    return truncated_outputs_and_states(inp, p)[0]


def cut(inp: HeadInputs, rank=2, L=16) -> HeadInputs:
    return HeadInputs(q=inp.q, k=inp.k, v=inp.v, g=inp.g, beta=inp.beta, rank=rank, segment_len=L)


@pytest.mark.parametrize("position,start", [(120, 0), (96, 0), (101, 32), (120, 40), (33, 32)])
def test_truncated_contributions_sum_to_the_truncated_state(position, start):
    """Rank 2 every 16 tokens (positions 16, 32, …): the state after ``position`` tokens (pre-cut when it is a
    boundary) is the outer products with the cut projections inserted, plus the carried term."""
    inp = cut(random_inputs(endpoints=True))
    c = decompose(inp, position, start)
    _, states = truncated_outputs_and_states(inp, position)
    assert rel(c.total(), states[position]) < 1e-10 and rel(c.state, states[position]) < 1e-10
    untouched = decompose(random_inputs(endpoints=True), position, start)
    assert rel(untouched.total(), states[position]) > 1e-3  # the cuts matter here


@pytest.mark.parametrize("start,end", [(0, 120), (90, 97), (95, 96), (96, 97)])
def test_truncated_map_reproduces_the_truncated_output(start, end):
    inp = cut(random_inputs(seed=7))
    w = weights(inp, start, end)
    out = truncated_outputs(inp, end)
    assert rel(w @ inp.v[:end], out[start:end]) < 1e-10


# --- seed 003's worked examples ---------------------------------------------------------------------------
def seq(q, k, v, alpha, beta) -> HeadInputs:
    t = lambda x: torch.tensor(x, **F64)  # noqa: E731
    return HeadInputs(q=t(q), k=t(k), v=t(v), g=t(alpha).log(), beta=t(beta))


def old_state_12(next_key, next_value, alpha, beta, q=(1.0, 0.0)) -> HeadInputs:
    """Token 0 writes the old state [1, 2] (key [1,2]/√5, value √5, α = β = 1, from zero); token 1 is the
    example."""
    r5 = math.sqrt(5.0)
    return seq([q, q], [[1 / r5, 2 / r5], next_key], [[r5], [next_value]], [1.0, alpha], [1.0, beta])


def test_seed003_interference_the_minus_half_read_is_the_transported_old_key():
    """α = β = 1, unit key [1,1]/√2, target 0: state [1, 2] becomes [−½, ½]; query [1, 0] read 1, now reads
    −½, and all of it comes from token 0's key transported through token 1's transition (token 1 adds v = 0)."""
    r2 = math.sqrt(2.0)
    inp = old_state_12([1 / r2, 1 / r2], 0.0, 1.0, 1.0)
    c = decompose(inp, 2)
    torch.testing.assert_close(c.state[:, 0], torch.tensor([-0.5, 0.5], **F64), rtol=0, atol=1e-15)
    q = torch.tensor([1.0, 0.0], **F64)
    before = float(q @ decompose(inp, 1).state[:, 0])
    reads = (c.vectors @ q) * c.values[:, 0]       # each token's share of the read qᵀ S
    assert before == pytest.approx(1.0, abs=1e-15)
    assert reads[0] == pytest.approx(-0.5, abs=1e-15) and reads[1] == 0.0
    assert float(q @ inp.k[0]) * float(c.values[0, 0]) == pytest.approx(1.0, abs=1e-15)  # untransported: 1
    # the same split with the old state as the carried-in term (start = 1)
    c1 = decompose(inp, 2, start=1)
    assert float(q @ c1.carried[:, 0]) == pytest.approx(-0.5, abs=1e-15) and not c1.values.any()
    # and the map: the read of token 1's query is w_{1,0} v_0 = −½
    w = weights(inp, 1, 2)
    assert float(w[0, 0] * inp.v[0, 0]) == pytest.approx(-0.5, abs=1e-15)
    assert float(w[0, 1] * inp.v[1, 0]) == 0.0


def test_seed003_decay_before_residual():
    """Old state [1, 2], α = ½, β = 1, key [1, 0], value 3: the state is [3, 1]; the carried old state decays and
    loses its key component ([0, 1]), the new token writes [3, 0]."""
    inp = old_state_12([1.0, 0.0], 3.0, 0.5, 1.0)
    c = decompose(inp, 2, start=1)
    torch.testing.assert_close(c.total()[:, 0], torch.tensor([3.0, 1.0], **F64), rtol=0, atol=1e-15)
    torch.testing.assert_close(c.carried[:, 0], torch.tensor([0.0, 1.0], **F64), rtol=0, atol=1e-15)
    torch.testing.assert_close(torch.outer(c.vectors[0], c.values[0])[:, 0], torch.tensor([3.0, 0.0], **F64),
                               rtol=0, atol=1e-15)


def test_seed003_unnormalised_key_expands():
    """β = ½, k = 3, α = 1, v = 0 maps old state 1 to −7/2: the carried term is A = 1 − ½·9 times the old
    state."""
    inp = seq([[1.0], [1.0]], [[1.0], [3.0]], [[1.0], [0.0]], [1.0, 1.0], [1.0, 0.5])
    c = decompose(inp, 2, start=1)
    assert float(c.carried[0, 0]) == -3.5 and float(c.total()[0, 0]) == -3.5


def test_seed003_local_decay_in_the_readout():
    """Scalar k = q = 1, α = β = ½, values (4, 0): outputs (2, ½); the map is [[½, 0], [⅛, 0]]."""
    inp = seq([[1.0], [1.0]], [[1.0], [1.0]], [[4.0], [0.0]], [0.5, 0.5], [0.5, 0.5])
    w = weights(inp, 0, 2)
    torch.testing.assert_close(w, torch.tensor([[0.5, 0.0], [0.125, 0.5]], **F64), rtol=0, atol=0)
    torch.testing.assert_close((w @ inp.v)[:, 0], torch.tensor([2.0, 0.5], **F64), rtol=0, atol=0)


def test_seed003_same_terminal_state_different_holdings():
    """Scalar key 1, α = β = ½: histories (4, 0) and (0, 1) end in the same state ½, but the decomposition tells
    them apart: token 0 holds ½ in the first, 0 in the second."""
    a = decompose(seq([[1.0]] * 2, [[1.0]] * 2, [[4.0], [0.0]], [0.5, 0.5], [0.5, 0.5]), 2)
    b = decompose(seq([[1.0]] * 2, [[1.0]] * 2, [[0.0], [1.0]], [0.5, 0.5], [0.5, 0.5]), 2)
    assert float(a.state) == float(b.state) == 0.5
    held = lambda c: (c.vectors[:, 0] * c.values[:, 0]).tolist()  # noqa: E731
    assert held(a) == [0.5, 0.0] and held(b) == [0.0, 0.5]


# --- the bundled demo model -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo(one_thread):
    return load("demo", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def doc():
    return torch.randint(10, 8000, (1, 300), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def captured(demo, doc):
    return capture_document(demo, doc, segment_len=128)


@pytest.mark.parametrize("layer,head", [(0, 0), (5, 1)])
def test_demo_contributions_sum_to_the_state(demo, doc, layer, head):
    for position, start in [(300, 0), (256, 128)]:
        c = attribution.state_contributions(demo, doc, layer, head, position, start=start)
        assert rel(c.total(), c.state) < 1e-10
        assert c.tokens.tolist() == list(range(start, position))
        assert (start == 0) == (not c.carried.any())


def test_demo_truncated_decomposition_matches_the_truncated_run(demo, doc):
    """Every head of layers 0 and 5 cut to rank 4 at every 64 tokens: the decomposition of layer 5 head 1 with
    the cuts inserted sums to its float64 recurrence exactly, and matches the float32 truncated run's final state
    (float32 run, cuts by gdnviz.truncation's subspace path: measured ≈ 2e-7; tolerance 1e-5 as untruncated)."""
    from gdnviz.truncation import TruncateCallback, TruncationSpec

    spec = TruncationSpec.layers(demo.info, [0, 5], 4)
    finals = {}

    class Final:
        def on_layer_end(self, layer, position, state):
            finals[layer] = state[0].double()

    runner.forward(demo, doc, segment_len=64, callbacks=[TruncateCallback(demo.info, spec), Final()],
                   keep_hidden=False)
    c = attribution.state_contributions(demo, doc, 5, 1, 300, spec=spec, segment_len=64)
    assert rel(c.total(), c.state) < 1e-10
    assert rel(c.total(), finals[5][1]) < 1e-5, rel(c.total(), finals[5][1])
    w = attribution.attention_map(demo, doc, 5, 1, 250, 300, spec=spec, segment_len=64)
    inp = attribution.head_inputs(demo, doc, 5, 1, 300, spec=spec, segment_len=64)
    assert inp.rank == 4 and inp.segment_len == 64
    assert rel(w @ inp.v, truncated_outputs(inp, 300)[250:]) < 1e-10


@pytest.mark.parametrize("layer,head", [(0, 1), (6, 0)])
def test_demo_decomposition_matches_the_float32_capture(demo, doc, captured, layer, head):
    """The float64 decomposition against what the float32 capture recorded: the final state and the singular
    values at every boundary. Tolerance 1e-5 relative: the model's core runs in float32 (ε = 1.2e-7) over ≤ 300
    tokens of contracting transitions; later layers also see inputs from a segmented float32 run (measured
    ≈ 4e-7)."""
    li = captured.layer_ordinal(layer)
    c = attribution.state_contributions(demo, doc, layer, head, 300)
    assert rel(c.total(), torch.from_numpy(captured.final_state[li, head]).double()) < 1e-5
    inp = attribution.head_inputs(demo, doc, layer, head, 300)
    np.testing.assert_allclose(inp.g.numpy(), captured.g[li, head], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(inp.beta.numpy(), captured.beta[li, head].astype(np.float64), rtol=1e-3, atol=1e-4)
    for b, pos in enumerate(captured.positions.tolist()):
        _, _, sigma = decompose(inp, pos).shares()
        want = torch.from_numpy(captured.sv[b, li, head]).double()
        assert rel(sigma, want) < 1e-5, (pos, rel(sigma, want))


def test_demo_map_reproduces_the_core_output(demo, doc):
    inp = attribution.head_inputs(demo, doc, 4, 1, 300)
    w = attribution.attention_map(demo, doc, 4, 1, 200, 300)
    assert w.shape == (100, 300)
    out, _ = reference_run(inp, 300)
    assert rel(w @ inp.v, out[200:300, 0]) < 1e-10


def test_on_core_input_sees_what_on_layer_input_sees(demo, doc):
    seen = {}

    class Both:
        def on_layer_input(self, layer, offset, keys, g, beta):
            seen[layer, "layer"] = (keys.clone(), g.clone(), beta.clone())

        def on_core_input(self, layer, offset, queries, keys, values, g, beta):
            seen[layer, "core"] = (keys.clone(), g.clone(), beta.clone())
            assert queries.shape == keys.shape and values.shape[:3] == keys.shape[:3]
            assert queries.dtype == keys.dtype == torch.float32

    runner.forward(demo, doc[:, :40], segment_len=16, callbacks=[Both()], keep_hidden=False)
    for layer in demo.info.gdn_layers:
        for a, b in zip(seen[layer, "layer"], seen[layer, "core"]):
            assert torch.equal(a, b)


# --- bad input --------------------------------------------------------------------------------------------
def test_bad_requests_name_the_bad_value(demo, doc):
    with pytest.raises(LayerNotGDN, match=r"layer 3 \(a full-attention layer\).*\[0, 1, 2, 4, 5, 6\]"):
        attribution.state_contributions(demo, doc, 3, 0, 10)
    with pytest.raises(LayerNotGDN, match="layer 9 is not"):
        attribution.attention_map(demo, doc, 9, 0, 0, 10)
    with pytest.raises(HeadOutOfRange, match=r"head 2 .*0\.\.1"):
        attribution.state_contributions(demo, doc, 0, 2, 10)
    for p in (0, 301):
        with pytest.raises(PositionOutOfRange, match=rf"position {p} .*1\.\.300"):
            attribution.state_contributions(demo, doc, 0, 0, p)
    with pytest.raises(PositionOutOfRange, match="start 10 must be in 0..9"):
        attribution.state_contributions(demo, doc, 0, 0, 10, start=10)
    for s, e in [(5, 5), (0, 301), (-1, 4)]:
        with pytest.raises(PositionOutOfRange, match=rf"window \[{s}, {e}\)"):
            attribution.attention_map(demo, doc, 0, 0, s, e)


def test_window_too_large_is_refused_before_the_model_runs(demo):
    T = 17_000  # 17000² float64 = 2.15 GiB > the 2 GiB limit
    assert 8 * T * T > attribution.MAX_MAP_BYTES >= 8 * 16_000 * 16_000
    with pytest.raises(WindowTooLarge, match=r"17000 x 17000 float64 = 2\.15 GiB, over the 2 GiB limit"):
        attribution.attention_map(demo, torch.zeros(1, T, dtype=torch.long), 0, 0, 0, T)


# --- the command line -------------------------------------------------------------------------------------
def test_cli_attribute_writes_the_table(tmp_path, capsys, demo):
    """`gdnviz attribute`: one row per token from --start, with its text, norm and shares; the shares plus the
    carried share sum to the singular values in attribution.json; bad input is a message (exit 2)."""
    import json

    import pandas as pd

    from gdnviz.cli import main
    from gdnviz.documents import tokenize

    text = "The special magic number is 1234567. Remember it. The grass is green and the sky is blue."
    doc = tmp_path / "doc.txt"
    doc.write_text(text)
    ids = tokenize(demo.tokenizer, text)
    base = ["attribute", "demo", str(doc), "--layer", "4", "--head", "1", "--device", "cpu"]
    assert main([*base, "--position", "20", "--start", "5", "--top", "3", "--out", str(tmp_path / "o")]) == 0
    t = pd.read_csv(tmp_path / "o" / "contributions.csv", keep_default_na=False)
    meta = json.loads((tmp_path / "o" / "attribution.json").read_text())
    assert list(t.columns) == ["position", "token", "norm", "share_1", "share_2", "share_3"]
    assert t["position"].tolist() == list(range(5, 20))
    assert t["token"].tolist() == [demo.tokenizer.decode([i]) for i in ids[5:20]]
    c = attribution.state_contributions(demo, ids, 4, 1, 20, start=5)
    np.testing.assert_allclose(t["norm"].to_numpy(), c.norms.numpy(), rtol=1e-12)
    sums = t[["share_1", "share_2", "share_3"]].sum().to_numpy() + np.array(meta["carried_share"])
    np.testing.assert_allclose(sums, meta["sigma"], rtol=1e-10)
    assert meta["carried_norm"] > 0 and meta["residual"] < 1e-10 and meta["tokens"] == len(ids)
    capsys.readouterr()
    assert main([*base, "--position", str(len(ids) + 1), "--out", str(tmp_path / "x")]) == 2
    assert f"PositionOutOfRange: position {len(ids) + 1}" in capsys.readouterr().err
    assert main([*base[:3], "--layer", "7", "--head", "0", "--out", str(tmp_path / "x")]) == 2
    assert "layer 7 (a full-attention layer)" in capsys.readouterr().err
