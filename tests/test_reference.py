"""The float64 GDN core reference (gdnviz.gdn.reference) against seed 003's worked examples and itself.

Seed 003 writes the single-head state value-first, ``[d_v, d_k]`` with column vectors; the reference keeps the
canonical ``[K, V]`` layout (transformers' cache, fla ``state_v_first=False``). Translating an example means
transposing its state: seed state ``[1, 2]`` (d_v = 1, d_k = 2) is ``[[1], [2]]`` here.
"""

from __future__ import annotations

import math

import pytest
import torch

from gdnviz.gdn import reference as ref

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")


def t64(x):
    return torch.tensor(x, dtype=F64)


def one_head(q, k, v, alpha, beta, state=None):
    """Seed-style single-head inputs → reference shapes (T tokens, H = 1). Returns (q, k, v, g, beta, S0).

    ``q, k``: lists of K-vectors; ``v``: list of V-vectors; ``alpha, beta``: lists of scalars; ``state``: [K, V].
    """
    q, k, v = t64(q)[:, None, :], t64(k)[:, None, :], t64(v)[:, None, :]
    g = torch.log(t64(alpha))[:, None]                  # α = 0 → g = -inf, exact
    b = t64(beta)[:, None]
    S0 = None if state is None else t64(state)[None]
    return q, k, v, g, b, S0


def both(q, k, v, g, b, S0, chunk_sizes=(1, 2, 64)):
    """Run recurrent and chunked (several chunk sizes); yield (name, out, final)."""
    yield ("recurrent", *ref.recurrent(q, k, v, g, b, S0))
    for c in chunk_sizes:
        yield (f"chunked[{c}]", *ref.chunked(q, k, v, g, b, S0, chunk_size=c))


def assert_close(a, b, tol=1e-12, what=""):
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    assert diff <= tol, f"{what}: max abs diff {diff:.3e} > {tol:.0e}"


# ------------------------------------------------------------------------------------------------
# Seed 003 §2: gate order. Old state [1, 2], α = 1/2, β = 1, key [1, 0], value 3.
# ------------------------------------------------------------------------------------------------
def test_gate_order_decay_before_residual():
    state_seed = [1.0, 2.0]                                  # seed layout [d_v=1, d_k=2]
    S0 = [[x] for x in state_seed]                           # ours [K=2, V=1]
    key, value, alpha, beta = [1.0, 0.0], [3.0], 0.5, 1.0
    inputs = one_head([[0.0, 0.0]], [key], [value], [alpha], [beta], S0)

    # the wrong order (delta on the undecayed state, then decay everything) computed here, for contrast
    S = t64(S0)
    k = t64(key)[:, None]
    wrong = alpha * (S + k * (beta * (t64(value) - S.T @ t64(key))))
    assert torch.equal(wrong[:, 0], t64([1.5, 1.0]))          # the seed's [3/2, 1]

    for name, _, final in both(*inputs):
        got = final[0, :, 0]
        assert_close(got, t64([3.0, 1.0]), what=name)         # decay → [1/2, 1], residual 5/2 → [3, 1]
        assert not torch.allclose(got, wrong[:, 0]), name


# ------------------------------------------------------------------------------------------------
# Seed 003 §2: interference. α = β = 1, key [1, 1]/√2, value 0, state [1, 2] → [−1/2, 1/2].
# ------------------------------------------------------------------------------------------------
def test_nonorthogonal_key_changes_another_querys_read():
    s = 1 / math.sqrt(2)
    S0 = [[1.0], [2.0]]
    query = [1.0, 0.0]
    inputs = one_head([query], [[s, s]], [[0.0]], [1.0], [1.0], S0)
    before = (t64(query) @ t64(S0))[0].item()
    assert before == 1.0                                      # query [1, 0] read 1 before the write
    for name, out, final in both(*inputs):
        assert_close(final[0, :, 0], t64([-0.5, 0.5]), what=name)
        assert_close(out[0, 0], t64([-0.5]), what=name)       # …and reads −1/2 after it


# ------------------------------------------------------------------------------------------------
# Seed 003 §4: two value histories, one terminal state. Scalar key 1, α = β = 1/2, zero initial state.
# ------------------------------------------------------------------------------------------------
def test_two_histories_same_terminal_state():
    alpha = beta = 0.5
    # s1 = β v1;  s2 = αβ(1−β) v1 + β v2 = v1/8 + v2/2. History A = (4, 0); history B starts with 0 and its
    # second value makes up the difference: v2_B = v2_A + α(1−β)(v1_A − v1_B) = 1.
    v1_a, v2_a, v1_b = 4.0, 0.0, 0.0
    v2_b = v2_a + alpha * (1 - beta) * (v1_a - v1_b)
    hist_a = one_head([[1.0], [1.0]], [[1.0], [1.0]], [[v1_a], [v2_a]], [alpha] * 2, [beta] * 2)
    hist_b = one_head([[1.0], [1.0]], [[1.0], [1.0]], [[v1_b], [v2_b]], [alpha] * 2, [beta] * 2)
    for (name, out_a, fin_a), (_, out_b, fin_b) in zip(both(*hist_a), both(*hist_b)):
        assert_close(fin_a, t64([[[0.5]]]), what=name)
        assert_close(fin_b, t64([[[0.5]]]), what=name)
        # the histories differ (and were read differently along the way), the terminal state cannot tell
        assert abs(out_a[0, 0, 0].item() - out_b[0, 0, 0].item()) > 1.0
        assert_close(out_a[-1], out_b[-1], what=name)         # same final read for the same query


# ------------------------------------------------------------------------------------------------
# Seed 003 §3: unnormalised keys. β = 1/2, scalar k = 3, α = 1, v = 0 maps old state 1 to −7/2.
# ------------------------------------------------------------------------------------------------
def test_unnormalised_key_amplifies():
    for key, expected in ((3.0, -3.5), (1.0, 0.5)):          # unit key: 1 − β = 1/2, a contraction
        inputs = one_head([[0.0]], [[key]], [[0.0]], [1.0], [0.5], [[1.0]])
        for name, _, final in both(*inputs):
            assert_close(final, t64([[[expected]]]), what=f"{name}, k={key}")


# ------------------------------------------------------------------------------------------------
# Seed 003 §6: chunk readout with diagonal and local decay. k = q = 1, α = β = 1/2, values (4, 0).
# ------------------------------------------------------------------------------------------------
def test_chunk_readout_diagonal_and_local_decay():
    inputs = one_head([[1.0], [1.0]], [[1.0], [1.0]], [[4.0], [0.0]], [0.5, 0.5], [0.5, 0.5])
    for name, out, _ in both(*inputs, chunk_sizes=(1, 2)):
        assert_close(out[:, 0, 0], t64([2.0, 0.5]), what=name)
    # the broken readout (no local decay) gives the seed's wrong 3/2 for the second token
    wrong, _ = chunked_variant(*inputs, chunk_size=2, local_decay=False)
    assert_close(wrong[:, 0, 0], t64([2.0, 1.5]), what="no local decay")


# ------------------------------------------------------------------------------------------------
# Seed 003 §4: three different "ignore" operations.
# ------------------------------------------------------------------------------------------------
def test_noop_decay_and_clear_are_different():
    gen = torch.Generator().manual_seed(3)
    K, V = 3, 2
    S0 = torch.randn(K, V, generator=gen, dtype=F64)
    k = ref.l2_normalise(torch.randn(K, generator=gen, dtype=F64), eps=0.0)
    v = torch.randn(V, generator=gen, dtype=F64)
    q = torch.randn(K, generator=gen, dtype=F64)

    def step(alpha, beta):
        inputs = one_head([q.tolist()], [k.tolist()], [v.tolist()], [alpha], [beta], S0.tolist())
        return [(name, fin[0]) for name, _, fin in both(*inputs)]

    for name, fin in step(1.0, 0.0):                           # α = 1, β = 0: the core no-op
        assert_close(fin, S0, what=f"no-op {name}")
    for name, fin in step(0.3, 0.0):                           # β = 0, α < 1: no write, but old state decays
        assert_close(fin, 0.3 * S0, what=f"decay {name}")
        assert (fin - S0).abs().max() > 0.1
    for name, fin in step(0.0, 1.0):                           # α = 0 clears; the current token still writes
        assert_close(fin, torch.outer(k, v), what=f"clear {name}")


# ------------------------------------------------------------------------------------------------
# Seed 003 §5: packed independent samples and cache reset.
# ------------------------------------------------------------------------------------------------
def random_inputs(T, H, K, V, regime="interior", seed=0, state=True):
    """Random reference inputs: unit keys, queries scaled by K**-0.5, gates per regime, nonzero state."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, K, generator=gen, dtype=F64) * K**-0.5
    k = ref.l2_normalise(torch.randn(T, H, K, generator=gen, dtype=F64), eps=0.0)
    v = torch.randn(T, H, V, generator=gen, dtype=F64)
    u = torch.rand(T, H, generator=gen, dtype=F64)
    w = torch.rand(T, H, generator=gen, dtype=F64)
    if regime == "interior":                                   # α ∈ (0.5, 1), β ∈ (0, 1)
        alpha, beta = 0.5 + 0.5 * u, w
    elif regime == "endpoints":                                # teaching endpoints, mixed
        alpha, beta = (u < 0.5).to(F64), (w < 0.5).to(F64)
    elif regime == "strong_decay":                             # α ∈ (0, 0.1)
        alpha, beta = 0.1 * u, w
    else:
        raise ValueError(regime)
    g = torch.log(alpha)
    S0 = torch.randn(H, K, V, generator=gen, dtype=F64) if state else None
    return q, k, v, g, beta, S0


def test_packed_samples_are_isolated_by_a_reset():
    H, K, V = 2, 4, 3
    a = random_inputs(5, H, K, V, seed=11)
    b = random_inputs(6, H, K, V, seed=12, state=False)
    packed = [torch.cat([x, y]) for x, y in zip(a[:5], b[:5])]
    reset = packed[3].clone()
    reset[5] = -math.inf                                       # α = 0 at sample B's first token
    for run in (ref.recurrent, lambda *x: ref.chunked(*x, chunk_size=4)):   # boundary inside a chunk
        out_a, fin_a = run(*a)
        out_b, fin_b = run(*b)
        out_p, fin_p = run(*packed[:3], reset, packed[4], a[5])
        assert_close(out_p[:5], out_a, what="sample A in the pack")
        assert_close(out_p[5:], out_b, what="sample B in the pack")
        assert_close(fin_p, fin_b, what="final state of the pack")
        # without the reset, B sees A's state: the comparison above would fail
        out_n, _ = run(*packed, a[5])
        assert (out_n[5:] - out_b).abs().max() > 1e-3


def test_cache_carry_and_reset():
    H, K, V = 2, 4, 3
    a = random_inputs(6, H, K, V, seed=21)
    b = random_inputs(7, H, K, V, seed=22, state=False)
    whole = [torch.cat([x, y]) for x, y in zip(a[:5], b[:5])]
    for run in (ref.recurrent, lambda *x: ref.chunked(*x, chunk_size=4)):
        out_w, fin_w = run(*whole, a[5])
        _, fin_a = run(*a)
        cache = fin_a.clone()
        out_b, fin_b = run(*b[:5], cache)                      # second segment continues from the cache
        assert torch.equal(cache, fin_a)                       # the cached state is not written in place
        assert_close(out_b, out_w[6:], what="carried segment")
        assert_close(fin_b, fin_w, what="carried final state")
        out_r, fin_r = run(*b[:5], None)                       # reset: a fresh zero state
        out_z, fin_z = run(*b[:5], torch.zeros(H, K, V, dtype=F64))
        assert_close(out_r, out_z, what="reset == zeros")
        assert_close(fin_r, fin_z, what="reset == zeros")
        assert (out_r - out_b).abs().max() > 1e-3              # and a reset really forgets


# ------------------------------------------------------------------------------------------------
# API contract
# ------------------------------------------------------------------------------------------------
def test_dtype_shapes_and_validation():
    q, k, v, g, b, S0 = (x.float() for x in random_inputs(9, 2, 3, 5, seed=31))
    for out, fin in (ref.recurrent(q, k, v, g, b, S0), ref.chunked(q, k, v, g, b, S0, chunk_size=4)):
        assert out.dtype == F64 and fin.dtype == F64
        assert out.shape == (9, 2, 5) and fin.shape == (2, 3, 5)
    with pytest.raises(ValueError):
        ref.recurrent(q, k, v[:, :1], g, b)
    with pytest.raises(ValueError):
        ref.recurrent(q, k, v, g, b, S0.transpose(1, 2))       # [H, V, K] is not the canonical layout
    with pytest.raises(ValueError):
        ref.chunked(q, k, v, g, b, S0, chunk_size=0)


def test_l2_normalise_matches_formula():
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0]], dtype=F64)
    y = ref.l2_normalise(x)
    assert_close(y[0], t64([3.0, 4.0]) / math.sqrt(25 + 1e-6))
    assert torch.equal(y[1], t64([0.0, 0.0]))                  # eps keeps a zero vector finite


# ------------------------------------------------------------------------------------------------
# Seed 003 §8 grid: recurrent vs chunked, max abs diff ≤ 1e-12 on outputs and final state.
# ------------------------------------------------------------------------------------------------
LENGTHS = (1, 2, 5, 17, 33, 130)
WIDTHS = ((1, 1), (2, 3), (7, 4), (16, 16))
REGIMES = ("interior", "endpoints", "strong_decay")
CHUNKS = (1, 2, 4, 8, 64)


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("width", WIDTHS, ids=lambda w: f"K{w[0]}V{w[1]}")
@pytest.mark.parametrize("T", LENGTHS)
def test_recurrent_equals_chunked(T, width, regime):
    K, V = width
    inputs = random_inputs(T, 2, K, V, regime, seed=1000 * T + 10 * K + V + REGIMES.index(regime))
    out_r, fin_r = ref.recurrent(*inputs)
    assert torch.isfinite(out_r).all() and torch.isfinite(fin_r).all()
    for c in CHUNKS:
        out_c, fin_c = ref.chunked(*inputs, chunk_size=c)
        assert_close(out_c, out_r, what=f"outputs, chunk {c}")
        assert_close(fin_c, fin_r, what=f"final state, chunk {c}")


# ------------------------------------------------------------------------------------------------
# The comparison has teeth: a chunked form with a wrong readout mask fails it.
# ------------------------------------------------------------------------------------------------
def chunked_variant(q, k, v, g, beta, S0=None, chunk_size=64, local_decay=True, diagonal=True):
    """An independent, deliberately breakable copy of seed 003 §6 (readout only can be broken).

    ``local_decay=False`` drops the within-chunk decay from the readout matrix; ``diagonal=False`` reads with a
    strictly lower mask (the current token's write invisible to its own query). Both True must match.
    """
    T, H, K = k.shape
    V = v.shape[2]
    q, k, v, g, beta = (x.to(F64) for x in (q, k, v, g, beta))
    S = torch.zeros(H, K, V, dtype=F64) if S0 is None else S0.to(F64).clone()
    out = torch.empty(T, H, V, dtype=F64)
    for s in range(0, T, chunk_size):
        e_ = min(s + chunk_size, T)
        C = e_ - s
        for h in range(H):
            a = torch.exp(g[s:e_, h])
            kc, qc, vc, bc = k[s:e_, h], q[s:e_, h], v[s:e_, h], beta[s:e_, h]
            D = torch.zeros(C, C, dtype=F64)
            for i in range(C):
                for j in range(i + 1):
                    D[i, j] = torch.prod(a[j + 1:i + 1])     # empty product = 1
            gam = torch.stack([torch.prod(a[:i + 1]) for i in range(C)])
            R = bc[:, None] * (vc - gam[:, None] * (kc @ S[h]))
            E = torch.zeros(C, V, dtype=F64)
            for i in range(C):
                E[i] = R[i] - sum((bc[i] * D[i, j] * (kc[i] @ kc[j]) * E[j] for j in range(i)), torch.zeros(V, dtype=F64))
            W = D if local_decay else torch.ones(C, C, dtype=F64).tril()
            rho = (W * (qc @ kc.T)).tril(0 if diagonal else -1)
            out[s:e_, h] = gam[:, None] * (qc @ S[h]) + rho @ E
            S[h] = gam[-1] * S[h] + (D[-1][:, None] * kc).T @ E
    return out, S


@pytest.mark.parametrize("regime", ("interior", "strong_decay"))
@pytest.mark.parametrize("chunk_size", (2, 4, 8, 64))
def test_broken_readout_fails_the_comparison(chunk_size, regime):
    inputs = random_inputs(33, 2, 7, 4, regime, seed=77 + chunk_size)
    out_r, fin_r = ref.recurrent(*inputs)
    good, good_fin = chunked_variant(*inputs, chunk_size=chunk_size)
    assert_close(good, out_r, what="unbroken test copy")       # the copy itself is right …
    assert_close(good_fin, fin_r, what="unbroken test copy")
    for broken in (dict(local_decay=False), dict(diagonal=False)):
        bad, _ = chunked_variant(*inputs, chunk_size=chunk_size, **broken)
        diff = (bad - out_r).abs().max().item()
        assert diff > 1e-6, f"{broken} went unnoticed (diff {diff:.1e})"   # … and each break is caught
