"""Batched runs equal one-at-a-time runs: answers, per-token losses and final states, with and without truncation.

Prompts of different lengths whose left padding is not a multiple of L (pads 0, 33, 57, 130 with L = 32), so
each row's own boundaries fall at different absolute columns; one prompt is shorter than L and first reaches a
boundary while decoding.
"""
import pytest
import torch

import tiny_models
from gdnviz import runner
from gdnviz.errors import EmptyDocument, EmptyDocumentSet
from gdnviz.generate import greedy_generate
from gdnviz.truncation import TruncateCallback, TruncationSpec
from gdnviz.models import from_model
from gdnviz.probes.batch import batched_forward, batched_greedy, batched_token_nll, pad_left
from gdnviz.probes.loss import token_nll

L = 32
LENS = [150, 117, 93, 20]
NEW = 24


@pytest.fixture(scope="module")
def lm():
    return from_model(tiny_models.qwen3_5(), "qwen3_5")


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 97, (n,), generator=g).tolist() for n in LENS]


class Recorder:
    """Final states per layer and every boundary: (layer, position) -> rows that reached it."""

    def __init__(self):
        self.final, self.bounds = {}, {}

    def on_boundary(self, layer, position, state, rows=None):
        key = (layer, position)
        self.bounds.setdefault(key, []).extend([0] if rows is None else rows.tolist())

    def on_layer_end(self, layer, position, state):
        self.final[layer] = state.clone()


def alone_run(lm, prompt, fed, spec):
    """Reference: prefill + token-by-token decode of one prompt (batch 1, no padding); final states per layer."""
    rec = Recorder()
    cbs = ([TruncateCallback(lm.info, spec)] if spec is not None else []) + [rec]
    ctx = runner.RunContext(segment_len=L, callbacks=cbs)
    out = runner.forward(lm, torch.tensor([prompt]), use_cache=True, logits_positions="last", ctx=ctx)
    for t in fed:
        out = runner.forward(lm, torch.tensor([[t]]), use_cache=True, cache=out.cache, logits_positions="last",
                             ctx=ctx)
    return rec


def test_pad_left(prompts):
    ids, mask, starts = pad_left(prompts)
    assert ids.shape == (4, 150) and starts == [0, 33, 57, 130]
    assert all(s % L for s in starts[1:]), "padding must not be a multiple of L"
    for b, p in enumerate(prompts):
        assert ids[b, starts[b]:].tolist() == p and mask[b].sum() == len(p) and mask[b, :starts[b]].sum() == 0


def test_pads_are_the_core_noop_in_the_scan():
    """gdn_scan with row_starts: garbage (even NaN) q/k/v/g/beta at pads and a nonzero initial state -> each row
    equals its real tokens scanned alone. transformers' padding mask alone would not do this: at pads its
    gates are g = -exp(A_log) softplus(dt_bias) != 0 and beta = 1/2, which would decay a nonzero state."""
    torch.manual_seed(0)
    B, T, H, K, V = 3, 70, 2, 8, 8
    starts = [0, 21, 45]
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    v, g, beta = torch.randn(B, T, H, V), -torch.rand(B, T, H), torch.rand(B, T, H)
    for b, s in enumerate(starts):
        k[b, :s], g[b, :s], beta[b, :s] = float("nan"), -3.0, 0.9
    s0 = torch.randn(B, H, K, V)
    rec = Recorder()
    ctx = runner.RunContext(segment_len=16, callbacks=[rec], row_starts=starts)
    out, final = runner.gdn_scan(ctx, 0, q, k, v, g, beta, s0)
    assert torch.isfinite(out).all() and torch.isfinite(final).all()
    for b, s in enumerate(starts):
        rb = Recorder()
        c1 = runner.RunContext(segment_len=16, callbacks=[rb])
        o1, f1 = runner.gdn_scan(c1, 0, q[b:b + 1, s:], k[b:b + 1, s:], v[b:b + 1, s:], g[b:b + 1, s:],
                                 beta[b:b + 1, s:], s0[b:b + 1])
        torch.testing.assert_close(out[b:b + 1, s:], o1, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(final[b:b + 1], f1, atol=2e-5, rtol=1e-4)
        # each row's boundaries at its own multiples of 16, counted from its first real token
        mine = sorted(p for (_, p), rows in rec.bounds.items() if b in rows)
        assert mine == sorted(p for (_, p) in rb.bounds) == list(range(16, T - s + 1, 16))


def test_padding_leaves_conv_history_zero(lm, prompts):
    """The short conv's inputs (in_proj_qkv outputs) are exactly 0 at every pad: the conv history a padded row
    carries into its first real token is the zero history of a row alone."""
    seen = {}
    hooks = [mod.in_proj_qkv.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, o.detach().clone()))
             for i, mod in lm.adapter.gdn_modules(lm.model).items()]
    try:
        _, _, _, starts = batched_forward(lm, prompts, segment_len=L)
    finally:
        for h in hooks:
            h.remove()
    assert set(seen) == set(lm.info.gdn_layers)
    for out in seen.values():
        for b, s in enumerate(starts):
            assert torch.count_nonzero(out[b, :s]) == 0
            assert torch.count_nonzero(out[b, s:]) > 0


@pytest.mark.parametrize("truncate", [False, True], ids=["untouched", "rank2"])
def test_batched_equals_alone(lm, prompts, truncate):
    spec = TruncationSpec.all_heads(lm.info, 2) if truncate else None
    # answers: tokens equal greedy_generate alone
    rec = Recorder()
    gens = batched_greedy(lm, prompts, NEW, segment_len=L, spec=spec, stop_ids=set(), callbacks=[rec])
    for p, gen in zip(prompts, gens):
        ref = greedy_generate(lm, p, NEW, segment_len=L, spec=spec, stop_ids=set())
        assert gen.tokens == ref.tokens and len(gen.tokens) == NEW and gen.prompt_len == len(p)
    # final states (after prompt + NEW - 1 fed tokens) equal the plain one-prompt run
    for b, (p, gen) in enumerate(zip(prompts, gens)):
        ref = alone_run(lm, p, gen.tokens[:-1], spec)
        for layer in lm.info.gdn_layers:
            torch.testing.assert_close(rec.final[layer][b:b + 1], ref.final[layer], atol=3e-5, rtol=1e-4)
        # every row was cut at its own boundaries only
        mine = sorted({pos for (l, pos), rows in rec.bounds.items() if b in rows})
        assert mine == list(range(L, len(p) + NEW - 1 + 1, L))
    # per-token losses of each prompt equal token_nll alone
    for p, nll in zip(prompts, batched_token_nll(lm, prompts, segment_len=L, spec=spec)):
        ref = token_nll(lm, p, segment_len=L, spec=spec)
        assert nll.shape == ref.shape == (len(p) - 1,)
        assert abs(nll - ref).max() < 5e-5
    if truncate:  # the truncation is really on, and in the right places: absolute boundaries would differ
        out, _, _, starts = batched_forward(lm, prompts, segment_len=L, spec=spec, logits_positions="all")
        ctx = runner.RunContext(segment_len=L, callbacks=[TruncateCallback(lm.info, spec)], row_starts=[0] * 4)
        ids, mask, _ = pad_left(prompts)
        wrong = runner.forward(lm, ids, ctx=ctx, attention_mask=mask, logits_positions="all",
                               position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
        assert (wrong.logits[1, starts[1]:] - out.logits[1, starts[1]:]).abs().max() > 1e-3


def test_rows_stop_on_their_own(lm, prompts):
    alone = [greedy_generate(lm, p, 12, segment_len=L, stop_ids=set()) for p in prompts]
    stop = alone[2].tokens[4]  # row 2 stops early at its own 5th token
    gens = batched_greedy(lm, prompts, 12, segment_len=L, stop_ids={stop})
    for p, gen in zip(prompts, gens):
        assert gen.tokens == greedy_generate(lm, p, 12, segment_len=L, stop_ids={stop}).tokens
    assert len(gens[2].tokens) <= 4


def test_qwen3_next_batched_equals_alone():
    """2-D position ids path (Qwen3-Next takes them as they are; Qwen3.5 expands them to its mrope rows)."""
    nxt = from_model(tiny_models.qwen3_next(), "qwen3_next")
    g = torch.Generator().manual_seed(1)
    ps = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (70, 41)]
    spec = TruncationSpec.all_heads(nxt.info, 3)
    gens = batched_greedy(nxt, ps, 8, segment_len=L, spec=spec, stop_ids=set())
    for p, gen in zip(ps, gens):
        assert gen.tokens == greedy_generate(nxt, p, 8, segment_len=L, spec=spec, stop_ids=set()).tokens


def test_bad_batches(lm):
    with pytest.raises(EmptyDocumentSet):
        batched_greedy(lm, [], 4)
    with pytest.raises(EmptyDocument):
        batched_greedy(lm, [[1, 2, 3], []], 4)
