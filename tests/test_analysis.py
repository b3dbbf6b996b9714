"""Hand-computed checks of gdnviz.analysis (seed 000 definitions). Fast: CPU, small arrays.

Every expected value is derived in the comment next to it from the definition, not copied from an output.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
import pytest
import torch

from gdnviz.analysis import (
    DecayedKeyCovariance,
    across_documents,
    alpha_histogram,
    covariance_window,
    decay_horizon,
    decayed_key_covariance,
    decayed_key_erank,
    effective_rank,
    effective_rank_from_eigenvalues,
    energy_curve,
    energy_top_r,
    head_frame,
    key_covariance_erank,
    keycone_summary,
    mean_alpha,
    mean_key_norm,
    numerical_rank,
    numerical_rank_threshold,
    share_forgetting_within,
    singular_values,
    spearman,
    stable_rank,
    window_key_covariance,
)

EPS32 = float(np.finfo(np.float32).eps)  # 2**-23
THR = 128 * EPS32  # 2**-16 = 1.52587890625e-05


def unit(x):
    x = np.asarray(x, dtype=np.float64)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


# ============================================================================================ spectra
def test_threshold_constant_is_2_to_minus_16():
    # 128 · 2**-23 = 2**7 · 2**-23 = 2**-16, independent of n.
    assert THR == 2.0**-16
    assert numerical_rank_threshold([4.0, 1.0]) == 4.0 * 2.0**-16
    assert numerical_rank_threshold(np.ones(3)) == numerical_rank_threshold(np.ones(300))


def test_flat_spectrum():
    sv = np.full(128, 0.37)
    assert effective_rank(sv) == pytest.approx(128.0, rel=1e-12)  # p_i = 1/128 → exp(log 128)
    assert stable_rank(sv) == pytest.approx(128.0, rel=1e-12)  # 128 σ² / σ²
    assert numerical_rank(sv) == 128
    # energy of the top r of a flat spectrum is r/128
    r = np.array([0, 1, 7, 64, 128, 500])
    np.testing.assert_allclose(energy_top_r(sv, r), np.minimum(r, 128) / 128, rtol=1e-12)


def test_one_hot_and_two_equal():
    one = np.array([2.5, 0.0, 0.0, 0.0])
    assert effective_rank(one) == 1.0  # p = (1, 0, 0, 0): entropy 0 (0 log 0 = 0)
    assert stable_rank(one) == 1.0
    assert numerical_rank(one) == 1
    assert energy_top_r(one, 1) == 1.0
    two = np.array([3.0, 3.0, 0.0])
    assert effective_rank(two) == pytest.approx(2.0, rel=1e-14)  # p = (½, ½): exp(log 2)
    assert stable_rank(two) == pytest.approx(2.0, rel=1e-14)
    assert energy_top_r(two, 1) == pytest.approx(0.5)


def test_effective_rank_unequal_by_hand():
    # σ = (3, 1): p = (3/4, 1/4); erank = exp(-(¾ ln ¾ + ¼ ln ¼)) = (4/3)^(3/4) · 4^(1/4)
    expected = (4 / 3) ** 0.75 * 4**0.25
    assert effective_rank([3.0, 1.0]) == pytest.approx(expected, rel=1e-14)
    assert effective_rank([1.0, 3.0]) == pytest.approx(expected, rel=1e-14)  # order does not matter
    assert effective_rank([30.0, 10.0]) == pytest.approx(expected, rel=1e-14)  # scale does not matter
    assert 1 < expected < 2


def test_zero_matrix_conventions():
    z = np.zeros(5)
    assert numerical_rank(z) == 0
    assert effective_rank(z) == 0.0
    assert stable_rank(z) == 0.0
    assert energy_top_r(z, 0) == 1.0 and energy_top_r(z, 3) == 1.0
    np.testing.assert_array_equal(energy_curve(z), np.ones(5))
    assert effective_rank_from_eigenvalues(z, "eig") == 0.0
    assert effective_rank_from_eigenvalues(z, "sqrt") == 0.0


def test_numerical_rank_boundary_is_strict():
    thr = 2.0**-16
    assert numerical_rank([1.0, thr]) == 1  # exactly at σ_max·128·ε: not counted (strictly greater)
    assert numerical_rank([1.0, np.nextafter(thr, 1.0)]) == 2  # one ulp above: counted
    assert numerical_rank([1.0, np.nextafter(thr, 0.0)]) == 1
    assert numerical_rank([8.0, 8.0 * thr, 8.0 * thr * 1.0000001]) == 2  # cut-off scales with σ_max = 8


def test_decayed_residue_counts():
    # σ = (1, 1e-3, 1e-6): cut-off 2**-16 ≈ 1.526e-5. 1e-3 > 1.526e-5 counts, 1e-6 < 1.526e-5 does not → 2.
    assert numerical_rank([1.0, 1e-3, 1e-6]) == 2
    # erank barely notices the residue: p ≈ (1 − 1e-3, 1e-3, 1e-6) → exp(H) with H ≈ 1e-3·(1 + ln 1000)
    p = np.array([1.0, 1e-3, 1e-6]) / (1.0 + 1e-3 + 1e-6)
    assert effective_rank([1.0, 1e-3, 1e-6]) == pytest.approx(math.exp(-np.sum(p * np.log(p))), rel=1e-14)
    assert effective_rank([1.0, 1e-3, 1e-6]) < 1.01


def test_batched_shapes_and_torch_input():
    rng = np.random.default_rng(0)
    sv = np.sort(rng.random((2, 3, 6)), axis=-1)[..., ::-1]
    for f in (numerical_rank, effective_rank, stable_rank):
        out = f(sv)
        assert out.shape == (2, 3)
        for i in range(2):
            for j in range(3):
                assert out[i, j] == f(sv[i, j])
        np.testing.assert_array_equal(f(torch.tensor(sv.copy())), out)
    assert energy_top_r(sv, 2).shape == (2, 3)


def test_stable_rank_known_matrices():
    assert stable_rank(singular_values(np.eye(5))) == pytest.approx(5.0)  # ‖I‖_F² = 5, ‖I‖_2² = 1
    u, v = unit([1.0, 2.0, 2.0]), unit([3.0, 4.0])
    assert stable_rank(singular_values(7.0 * np.outer(u, v))) == pytest.approx(1.0)  # rank one
    assert stable_rank(singular_values(np.diag([2.0, 1.0]))) == pytest.approx(1.25)  # (4 + 1) / 4
    # A = [[1, 1], [0, 1]]: ‖A‖_F² = 3; AᵀA = [[1, 1], [1, 2]] has λ_max = (3 + √5)/2 → 6 / (3 + √5)
    assert stable_rank(singular_values(np.array([[1.0, 1.0], [0.0, 1.0]]))) == pytest.approx(6 / (3 + 5**0.5))


def test_energy_top_r_by_hand_and_broadcast():
    sv = np.array([1.0, 2.0, 1.0])  # unsorted on purpose: sorted (2, 1, 1), energies (4, 1, 1) of 6
    np.testing.assert_allclose(energy_top_r(sv, np.array([0, 1, 2, 3, 4])), [0, 4 / 6, 5 / 6, 1, 1])
    np.testing.assert_allclose(energy_curve(sv), [4 / 6, 5 / 6, 1])
    batch = np.array([[2.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    np.testing.assert_allclose(energy_top_r(batch, 1), [4 / 6, 1 / 2])
    np.testing.assert_allclose(energy_top_r(batch, np.array([1, 2])), [4 / 6, 1.0])  # r broadcast on batch
    curve = energy_top_r(batch, np.array([1, 2, 3])[:, None])  # [R, 1] × [2] → [3, 2]
    np.testing.assert_allclose(curve, [[4 / 6, 1 / 2], [5 / 6, 1], [1, 1]])
    with pytest.raises(ValueError):
        energy_top_r(sv, -1)
    with pytest.raises(ValueError):
        energy_top_r(sv, 1.5)


def test_effective_rank_from_eigenvalues_scales():
    lam = np.array([4.0, 1.0])
    # eig scale: p = (0.8, 0.2)
    e = math.exp(-(0.8 * math.log(0.8) + 0.2 * math.log(0.2)))
    assert effective_rank_from_eigenvalues(lam, "eig") == pytest.approx(e, rel=1e-14)
    # sqrt scale: √λ = (2, 1), p = (2/3, 1/3)
    s = math.exp(-(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3)))
    assert effective_rank_from_eigenvalues(lam, "sqrt") == pytest.approx(s, rel=1e-14)
    assert s > e  # squaring concentrates the distribution
    # tiny negative round-off eigenvalues are clipped to 0 (sqrt would be NaN)
    assert effective_rank_from_eigenvalues([1.0, -1e-18], "sqrt") == 1.0
    assert effective_rank_from_eigenvalues([1.0, -1e-18], "eig") == 1.0
    with pytest.raises(ValueError):
        effective_rank_from_eigenvalues(lam, "log")


def test_sqrt_scale_equals_singular_values_of_factor():
    rng = np.random.default_rng(1)
    A = rng.standard_normal((40, 6)) * np.array([5.0, 3.0, 1.0, 0.5, 0.1, 0.01])
    lam = np.linalg.eigvalsh(A.T @ A)  # eigenvalues of AᵀA are σ(A)²
    assert effective_rank_from_eigenvalues(lam, "sqrt") == pytest.approx(
        effective_rank(np.linalg.svd(A, compute_uv=False)), rel=1e-10
    )


def test_singular_values_types_and_order():
    rng = np.random.default_rng(2)
    S = rng.standard_normal((3, 5, 4)).astype(np.float32)
    sv = singular_values(S)
    assert isinstance(sv, np.ndarray) and sv.dtype == np.float64 and sv.shape == (3, 4)
    assert np.all(np.diff(sv, axis=-1) <= 0)
    np.testing.assert_allclose(sv, np.linalg.svd(S.astype(np.float64), compute_uv=False), rtol=1e-12)
    st = singular_values(torch.from_numpy(S))
    assert isinstance(st, torch.Tensor) and st.dtype == torch.float64
    np.testing.assert_allclose(st.numpy(), sv, rtol=1e-12)


# ============================================================================================ horizons
def test_constant_alpha_horizon_is_ten():
    g = np.full((50, 3), math.log(0.9))
    np.testing.assert_allclose(mean_alpha(g), 0.9, rtol=1e-14)
    np.testing.assert_allclose(decay_horizon(g), 10.0, rtol=1e-12)  # 1 / (1 − 0.9)


def test_mean_alpha_is_mean_of_alpha_not_of_g():
    # α alternating 0.8, 1.0: ᾱ = 0.9 → 10 tokens (exp of mean g would be √0.8 ≈ 0.894 → 9.47 tokens)
    g = np.log(np.array([[0.8], [1.0]] * 10))
    assert mean_alpha(g)[0] == pytest.approx(0.9, rel=1e-14)
    assert decay_horizon(g)[0] == pytest.approx(10.0, rel=1e-12)


def test_horizon_edges():
    g = np.zeros((7, 2))
    g[:, 1] = -np.inf  # α = 0: only the current token → horizon 1
    h = decay_horizon(g)
    assert h[0] == np.inf and h[1] == 1.0
    h32 = decay_horizon(torch.full((4, 1), math.log(0.5)))  # torch in, numpy out: α = ½ → 2 tokens
    assert isinstance(h32, np.ndarray) and h32[0] == pytest.approx(2.0, rel=1e-6)


def test_share_forgetting_within():
    h = np.array([[10.0, 255.9, 256.0], [1000.0, np.inf, np.nan]])
    assert share_forgetting_within(h) == pytest.approx(2 / 5)  # 10, 255.9 < 256; NaN ignored
    assert share_forgetting_within(h, segment_len=1001) == pytest.approx(4 / 5)
    assert math.isnan(share_forgetting_within([np.nan]))


def test_alpha_histogram():
    alpha = np.array([[0.0, 0.1], [0.3, 0.5], [0.74, 1.0]])
    with np.errstate(divide="ignore"):
        g = np.log(alpha)
    counts, edges = alpha_histogram(g, bins=4)  # bins [0, .25) [.25, .5) [.5, .75) [.75, 1]
    np.testing.assert_allclose(edges, [0, 0.25, 0.5, 0.75, 1.0])
    np.testing.assert_array_equal(counts, [2, 1, 2, 1])
    per, _ = alpha_histogram(g, bins=4, per_head=True)
    np.testing.assert_array_equal(per, [[1, 1, 1, 0], [1, 0, 1, 1]])
    assert per.sum() == 6


# ============================================================================================ keycone
def test_mean_key_norm_identical_orthogonal_opposite():
    K = 8
    same = np.tile(unit(np.arange(1.0, K + 1)), (5, 1))
    Q, _ = np.linalg.qr(np.random.default_rng(3).standard_normal((K, K)))
    opp = np.stack([Q[0], -Q[0], Q[1], -Q[1]])
    k = np.stack([same[:4], Q[:4], opp], axis=1)  # [T=4, H=3, K]
    k_orth = Q[:, None, :]  # K orthonormal keys: ‖Σ q_i‖ = √K → mean norm √K / K = 1/√K
    n = mean_key_norm(k)
    assert n[0] == pytest.approx(1.0, rel=1e-14)
    assert n[1] == pytest.approx(2 / 4, rel=1e-12)  # 4 orthonormal keys: √4 / 4
    assert n[2] == pytest.approx(0.0, abs=1e-15)
    assert mean_key_norm(k_orth)[0] == pytest.approx(1 / math.sqrt(K), rel=1e-12)
    np.testing.assert_allclose(mean_key_norm(torch.from_numpy(k).float()), n, atol=1e-7)


def test_window_covariance_by_hand():
    e1, e2, e3 = np.eye(3)
    k = np.stack([e3, e1, e2, e1, e2])[:, None, :].repeat(2, axis=1)  # [5, 2, 3]
    # last 2 keys e1, e2: μ = (½, ½, 0); C = ½[(½,−½,0)(½,−½,0)ᵀ + (−½,½,0)(−½,½,0)ᵀ] = ¼[[1,−1,0],[−1,1,0],[0,0,0]]
    C = window_key_covariance(k, np.array([2, 1]))
    np.testing.assert_allclose(C[0], 0.25 * np.array([[1, -1, 0], [-1, 1, 0], [0, 0, 0]]), atol=1e-15)
    np.testing.assert_array_equal(C[1], np.zeros((3, 3)))  # a single key has zero covariance
    # clamping: window 0 → 1, window 99 → T = 5 (all keys: the centred covariance of the whole sequence)
    C2 = window_key_covariance(k, np.array([0, 99]))
    np.testing.assert_array_equal(C2[0], np.zeros((3, 3)))
    X = k[:, 1]
    np.testing.assert_allclose(C2[1], (X - X.mean(0)).T @ (X - X.mean(0)) / 5, atol=1e-15)


def test_window_covariance_chunked_matches_direct():
    rng = np.random.default_rng(11)
    T, H, K = 23, 3, 4
    k = unit(rng.standard_normal((T, H, K)))
    w = np.array([23, 7, 7])
    C = window_key_covariance(k, w, chunk=3)
    for h in range(H):
        X = k[T - w[h] :, h]
        np.testing.assert_allclose(C[h], np.cov(X.T, bias=True), rtol=1e-12, atol=1e-15)


def test_covariance_window_rounding():
    # ⌈h⌉ clamped to [2, T]; 1/(1−0.9) = 10.000000000000002 must give 10, not 11
    h = np.array([1 / (1 - 0.9), 2.5, 1.0, np.inf, 30.0, np.nan])
    np.testing.assert_array_equal(covariance_window(h, T=20), [10, 3, 2, 20, 20, -1])


def test_key_covariance_erank_uses_the_horizon_window():
    # α = 0.9 → horizon 10 → window 10 = last 10 keys: e1, e2 alternating → C ∝ (e1−e2)(e1−e2)ᵀ → erank 1.
    # The 11th key from the end is e3: a window of 11 would see three directions and give erank > 1.
    e = np.eye(4)
    keys = [e[3]] * 5 + [e[2]] + [e[0], e[1]] * 5  # T = 16
    k = np.stack(keys)[:, None, :]
    g = np.full((16, 1), math.log(0.9))
    assert key_covariance_erank(k, g)[0] == pytest.approx(1.0, rel=1e-9)
    lam11 = np.linalg.eigvalsh(window_key_covariance(k, 11)[0])
    assert effective_rank_from_eigenvalues(lam11, "eig") > 1.5


def test_key_covariance_erank_three_dim_subspace():
    rng = np.random.default_rng(4)
    K, T = 16, 400
    basis, _ = np.linalg.qr(rng.standard_normal((K, 3)))  # 3 orthonormal columns
    k = unit(rng.standard_normal((T, 2, 3)) @ basis.T)  # unit keys inside a 3-dim subspace
    g = np.zeros((T, 2))
    g[:, 1] = math.log(0.99)  # horizon 100
    er = key_covariance_erank(k, g)
    assert np.all(er <= 3.0 + 1e-9) and np.all(er > 2.0)  # isotropic in 3 dims: close to (but ≤) 3
    # full-dimensional isotropic keys give far more
    k_full = unit(rng.standard_normal((T, 1, K)))
    assert key_covariance_erank(k_full, np.zeros((T, 1)))[0] > 12


def _p_loop(k, g):
    """P by the recurrence P_t = α_t² P_{t−1} + k_t k_tᵀ (α_t decays before token t writes)."""
    T, H, K = k.shape
    P = np.zeros((H, K, K))
    for t in range(T):
        P = np.exp(2 * g[t])[:, None, None] * P + np.einsum("hi,hj->hij", k[t], k[t])
    return P


def test_decayed_P_no_decay_is_T_times_second_moment():
    rng = np.random.default_rng(5)
    T, H, K = 30, 2, 5
    k = unit(rng.standard_normal((T, H, K)))
    P = decayed_key_covariance(k, np.zeros((T, H)))
    second = np.einsum("thi,thj->hij", k, k) / T
    np.testing.assert_allclose(P, T * second, rtol=1e-13)


def test_decayed_P_fast_decay_is_last_key():
    rng = np.random.default_rng(6)
    T, H, K = 12, 3, 4
    k = unit(rng.standard_normal((T, H, K)))
    P = decayed_key_covariance(k, np.full((T, H), -50.0))  # w_{T−2} = e^-100
    np.testing.assert_allclose(P, np.einsum("hi,hj->hij", k[-1], k[-1]), atol=1e-40)


def test_decayed_P_weights_by_hand():
    # T = 2: w_0 = exp(2 g_1), w_1 = 1; g_0 never enters (a token's decay acts before its own write)
    k = np.array([[[1.0, 0.0]], [[0.0, 1.0]]])  # e1 then e2, H = 1
    g = np.array([[-3.0], [math.log(0.5)]])
    np.testing.assert_allclose(decayed_key_covariance(k, g)[0], [[0.25, 0.0], [0.0, 1.0]], rtol=1e-14)
    g[0, 0] = -0.1
    np.testing.assert_allclose(decayed_key_covariance(k, g)[0], [[0.25, 0.0], [0.0, 1.0]], rtol=1e-14)


def test_decayed_P_matches_recurrence_chunking_incremental_and_torch():
    rng = np.random.default_rng(7)
    T, H, K = 57, 3, 6
    k = unit(rng.standard_normal((T, H, K)))
    g = np.log(rng.uniform(0.6, 1.0, (T, H)))
    ref = _p_loop(k, g)
    np.testing.assert_allclose(decayed_key_covariance(k, g), ref, rtol=1e-12)
    np.testing.assert_allclose(decayed_key_covariance(k, g, chunk=5), ref, rtol=1e-12)  # chunk edges
    acc = DecayedKeyCovariance(chunk=4)
    for a, b in [(0, 1), (1, 20), (20, 21), (21, 57)]:
        acc.update(k[a:b], g[a:b])
    assert acc.T == T
    np.testing.assert_allclose(acc.P, ref, rtol=1e-12)
    np.testing.assert_allclose(acc.erank("sqrt"), decayed_key_erank(k, g), rtol=1e-10)
    out = decayed_key_covariance(torch.from_numpy(k), torch.from_numpy(g))
    assert isinstance(out, np.ndarray)
    np.testing.assert_allclose(out, ref, rtol=1e-12)


def test_decayed_P_sqrt_scale_equals_svd_of_decayed_keys():
    # P = Mᵀ M with M_t = √w_t k_t, so √eig(P) = σ(M) and the √-scale erank of P is erank(σ(M)).
    rng = np.random.default_rng(8)
    T, H, K = 200, 2, 8
    k = unit(rng.standard_normal((T, H, K)) + np.array([2.0] + [0.0] * (K - 1)))  # a cone around e1
    g = np.log(rng.uniform(0.97, 0.999, (T, H)))
    amp = np.array([[math.exp(g[t + 1 :, h].sum()) for h in range(H)] for t in range(T)])  # √w_t = Π_{s>t} α_s
    for h in range(H):
        M = amp[:, h, None] * k[:, h]
        sv = np.linalg.svd(M, compute_uv=False)
        assert decayed_key_erank(k, g, "sqrt")[h] == pytest.approx(effective_rank(sv), rel=1e-10)
        assert decayed_key_erank(k, g, "eig")[h] == pytest.approx(effective_rank(sv**2), rel=1e-10)
    assert np.all(decayed_key_erank(k, g, "eig") < decayed_key_erank(k, g, "sqrt"))


def test_keycone_summary_keys_and_consistency():
    rng = np.random.default_rng(9)
    T, H, K = 64, 4, 8
    k = unit(rng.standard_normal((T, H, K)))
    g = np.log(rng.uniform(0.5, 0.99, (T, H)))
    s = keycone_summary(torch.from_numpy(k).float(), torch.from_numpy(g).float())
    assert set(s) == {"mean_key_norm", "key_cov_erank", "decayed_P_erank_sqrt", "decayed_P_erank_eig", "horizon"}
    for v in s.values():
        assert isinstance(v, np.ndarray) and v.shape == (H,)
    np.testing.assert_allclose(s["horizon"], decay_horizon(g), rtol=1e-6)
    np.testing.assert_allclose(s["mean_key_norm"], mean_key_norm(k), atol=1e-6)
    np.testing.assert_allclose(s["key_cov_erank"], key_covariance_erank(k, g), rtol=1e-5)
    np.testing.assert_allclose(s["decayed_P_erank_sqrt"], decayed_key_erank(k, g, "sqrt"), rtol=1e-5)
    np.testing.assert_allclose(s["decayed_P_erank_eig"], decayed_key_erank(k, g, "eig"), rtol=1e-5)


@pytest.mark.parametrize("T, chunk", [(1, 2048), (2, 2048), (200, 16), (200, 2048)])
def test_keycone_summary_matches_references_per_head_windows(T, chunk):
    """The device half (token masks instead of per-head windows, no host sync) against the reference functions:
    every head has its own window (short, ~T/2, never forgetting = all T), one head has a NaN decay (NaN erank,
    finite rest) and one head's early keys are NaN (outside its window: must not leak into the covariance)."""
    rng = np.random.default_rng(T)
    H, K = 5, 8
    k = unit(rng.standard_normal((T, H, K)))
    g = np.empty((T, H))
    g[:, 0] = np.log(0.5)  # horizon 2
    g[:, 1] = np.log(1 - 2.0 / max(T, 2))  # horizon ~T/2
    g[:, 2] = 0.0  # never forgets: window T
    g[:, 3] = np.log(rng.uniform(0.6, 0.99, T))
    g[:, 4] = np.log(0.7)
    g[0, 3] = np.nan if T > 1 else g[0, 3]
    if T > 10:
        k[0, 4] = np.nan  # head 4's horizon is ~3.3 tokens: the NaN key is far outside its window
    s = keycone_summary(torch.from_numpy(k), torch.from_numpy(g), chunk=chunk)
    ref_h = decay_horizon(g)
    np.testing.assert_array_equal(np.isnan(s["horizon"]), np.isnan(ref_h))
    np.testing.assert_allclose(s["horizon"], ref_h, rtol=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        np.testing.assert_allclose(s["key_cov_erank"], key_covariance_erank(k, g), rtol=1e-9)
        # √-scale: round-off eigenvalues (~1e-17 of λ_max) of a rank-deficient P (T < K) weigh √1e-17 each, so two
        # LAPACK drivers differ by ~1e-7 there; full-rank P (T = 200) agrees to 1e-9 as well
        np.testing.assert_allclose(s["decayed_P_erank_sqrt"], decayed_key_erank(k, g, "sqrt"), rtol=1e-9,
                                   atol=1e-6 if T < K else 0)
        np.testing.assert_allclose(s["decayed_P_erank_eig"], decayed_key_erank(k, g, "eig"), rtol=1e-9)
        np.testing.assert_allclose(s["mean_key_norm"], mean_key_norm(k), rtol=1e-12)
    if T > 10:
        assert np.isnan(s["key_cov_erank"][3]) and np.isfinite(s["key_cov_erank"][4])
        assert np.isinf(s["horizon"][2]) and s["key_cov_erank"][2] > 1


@pytest.mark.parametrize("chunk, split", [(300, 0), (2048, 0), (300, 64), (2048, 96)])
def test_keycone_sums_are_the_reference_matrices(chunk, split, monkeypatch):
    """keycone_sums' window covariance C and decayed covariance P (what a capture hands to its merged eigensolve)
    equal window_key_covariance over ⌈horizon⌉-token windows and decayed_key_covariance, per head (windows of 2
    tokens, ~T/2 and all T; chunks that split the windows); gdnviz.statistics.keycone_parts' eigenvalues are theirs.
    ``split``: the sums over tokens in parts of that many tokens (CUDA's split-K form, here forced on the CPU; 96
    leaves a rest)."""
    import functools

    from gdnviz.analysis import keycone
    from gdnviz.analysis.keycone import covariance_window, keycone_sums
    from gdnviz.statistics import keycone_parts

    if split:
        monkeypatch.setattr(keycone, "_gram_head_major", functools.partial(keycone._gram_head_major, p=split))

    rng = np.random.default_rng(17)
    T, H, K = 1000, 4, 8
    k = unit(rng.standard_normal((T, H, K)))
    g = np.empty((T, H))
    g[:, 0], g[:, 1], g[:, 2] = np.log(0.5), np.log(1 - 2.0 / T), 0.0
    g[:, 3] = np.log(rng.uniform(0.6, 0.99, T))
    kt, gt = torch.from_numpy(k), torch.from_numpy(g)
    sums = keycone_sums(kt, gt, chunk=chunk)
    w = covariance_window(decay_horizon(g), T)
    np.testing.assert_allclose(sums["C"].numpy(), window_key_covariance(k, w), rtol=1e-9, atol=1e-14)
    np.testing.assert_allclose(sums["P"].numpy(), decayed_key_covariance(k, g), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(sums["mean_key_norm"].numpy(), mean_key_norm(k), rtol=1e-12)
    parts = keycone_parts(kt, gt, chunk=chunk)
    for name, M in (("cov_eigvals", sums["C"]), ("P_eigvals", sums["P"])):
        np.testing.assert_allclose(parts[name].numpy(), np.linalg.eigvalsh(M.numpy()), rtol=0,
                                   atol=1e-12 * np.abs(M.numpy()).max())


@pytest.mark.parametrize("chunk", [64, 2048])
def test_keycone_sums_keep_nan_keys_outside_their_windows(chunk):
    """The window masks are exact zeros: a NaN key before a head's window (in a chunk wholly outside it, and in the
    chunk the window starts in) leaves that head's window covariance finite and equal to the reference; a NaN inside
    a window makes it NaN."""
    from gdnviz.analysis.keycone import covariance_window, keycone_sums

    rng = np.random.default_rng(3)
    T, H, K = 300, 3, 8
    k = unit(rng.standard_normal((T, H, K)))
    g = np.empty((T, H))
    g[:, 0], g[:, 1], g[:, 2] = np.log(0.5), np.log(0.9), np.log(0.5)  # windows of 2, 10 and 2 tokens
    k[5, 0] = np.nan  # chunk 0: wholly before head 0's window (tokens 298, 299)
    k[260, 1] = np.nan  # head 1's window (290 …) starts in the chunk of 64 tokens (256 …) that holds the NaN
    k[299, 2] = np.nan  # inside head 2's window
    sums = keycone_sums(torch.from_numpy(k), torch.from_numpy(g), chunk=chunk)
    w = covariance_window(decay_horizon(g), T)
    assert list(w) == [2, 10, 2]
    for h in (0, 1):
        np.testing.assert_allclose(sums["C"][h].numpy(), window_key_covariance(k[:, h:h + 1], w[h:h + 1])[0],
                                   rtol=1e-9, atol=1e-14)
    assert torch.isnan(sums["C"][2]).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_keycone_sums_on_gpu_equal_cpu():
    """keycone_sums on CUDA (one 16K-token chunk, the split-K GEMMs) equal the CPU's float64 sums."""
    from gdnviz.analysis.keycone import keycone_sums

    rng = np.random.default_rng(5)
    T, H, K = 5000, 4, 128
    k = unit(rng.standard_normal((T, H, K)))
    g = np.log(rng.uniform(0.9, 0.999, (T, H)))
    kt, gt = torch.from_numpy(k), torch.from_numpy(g)
    cpu = keycone_sums(kt, gt)
    gpu = keycone_sums(kt.cuda(), gt.cuda())
    for name in ("C", "P", "mean_key_norm", "horizon"):
        np.testing.assert_allclose(gpu[name].cpu().numpy(), cpu[name].numpy(), rtol=1e-9, atol=1e-13)


def test_keycone_summary_short_windows_skip_early_chunks():
    """Every window short (horizons 2-10 tokens): the CPU path skips the chunks before every window and must give
    the reference covariance erank all the same (chunk 16, T = 200, windows cross a chunk boundary)."""
    rng = np.random.default_rng(11)
    T, H, K = 200, 3, 8
    k = unit(rng.standard_normal((T, H, K)))
    g = np.log(np.broadcast_to([0.5, 0.8, 0.9], (T, H))).copy()
    s = keycone_summary(torch.from_numpy(k), torch.from_numpy(g), chunk=16)
    np.testing.assert_allclose(s["key_cov_erank"], key_covariance_erank(k, g), rtol=1e-9)
    np.testing.assert_allclose(s["mean_key_norm"], mean_key_norm(k), rtol=1e-12)


def test_keycone_summary_leaves_its_inputs_alone():
    """float64 keys are used without a copy inside keycone_sums: nothing may write into them (a chunk scaled in
    place by the decay weights would)."""
    rng = np.random.default_rng(5)
    k = torch.from_numpy(unit(rng.standard_normal((50, 3, 8))))
    g = torch.from_numpy(np.log(rng.uniform(0.5, 0.99, (50, 3))))
    k0, g0 = k.clone(), g.clone()
    for chunk in (16, 2048):
        keycone_summary(k, g, chunk=chunk)
        assert torch.equal(k, k0) and torch.equal(g, g0)


def test_shape_errors():
    with pytest.raises(ValueError):
        decayed_key_covariance(np.zeros((5, 2, 3)), np.zeros((5, 3)))
    with pytest.raises(ValueError):
        mean_key_norm(np.zeros((5, 3)))


@pytest.mark.slow
def test_large_T_does_not_blow_memory():
    # T = 16384, H = 16, K = 128 in float32 (128 MiB): a [T, H, K, K] intermediate would be 32 GiB.
    import resource

    T, H, K = 16384, 16, 128
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(T, H, K, generator=gen)
    k /= torch.linalg.vector_norm(k, dim=-1, keepdim=True)  # in place: no second copy raises the peak
    g = torch.zeros(T, H)  # half the heads never forget: one window of all T tokens for 8 heads
    g[:, ::2] = -torch.rand(T, H // 2, generator=gen) * 0.01
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    s = keycone_summary(k, g)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert np.all(np.isinf(s["horizon"][1::2])) and np.all(np.isfinite(s["horizon"][::2]))
    assert all(np.all(np.isfinite(v)) for name, v in s.items() if name != "horizon")
    assert grown_mib < 512  # float64 chunks of 2048 tokens are 32 MiB each; measured ~120 MiB


# ============================================================================================ aggregate
def test_spearman_by_hand():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [1, 4, 9, 16]) == pytest.approx(1.0)  # monotone, not linear
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    # ranks x = (1, 2, 3), y = (1, 3, 2): d = (0, −1, 1), Σd² = 2 → ρ = 1 − 6·2 / (3·8) = ½
    assert spearman([1, 2, 3], [5, 9, 7]) == pytest.approx(0.5)
    # ties: y = (1, 1, 2) → ranks (1.5, 1.5, 3) with x ranks (1, 2, 3): centred (−1, 0, 1), (−.5, −.5, 1)
    # ρ = 1.5 / √(2 · 1.5) = √3 / 2
    assert spearman([1, 2, 3], [1, 1, 2]) == pytest.approx(math.sqrt(3) / 2)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))
    assert math.isnan(spearman([1, np.nan], [1, 2]))  # one pair left


def test_spearman_matches_scipy_with_ties_and_nonfinite():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(10)
    for trial in range(20):
        n = int(rng.integers(5, 300))
        x = rng.integers(0, 8, n).astype(float)  # many ties
        y = x * rng.uniform(-1, 1) + rng.integers(0, 5, n)
        x[rng.random(n) < 0.1] = np.nan
        y[rng.random(n) < 0.05] = np.inf
        y[rng.random(n) < 0.05] = np.nan
        keep = np.isfinite(x) & np.isfinite(y)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = stats.spearmanr(x[keep], y[keep]).statistic
        got = spearman(x.reshape(-1, 1), torch.from_numpy(y))
        if np.isnan(ref):
            assert np.isnan(got)
        else:
            assert got == pytest.approx(ref, abs=1e-12)


def test_across_documents():
    v = np.array([[1.0, np.nan, np.nan], [10.0, 2.0, np.nan], [2.0, np.nan, np.nan]])  # median 2 ≠ mean 13/3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an all-NaN column must not warn
        out = across_documents(v)
    np.testing.assert_array_equal(out["median"], [2.0, 2.0, np.nan])
    np.testing.assert_array_equal(out["min"], [1.0, 2.0, np.nan])
    np.testing.assert_array_equal(out["max"], [10.0, 2.0, np.nan])
    cube = across_documents(np.arange(24.0).reshape(3, 2, 4))  # documents along axis 0
    np.testing.assert_array_equal(cube["median"], np.arange(8.0, 16.0).reshape(2, 4))
    assert set(out) == {"median", "min", "max"}


def test_head_frame():
    er = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    nr = torch.tensor([[127, 126, 1], [0, 5, 128]])
    df = head_frame([0, 4], 3, erank=er, numrank=nr)
    assert isinstance(df, pd.DataFrame)
    assert list(df.columns) == ["layer", "head", "erank", "numrank"]
    assert df["layer"].tolist() == [0, 0, 0, 4, 4, 4]
    assert df["head"].tolist() == [0, 1, 2, 0, 1, 2]
    assert df["erank"].tolist() == [1, 2, 3, 4, 5, 6]
    assert df.loc[(df["layer"] == 4) & (df["head"] == 2), "numrank"].item() == 128
    df2 = head_frame([1], [5, 7], x=np.array([[0.5, 0.25]]))
    assert df2["head"].tolist() == [5, 7]
    with pytest.raises(ValueError):
        head_frame([0, 4], 3, erank=er.T)
    with pytest.raises(ValueError):
        head_frame([0, 4], 3, layer=er)
