"""gdnviz.static_decode: decode steps through a StaticCache equal the runner's DynamicCache steps (CPU, every
family, batched, truncated, boundaries while decoding); on CUDA a step replayed from a CUDA graph equals the eager
static step bit for bit, and greedy answers equal the DynamicCache path's."""
import warnings

import pytest
import torch

import tiny_models
from gdnviz import runner, static_decode
from gdnviz.generate import greedy_generate
from gdnviz.truncation import TruncateCallback, TruncationSpec
from gdnviz.models import from_model
from gdnviz.probes.batch import batched_forward, batched_greedy

L = 16
LENS = [45, 30, 7]
STEPS = 20  # 45 + 20 crosses 48 and 64: boundaries while decoding, for every row at its own positions


class Recorder:
    """Every boundary a row reached (its own position) and the last state per layer."""

    def __init__(self):
        self.bounds, self.final = set(), {}

    def on_boundary(self, layer, position, state, rows=None):
        for b in ([0] if rows is None else rows.tolist()):
            self.bounds.add((layer, int(position), b))

    def on_layer_end(self, layer, position, state):
        self.final[layer] = state.clone()


def _prompts(n_lens, vocab=97, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in n_lens]


def _models():
    return {"qwen3_5": tiny_models.qwen3_5(), "qwen3_5_moe": tiny_models.qwen3_5_moe(),
            "qwen3_next": tiny_models.qwen3_next()}


def _decode_both(lm, prompts, spec):
    """Greedy-feed the same tokens through the DynamicCache runner steps and a StaticDecoder (both after the same
    batched prefill); returns (dynamic logits, static logits, recorders, decoder)."""
    res = []
    feed = None
    dec = None
    for form in ("dynamic", "static"):
        rec = Recorder()
        out, ctx, mask, starts = batched_forward(lm, prompts, segment_len=L, spec=spec, callbacks=[rec],
                                                 use_cache=True, logits_positions="last", keep_hidden=False)
        B = len(prompts)
        n_real = mask.sum(-1)
        logits = [out.logits[:, -1]]
        if form == "static":
            dec = static_decode.StaticDecoder(lm, ctx, out.cache, STEPS, attention_mask=mask, positions=n_real,
                                              graph=False)
        for i in range(STEPS):
            nxt = logits[-1].argmax(-1) if feed is None else feed[i]
            if form == "dynamic":
                mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], dim=1)
                out = runner.forward(lm, nxt.reshape(B, 1), use_cache=True, cache=out.cache,
                                     logits_positions="last", keep_hidden=False, ctx=ctx, attention_mask=mask,
                                     position_ids=(n_real + i).reshape(B, 1))
                logits.append(out.logits[:, -1])
            else:
                logits.append(dec.step(nxt))
        if feed is None:
            feed = [x.argmax(-1) for x in logits[:STEPS]]
        res.append((torch.stack(logits[1:]), rec, starts))
    return res[0], res[1], dec


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("truncate", [False, True], ids=["untouched", "rank3"])
def test_static_steps_equal_dynamic_steps(family, truncate):
    lm = from_model(_models()[family], family)
    spec = TruncationSpec.all_heads(lm.info, 3) if truncate else None
    prompts = _prompts(LENS)
    (dyn, rec_d, starts), (sta, rec_s, _), dec = _decode_both(lm, prompts, spec)
    assert dec.reason == "graph=False" and dec.replays == 0
    torch.testing.assert_close(sta, dyn, atol=1e-5, rtol=1e-5)
    # the same boundaries, at each row's own positions, while decoding too; the same final states
    assert rec_s.bounds == rec_d.bounds
    decoded = {(l, p, b) for (l, p, b) in rec_s.bounds if p > LENS[b]}
    assert {b for _, _, b in decoded} == {0, 1, 2}
    for layer in lm.info.gdn_layers:
        torch.testing.assert_close(rec_s.final[layer], rec_d.final[layer], atol=1e-5, rtol=1e-5)
    if truncate:  # the cuts matter: without them the logits differ
        (plain, _, _), _, _ = _decode_both(lm, prompts, None)
        assert (plain - dyn).abs().max() > 1e-3


def test_boundary_steps_are_the_eager_ones():
    """The steps a decoder would not replay are exactly those after which a row reaches its own boundary."""
    lm = from_model(tiny_models.qwen3_5(), "qwen3_5")
    spec = TruncationSpec.all_heads(lm.info, 3)
    prompts = _prompts(LENS)
    out, ctx, mask, starts = batched_forward(lm, prompts, segment_len=L, spec=spec, use_cache=True,
                                             logits_positions="last", keep_hidden=False)
    dec = static_decode.StaticDecoder(lm, ctx, out.cache, STEPS, attention_mask=mask, positions=mask.sum(-1),
                                      graph=False)
    P = mask.shape[1]
    flagged = [i for i in range(STEPS) if dec._at_boundary(P + i)]
    expect = [i for i in range(STEPS) if any((i + 1 + n) % L == 0 for n in LENS)]
    assert flagged == expect and flagged
    # no boundary callback: no step is a boundary step
    out, ctx, mask, _ = batched_forward(lm, prompts, segment_len=L, use_cache=True, logits_positions="last",
                                        keep_hidden=False)
    dec = static_decode.StaticDecoder(lm, ctx, out.cache, STEPS, attention_mask=mask, positions=mask.sum(-1),
                                      graph=False)
    assert not any(dec._at_boundary(P + i) for i in range(STEPS))


class EagerReplay:
    """A stand-in, on CPU, for the decoder's captured CUDA graph: ``replay()`` runs the step as the capture recorded
    it (a step after which no row had a boundary: the forward without boundary callbacks) into the decoder's output
    buffer and leaves the layers' token counts for ``StaticDecoder.step`` to advance, as a real replay does."""

    def __init__(self, dec):
        self.dec = dec

    def replay(self):
        ctx = self.dec.ctx
        before, callbacks = dict(ctx.offsets), ctx.callbacks
        ctx.callbacks = []
        try:
            self.dec.out = self.dec._forward()
        finally:
            ctx.callbacks = callbacks
            ctx.offsets.clear()
            ctx.offsets.update(before)


def _decode_fed(lm, prompts, spec, feed, replay: bool):
    """Logits ``[STEPS, B, vocab]`` and the decoder, the tokens ``feed`` fed after one batched prefill; ``replay``:
    every step "replayed" (``EagerReplay``), so boundaries are applied to the cache after the step."""
    out, ctx, mask, _ = batched_forward(lm, prompts, segment_len=L, spec=spec, use_cache=True,
                                        logits_positions="last", keep_hidden=False)
    dec = static_decode.StaticDecoder(lm, ctx, out.cache, STEPS, attention_mask=mask, positions=mask.sum(-1),
                                      graph=False)
    if replay:
        dec.reason, dec.graph = None, EagerReplay(dec)
    return torch.stack([dec.step(feed[i]) for i in range(STEPS)]), dec


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_boundaries_after_replayed_steps_equal_the_eager_steps(family, monkeypatch):
    """After a replayed step the rows that reached a boundary are cut in the StaticCache: every step's logits and
    every layer's final state equal the eager static steps' (which cut inside the step) bit for bit."""
    lm = from_model(_models()[family], family)
    spec = TruncationSpec.all_heads(lm.info, 3)
    prompts = _prompts(LENS)
    feed = [torch.tensor(x) for x in _prompts([len(LENS)] * STEPS, seed=1)]
    eager, e = _decode_fed(lm, prompts, spec, feed, replay=False)
    replayed, r = _decode_fed(lm, prompts, spec, feed, replay=True)
    assert e.boundary_replays == 0 and r.replays == STEPS
    P = e.P
    assert r.boundary_replays == sum(e._at_boundary(P + i) for i in range(STEPS)) > 0
    assert torch.equal(replayed, eager)
    for layer in lm.info.gdn_layers:
        assert torch.equal(lm.adapter.get_state(r.static, layer), lm.adapter.get_state(e.static, layer))
    # the cuts after the replays matter: without them the steps after a boundary differ
    monkeypatch.setattr(static_decode.StaticDecoder, "_cut_boundary_rows", lambda self, offset: None)
    uncut, _ = _decode_fed(lm, prompts, spec, feed, replay=True)
    assert (uncut - eager).abs().max() > 1e-4


def test_graph_reasons():
    lm = from_model(tiny_models.qwen3_5(), "qwen3_5")
    ctx = runner.RunContext(segment_len=L)
    assert static_decode.graph_reason(lm, ctx, "cpu") == "needs CUDA with fla"
    spec = TruncationSpec.all_heads(lm.info, 3)
    ctx = runner.RunContext(segment_len=L, callbacks=[TruncateCallback(lm.info, spec), Recorder()])
    assert static_decode.graph_reason(lm, ctx, "cpu") is not None


def test_bad_use():
    lm = from_model(tiny_models.qwen3_5(), "qwen3_5")
    prompts = _prompts([20])
    out, ctx, mask, _ = batched_forward(lm, prompts, segment_len=L, use_cache=True, logits_positions="last",
                                        keep_hidden=False)
    with pytest.raises(ValueError, match="steps"):
        static_decode.StaticDecoder(lm, ctx, out.cache, 0, attention_mask=mask, graph=False)
    with pytest.raises(ValueError, match="columns"):
        static_decode.StaticDecoder(lm, ctx, out.cache, 4, attention_mask=mask[:, 1:], graph=False)
    dec = static_decode.StaticDecoder(lm, ctx, out.cache, 1, graph=False)  # batch 1 without a mask
    dec.step([5])
    with pytest.raises(RuntimeError, match="1 steps"):
        dec.step([5])


# ---- CUDA: replays equal the eager static steps; greedy answers equal the DynamicCache path's ---------------------

def _eager_and_graphed(lm, prompts, spec):
    """Each step's logits ``[STEPS, B, vocab]`` after the same batched prefill, eager static steps
    (``outs[False]``) and with the graph (``outs[True]``), the eager run's greedy tokens fed to both; returns
    (outs, the graphed run's decoder)."""
    outs, feed = {}, None
    for graph in (False, True):
        out, ctx, mask, _ = batched_forward(lm, prompts, segment_len=L, spec=spec, use_cache=True,
                                            logits_positions="last", keep_hidden=False)
        dec = static_decode.StaticDecoder(lm, ctx, out.cache, STEPS, attention_mask=mask, positions=mask.sum(-1),
                                          graph=graph)
        logits, nxt = [], out.logits[:, -1].argmax(-1)
        for i in range(STEPS):
            logits.append(dec.step(nxt if feed is None else feed[i]))
            nxt = logits[-1].argmax(-1)
        if feed is None:
            feed = [out.logits[:, -1].argmax(-1)] + [x.argmax(-1) for x in logits]
        outs[graph] = torch.stack(logits)
    return outs, dec


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_graph_replay_equals_eager_static_on_gpu(family, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    lm = from_model(_models()[family].cuda(), family)
    spec = TruncationSpec.all_heads(lm.info, 3)
    prompts = _prompts(LENS)
    outs, dec = _eager_and_graphed(lm, prompts, spec)
    # which way it went shows in pytest's warnings summary (session.sh runs pytest without -s)
    warnings.warn(f"{family}: {dec.replays} of {STEPS} steps replayed; reason {dec.reason!r}")
    if family == "qwen3_5":  # the dense model's step must capture; the MoE routers may sync with the host
        assert dec.reason is None and dec.replays >= STEPS // 2, dec.reason
        assert dec.boundary_replays > 0  # boundaries after replays, cut in the cache (equal bit for bit below)
    else:  # either captured, or a clean fallback to eager static steps after a failed capture
        fell_back = dec.reason is not None and dec.reason.startswith(("capture failed", "an earlier capture failed"))
        assert (dec.reason is None and dec.replays >= STEPS // 2) or fell_back, dec.reason
    assert torch.equal(outs[True], outs[False])  # a replay is the eager static step bit for bit
    # greedy answers through the graph equal the DynamicCache path's (float32)
    gens = batched_greedy(lm, prompts, STEPS, segment_len=L, spec=spec, stop_ids=set())
    with monkeypatch.context() as m:  # no decoder: the DynamicCache steps (the path where the graph cannot be used)
        m.setattr(static_decode, "graph_reason", lambda *a: "test: DynamicCache steps")
        ref = batched_greedy(lm, prompts, STEPS, segment_len=L, spec=spec, stop_ids=set())
        one = greedy_generate(lm, prompts[0], STEPS, segment_len=L, spec=spec, stop_ids=set())
    assert [g.tokens for g in gens] == [g.tokens for g in ref]
    two = greedy_generate(lm, prompts[0], STEPS, segment_len=L, spec=spec, stop_ids=set())
    assert one.tokens == two.tokens == gens[0].tokens
    if family == "qwen3_5":
        assert "decode-graph" in two.readouts and "decode-graph" not in one.readouts


@pytest.mark.gpu
def test_decoders_leave_no_gpu_memory_behind():
    """A sweep builds one StaticDecoder (a StaticCache and a captured graph) per batch: once a generation returns,
    its cache and graph are freed, so hundreds of prompts do not accumulate device memory."""
    import gc

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    lm = from_model(tiny_models.qwen3_5().cuda(), "qwen3_5")
    spec = TruncationSpec.all_heads(lm.info, 3)
    prompts = _prompts(LENS)
    used = []
    for i in range(12):
        gens = batched_greedy(lm, prompts, STEPS, segment_len=L, spec=spec, stop_ids=set())
        assert all(len(g.tokens) == STEPS for g in gens)
        gc.collect()
        torch.cuda.synchronize()
        used.append(torch.cuda.memory_allocated())
    print("allocated after each generation:", used)
    assert max(used[2:]) - used[1] < 1 << 20, used


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_moe_decode_step_captures_in_bfloat16(family):
    """The mixture-of-experts families in bfloat16 with transformers' default experts implementation: the decode
    step is captured (on the H200 float32 falls back, bench/studies/study_moe_capture.py) with every head
    truncated at r = 3 (boundaries applied after replayed steps), and the replays equal the eager static steps bit for bit.
    A float32 failure of the same class must not stop a bfloat16 model from capturing (the failure memo is per
    class, dtype and experts implementation)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    static_decode._FAILED.clear()
    model = _models()[family]
    static_decode._FAILED[static_decode._failure_key(model)] = "float32 capture failed (simulated memo)"
    lm = from_model(model.to("cuda", torch.bfloat16), family)
    spec = TruncationSpec.all_heads(lm.info, 3)
    outs, dec = _eager_and_graphed(lm, _prompts(LENS), spec)
    assert dec.reason is None and dec.replays >= STEPS // 2, (dec.reason, dec.replays)
    assert torch.equal(outs[True], outs[False])
    static_decode._FAILED.clear()
