"""gdnviz.attribution.holds and the HoldsJob: the part of a state from beyond one segment and the rewrite rate,
against an independent numpy computation (a token-by-token recurrence with dense transitions, no decomposition),
and one real job on the bundled demo model through the worker's code path."""
import math

import numpy as np
import pytest
import torch

from gdnviz import jobs
from gdnviz.attribution import HeadInputs, decompose
from gdnviz.attribution.holds import beyond_segment, rewrite_rates, what_it_holds
from gdnviz.errors import BadSegmentLength, LayerNotGDN, ModelMismatch, PositionOutOfRange
from gdnviz.gdn import reference
from gdnviz.store import Store

F64 = dict(dtype=torch.float64)


def random_inputs(T=100, K=10, V=6, seed=0) -> HeadInputs:
    g = torch.Generator().manual_seed(seed)
    k = reference.l2_normalise(torch.randn(T, K, generator=g, **F64))
    q = reference.l2_normalise(torch.randn(T, K, generator=g, **F64)) * K ** -0.5
    return HeadInputs(q=q, k=k, v=torch.randn(T, V, generator=g, **F64), g=-torch.rand(T, generator=g, **F64) * 0.02,
                      beta=torch.rand(T, generator=g, **F64))


def np_transitions(inp):
    k, v, a, b = (x.numpy() for x in (inp.k, inp.v, inp.g.exp(), inp.beta))
    K = k.shape[1]
    return [a[t] * (np.eye(K) - b[t] * np.outer(k[t], k[t])) for t in range(len(b))], k, v, b


def np_states(inp, upto):
    """States after 0..upto tokens by S ← A_t S + β_t k_t v_tᵀ with dense A_t."""
    A, k, v, b = np_transitions(inp)
    S = [np.zeros((k.shape[1], v.shape[1]))]
    for t in range(upto):
        S.append(A[t] @ S[-1] + b[t] * np.outer(k[t], v[t]))
    return S


@pytest.mark.parametrize("position,L", [(100, 30), (64, 16), (37, 36), (20, 20), (10, 50)])
def test_beyond_segment_matches_numpy(position, L):
    inp = random_inputs()
    S = np_states(inp, position)
    A, *_ = np_transitions(inp)
    cutoff = position - L
    old = S[max(cutoff, 0)] if cutoff > 0 else np.zeros_like(S[0])  # the state L tokens back ...
    for t in range(max(cutoff, 0), position):                     # ... carried through the last L transitions
        old = A[t] @ old
    Sp = S[position]
    U, sig, Wh = np.linalg.svd(Sp, full_matrices=False)
    top = 3
    got = beyond_segment(decompose(inp, position), L, top)
    assert got["cutoff"] == cutoff
    np.testing.assert_allclose(got["energy_share"], (old * Sp).sum() / (Sp * Sp).sum(), rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(got["norm_ratio"], np.linalg.norm(old) / np.linalg.norm(Sp), rtol=1e-10, atol=1e-13)
    want = [U[:, i] @ old @ Wh[i] / sig[i] for i in range(top)]
    np.testing.assert_allclose(got["sigma_share"], want, rtol=1e-9, atol=1e-12)
    if cutoff <= 0:
        assert got["energy_share"] == 0 and got["sigma_share"] == [0.0] * top


def test_beyond_segment_with_a_carried_start_and_bad_input():
    inp = random_inputs()
    whole = beyond_segment(decompose(inp, 90), 40, 2)
    part = beyond_segment(decompose(inp, 90, start=30), 40, 2)
    assert part["cutoff"] == whole["cutoff"] and part["energy_share"] == pytest.approx(whole["energy_share"], rel=1e-9)
    assert part["sigma_share"] == pytest.approx(whole["sigma_share"], rel=1e-9)
    with pytest.raises(PositionOutOfRange, match="start 60 is after the segment cutoff 50"):
        beyond_segment(decompose(inp, 90, start=60), 40, 2)
    with pytest.raises(BadSegmentLength):
        beyond_segment(decompose(inp, 90), 0, 2)


@pytest.mark.parametrize("T,L", [(100, 25), (100, 30), (59, 30), (20, 25)])
def test_rewrite_rates_match_numpy(T, L):
    inp = random_inputs(T=T)
    S = np_states(inp, T)
    b, r = rewrite_rates(inp, L)
    want_b = list(range(2 * L, T + 1, L))
    assert b == want_b
    want = [np.linalg.norm(S[x] - S[x - L]) / np.linalg.norm(S[x - L]) for x in want_b]
    np.testing.assert_allclose(r, want, rtol=1e-10)


def test_rewrite_rate_of_a_frozen_state_is_zero_and_a_cleared_one_is_finite():
    inp = random_inputs(T=60)
    frozen = HeadInputs(q=inp.q, k=inp.k, v=inp.v, g=torch.zeros(60, **F64),
                        beta=torch.cat([inp.beta[:20], torch.zeros(40, **F64)]))
    assert rewrite_rates(frozen, 20)[1] == [0.0, 0.0]
    cleared = HeadInputs(q=inp.q, k=inp.k, v=inp.v, g=torch.cat([inp.g[:39], torch.tensor([-math.inf], **F64),
                                                                 inp.g[40:]]), beta=inp.beta)
    r = rewrite_rates(cleared, 20)[1]
    assert len(r) == 2 and all(np.isfinite(r))


def test_what_it_holds_summary_is_consistent():
    inp = random_inputs()
    res = what_it_holds(inp, 80, 25, top=3)
    assert len(res["norms"]) == 80 and len(res["shares"]) == 3 and all(len(s) == 80 for s in res["shares"])
    np.testing.assert_allclose([sum(s) for s in res["shares"]], res["sigma"], rtol=1e-10)
    np.testing.assert_allclose(res["state_norm"], np.linalg.norm(np_states(inp, 80)[80]), rtol=1e-12)
    assert res["rewrite"]["boundaries"] == [50, 75, 100] and res["beyond"]["cutoff"] == 55
    with pytest.raises(PositionOutOfRange, match="101"):
        what_it_holds(inp, 101, 25)


def test_rewrite_chart_marks_p_with_a_label_inside_the_plot():
    """The red rule is at p, the state decomposed (the document end by default, not always a boundary); its label
    sits on the side of the rule that is inside the axis, and the subtitle says which p it is."""
    from gdnviz.ui import holds_charts as HC

    inp = random_inputs()
    for p, where, align in ((100, "the document end", "right"), (75, "a segment boundary", "right"),
                            (30, "between two boundaries", "left")):
        spec = HC.rewrite_chart(what_it_holds(inp, p, 25, top=2)).to_dict(validate=True)
        rule, text = [lay for lay in spec["layer"] if lay["mark"]["type"] in ("rule", "text")]
        marks = {spec["datasets"][lay["data"]["name"]][0]["x"] for lay in (rule, text)}
        assert marks == {p} and text["mark"]["align"] == align
        assert spec["datasets"][text["data"]["name"]][0]["label"] == f"p = {p}"
        assert f"red: p = {p} ({where}), the state decomposed above" in spec["title"]["subtitle"]


# --- one real job on the demo model ---------------------------------------------------------------------------
TEXT = ("The archive kept every letter in a numbered box. The code word for the vault is heliotrope. "
        "Later the clerks moved the boxes twice and lost the index. ") * 6


def holds_spec(store, L=64, **kw):
    cap = jobs.run(jobs.CaptureJob(model="demo", documents=(("vault", TEXT),), segment_len=L, device="cpu",
                                   dtype="float32"), jobs.JobContext(store))
    run = store.run(cap["run_id"])
    d = run["documents"][0]
    base = dict(model="demo", document=("vault", TEXT), doc_key=d["key"], layer=5, head=1,
                position=d["n_tokens"], segment_len=L, device="cpu", dtype="float32")
    return run, jobs.HoldsJob(**{**base, **kw})


def test_holds_job_on_the_demo_model_end_to_end(tmp_path, one_thread):
    from gdnviz.capture import CaptureResult

    store = Store(tmp_path)
    run, spec = holds_spec(store)
    seen = []
    ctx = jobs.JobContext(store, progress=lambda d, n, t: seen.append(t))
    res = jobs.run(spec, ctx)
    T = run["documents"][0]["n_tokens"]
    assert not res["memo_hit"] and res["T"] == T == len(res["tokens"]) == len(res["norms"])
    assert any("decomposing" in s for s in seen)
    # the float64 state from the model's own inputs is the float32 capture's (its final state and boundary spectra)
    cap = CaptureResult.from_bytes(store.memo_get(run["documents"][0]["key"]))
    li = cap.gdn_layers.index(5)
    final = cap.final_state[li, 1].astype(np.float64)
    assert abs(res["state_norm"] - np.linalg.norm(final)) / np.linalg.norm(final) < 1e-5
    np.testing.assert_allclose(res["sigma"], cap.sv[-1, li, 1, :4], rtol=1e-4)
    # rewrite rates from the capture's boundary norms cannot be checked (it keeps spectra only), but ‖S_b‖ can:
    # ‖S_b − S_{b−L}‖ ≥ |‖S_b‖ − ‖S_{b−L}‖| (triangle inequality)
    norms = np.sqrt((cap.sv[:, li, 1].astype(np.float64) ** 2).sum(1))
    pos = list(cap.positions)
    for b, r in zip(res["rewrite"]["boundaries"], res["rewrite"]["rates"]):
        nb, na = norms[pos.index(b)], norms[pos.index(b - 64)]
        assert r >= abs(nb - na) / na - 1e-5
    from gdnviz.ui import holds_charts as HC  # the page's charts of this result are valid Vega-Lite

    for ch in (HC.along_chart(res), HC.directions_chart(res), HC.rewrite_chart(res)):
        ch.to_dict(validate=True)
    df = HC.contributions_frame(res)
    np.testing.assert_allclose(df[[f"share_{i}" for i in range(1, 5)]].sum(), res["sigma"], rtol=1e-9)
    assert HC.top_tokens(res, 5)["norm"].tolist() == sorted(res["norms"], reverse=True)[:5]
    again = jobs.run(spec, jobs.JobContext(store))
    assert again["memo_hit"] and again["norms"] == res["norms"]
    assert jobs.holds_key(spec.doc_key, 5, 1, T, 4, 64) == res["memo_key"]


def test_holds_job_refuses_bad_input_before_the_decomposition(tmp_path, one_thread):
    store = Store(tmp_path)
    run, spec = holds_spec(store, position=10 ** 6)
    with pytest.raises(PositionOutOfRange, match="1000000 is outside the document"):
        jobs.run(spec, jobs.JobContext(store))
    attn = run["model"]["attn_layers"][0]
    with pytest.raises(LayerNotGDN, match=f"layer {attn} .a full-attention layer."):
        jobs.run(holds_spec(store, layer=attn)[1], jobs.JobContext(store))
    _, other = holds_spec(store, document=("vault", TEXT + " More."))
    with pytest.raises(ModelMismatch, match="not the document the run captured"):
        jobs.run(other, jobs.JobContext(store))
