"""The segmented runner against the plain model and the plain segment-by-segment cache loop (every family)."""
import pytest
import torch

import tiny_models
from gdnviz import runner
from gdnviz.models import from_model

FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]


@pytest.fixture(scope="module", params=FAMILIES)
def lm(request):
    return from_model(getattr(tiny_models, request.param)(), request.param)


def exact_top_r(state, r):
    """Reference truncation for these tests: float64 SVD, keep the top-r left singular directions."""
    U, s, Vh = torch.linalg.svd(state.double())
    Ur = U[..., :r]
    return (Ur @ (Ur.transpose(-1, -2) @ state.double())).float()


def ids(T, seed=0, vocab=97):
    return torch.randint(0, vocab, (1, T), generator=torch.Generator().manual_seed(seed))


class Recorder:
    def __init__(self):
        self.final, self.bounds = {}, {}

    def on_boundary(self, layer, pos, state, rows=None):
        self.bounds[(layer, pos)] = state.clone()

    def on_layer_end(self, layer, pos, state):
        self.final[layer] = state.clone()


def test_describe(lm):
    info = lm.info
    assert info.gdn_layers and info.attn_layers
    assert set(info.gdn_layers).isdisjoint(info.attn_layers)
    assert (info.num_heads, info.num_key_heads, info.d_k, info.d_v) == (4, 2, 16, 16)
    assert info.kernel_path == "torch"


@pytest.mark.parametrize("L", [64, 100, 300])
def test_runner_matches_plain_forward(lm, L):
    x = ids(300)
    with torch.no_grad():
        ref = lm.model(input_ids=x).logits
    out = runner.forward(lm, x, segment_len=L, logits_positions="all")
    assert out.backends == {"torch"}
    torch.testing.assert_close(out.logits, ref.float(), atol=2e-5, rtol=1e-4)


def test_one_segment_vs_many(lm):
    x = ids(320, seed=1)
    one, many = Recorder(), Recorder()
    o1 = runner.forward(lm, x, segment_len=4096, callbacks=[one], logits_positions="all")
    o2 = runner.forward(lm, x, segment_len=64, callbacks=[many], logits_positions="all")
    torch.testing.assert_close(o1.logits, o2.logits, atol=2e-5, rtol=1e-4)
    for layer in lm.info.gdn_layers:
        torch.testing.assert_close(one.final[layer], many.final[layer], atol=1e-6, rtol=1e-4)
    assert not one.bounds and len(many.bounds) == 5 * len(lm.info.gdn_layers)


def test_runner_matches_cache_loop_untouched(lm):
    x = ids(256 + 37, seed=2)
    rec = Recorder()
    out = runner.forward(lm, x, segment_len=64, callbacks=[rec], logits_positions="all")
    seen = {}

    def look(layer, pos, state):
        seen[(layer, pos)] = state

    ref_logits, ref_states, _ = runner.cache_loop(lm, x, segment_len=64, on_boundary=look)
    torch.testing.assert_close(out.logits, ref_logits, atol=2e-5, rtol=1e-4)
    for layer in lm.info.gdn_layers:
        torch.testing.assert_close(rec.final[layer], ref_states[layer], atol=1e-6, rtol=1e-4)
    assert seen.keys() == rec.bounds.keys()
    for key in seen:
        torch.testing.assert_close(rec.bounds[key], seen[key], atol=1e-6, rtol=1e-4)


def test_runner_matches_cache_loop_truncated(lm):
    """Truncation at every boundary compounds identically in both: r=2 on every head of two GDN layers."""
    x = ids(64 * 4 + 10, seed=3)
    layers = set(lm.info.gdn_layers[:2])

    def cut(layer, pos, state):
        return exact_top_r(state, 2) if layer in layers else None

    class Cut:
        def on_boundary(self, layer, pos, state, rows=None):
            return cut(layer, pos, state)

    rec = Recorder()
    out = runner.forward(lm, x, segment_len=64, callbacks=[Cut(), rec], logits_positions="all")
    ref_logits, ref_states, _ = runner.cache_loop(lm, x, segment_len=64, on_boundary=cut)
    torch.testing.assert_close(out.logits, ref_logits, atol=5e-5, rtol=1e-4)
    for layer in lm.info.gdn_layers:
        torch.testing.assert_close(rec.final[layer], ref_states[layer], atol=1e-5, rtol=1e-4)
    plain = runner.forward(lm, x, segment_len=64, logits_positions="all")
    assert (plain.logits - out.logits).abs().max() > 1e-3, "truncation to rank 2 must change the output"


def test_truncation_at_full_rank_changes_nothing(lm):
    from gdnviz.truncation import TruncateCallback, TruncationSpec

    x = ids(200, seed=4)
    plain = runner.forward(lm, x, segment_len=64, logits_positions="all")
    spec = TruncationSpec.all_heads(lm.info, min(lm.info.d_k, lm.info.d_v))
    full = runner.forward(lm, x, segment_len=64, callbacks=[TruncateCallback(lm.info, spec)], logits_positions="all")
    assert torch.equal(plain.logits, full.logits)


def test_truncate_callback_matches_exact_cut(lm):
    from gdnviz.truncation import TruncateCallback, TruncationSpec

    x = ids(200, seed=5)
    spec = TruncationSpec.from_dict({(lm.info.gdn_layers[0], 1): 1, (lm.info.gdn_layers[-1], 3): 3})
    ours = runner.forward(lm, x, segment_len=64, callbacks=[TruncateCallback(lm.info, spec)], logits_positions="all")
    ranks = spec.as_dict()

    def cut(layer, pos, state):
        out = state.clone()
        for (l, h), r in ranks.items():
            if l == layer:
                out[:, h] = exact_top_r(state[:, h], r)
        return out

    ref_logits, _, _ = runner.cache_loop(lm, x, segment_len=64, on_boundary=cut)
    torch.testing.assert_close(ours.logits, ref_logits, atol=5e-5, rtol=1e-4)


def test_decode_continues_run_with_boundaries(lm):
    """Prefill + token-by-token decode through the cache == one run over the whole sequence (boundaries included)."""
    from gdnviz.truncation import TruncateCallback, TruncationSpec

    x = ids(140, seed=6)
    spec = TruncationSpec.all_heads(lm.info, 2)
    whole = runner.forward(lm, x, segment_len=64, callbacks=[TruncateCallback(lm.info, spec)], logits_positions="all")
    ctx = runner.RunContext(segment_len=64, callbacks=[TruncateCallback(lm.info, spec)])
    out = runner.forward(lm, x[:, :120], use_cache=True, logits_positions="all", ctx=ctx)
    steps = [out.logits[:, -1]]
    for t in range(120, 139):
        o = runner.forward(lm, x[:, t:t + 1], use_cache=True, cache=out.cache, logits_positions="last", ctx=ctx)
        steps.append(o.logits[:, -1])
    torch.testing.assert_close(torch.stack(steps, 1), whole.logits[:, 119:139], atol=5e-5, rtol=1e-4)


def test_bad_segment_length(lm):
    from gdnviz.errors import BadSegmentLength

    for bad in (0, -5, 2.5, "256"):
        with pytest.raises(BadSegmentLength):
            runner.forward(lm, ids(10), segment_len=bad)


def test_read_only_batched_callback_sees_every_boundary_on_cpu(one_thread):
    """A callback with only ``on_boundaries`` (read-only, batched) gets each boundary state on the CPU scan too,
    equal to what an ``on_boundary`` callback sees; CPU never takes the one-pass fla read-out."""
    from gdnviz.gdn import kernels

    lm = from_model(tiny_models.qwen3_5(), "tiny")
    x = torch.randint(0, 97, (1, 300), generator=torch.Generator().manual_seed(0))

    class Batched:
        modifies_state = False

        def __init__(self):
            self.got = []

        def on_boundaries(self, layer, positions, states):
            self.got += [(layer, p, s.clone()) for p, s in zip(positions, states)]

    class Single:
        def __init__(self):
            self.got = []

        def on_boundary(self, layer, pos, state, rows=None):
            self.got.append((layer, pos, state.clone()))

    b, s = Batched(), Single()
    runner.forward(lm, x, segment_len=64, callbacks=[b, s])
    assert [(l, p) for l, p, _ in b.got] == [(l, p) for l, p, _ in s.got]
    assert {p for _, p, _ in b.got} == {64, 128, 192, 256}
    for (_, _, x1), (_, _, x2) in zip(b.got, s.got):
        assert torch.equal(x1, x2)
    assert not kernels.states_fast_path(torch.device("cpu"), 300, [64, 128])
    assert runner.RunContext(64, [b]).dispatch.reads_only() and not runner.RunContext(64, [s]).dispatch.reads_only()
