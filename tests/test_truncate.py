"""Tests of gdnviz.truncate: the batched top-r truncation of GDN head states.

Everything runs on the CPU in float64 references; the accuracy criterion is the one the probe relies on: the retained
energy ‖S_r‖²_F is within 1e-5 (relative to ‖S‖²_F) of the exact top-r energy, for every state of hard batteries.
"""

from __future__ import annotations

import functools

import pytest
import torch

from gdnviz.errors import RankOutOfRange
from gdnviz.truncate import (
    energy_error,
    exact_truncate,
    iterations_for,
    retained_energy,
    truncate_states,
)

TOL = 1e-5
RANKS = (1, 2, 4, 12, 32)
F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------- batteries
def _haar(n: int, k: int, m: int, g: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(n, k, m, generator=g, dtype=F64))
    return q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]


def _from_spectra(sig: torch.Tensor, K: int, V: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n, m = sig.shape
    return (_haar(n, K, m, g) * sig[:, None, :]) @ _haar(n, V, m, g).mT


def _gdn_like_spectra(n: int, m: int, seed: int) -> torch.Tensor:
    """Decaying spectra like measured GDN heads: effective rank 3..40 (the benchmark's generator, seeded)."""
    from bench.bench_truncate import gdn_like_spectra

    return gdn_like_spectra(n, m, torch.Generator().manual_seed(seed))


@functools.lru_cache(maxsize=None)
def _toy_gdn_states(n: int, K: int, V: int, seed: int, tokens: int = 256) -> torch.Tensor:
    """States of a toy gated delta rule S ← a(I − b k kᵀ)S + b k vᵀ with narrow key cones (effective rank 10..95).

    Cached: the 256 sequential steps dominate the battery's cost on a small CPU."""
    g = torch.Generator().manual_seed(seed)
    a = (1 - 1 / torch.exp(torch.empty(n, dtype=F64).uniform_(2.0, 9.0, generator=g)))[:, None, None]
    mean = torch.nn.functional.normalize(torch.randn(n, K, generator=g, dtype=F64), dim=-1)
    cone = torch.empty(n, 1, dtype=F64).uniform_(0.3, 1.5, generator=g)
    S = torch.zeros(n, K, V, dtype=F64)
    for _ in range(tokens):
        k = torch.nn.functional.normalize(mean + cone * torch.randn(n, K, generator=g, dtype=F64) / K**0.5, dim=-1)
        v = torch.randn(n, V, generator=g, dtype=F64)
        b = (0.05 + 0.9 * torch.rand(n, generator=g, dtype=F64))[:, None, None]
        kS = k[:, None, :] @ S  # [n, 1, V]
        S = a * (S - b * k[:, :, None] * kS) + b * k[:, :, None] * v[:, None, :]
    return S.clone()


def hard_states(r: int, K: int = 128, V: int = 128, seed: int = 0) -> tuple[torch.Tensor, list[str]]:
    """A battery of hard states for rank r: returns ([N, K, V] float64, names)."""
    m = min(K, V)
    i = torch.arange(m, dtype=F64)
    spectra: dict[str, list[torch.Tensor]] = {"clustered": [], "rankdef": [], "illcond": []}
    # clustered / repeated singular values around the cut
    for w in (2, 6):
        s = torch.exp(-0.05 * i)
        s[max(r - w, 0) : min(r + w, m)] = s[max(r - w, 0)]
        spectra["clustered"].append(s)
    s = torch.exp(-0.05 * i)
    s[r] = s[r - 1]  # σ_r = σ_{r+1} exactly
    spectra["clustered"].append(s)
    s = torch.exp(-0.05 * i)
    s[r:] = s[r:] / s[r] * s[r - 1] * (1 - 1e-6)  # gap 1e-6
    spectra["clustered"].append(s)
    spectra["clustered"].append(torch.ones(m))  # all equal
    s = torch.ones(m)
    s[: max(r - 1, 1)] = 10.0  # big head, σ_r on a flat tail
    spectra["clustered"].append(s)
    # rank-deficient: rank below, at and just above r
    for rk in sorted({1, max(r // 2, 1), max(r - 1, 1), r, r + 1}):
        s = torch.exp(-0.1 * i)
        s[rk:] = 0
        spectra["rankdef"].append(s)
        s = torch.ones(m)
        s[rk:] = 0
        spectra["rankdef"].append(s)
    # very ill-conditioned
    spectra["illcond"] += [10 ** (-16 * i / m), 10 ** (-8 * i / m)]
    s = torch.full((m,), 1e-8)
    s[0] = 1.0
    spectra["illcond"].append(s)
    s = torch.full((m,), 1e-6)
    s[:r] = torch.logspace(0, -4, r, dtype=F64)
    spectra["illcond"].append(s)

    mats, names = [], []
    for j, (name, ss) in enumerate(spectra.items()):
        mats.append(_from_spectra(torch.stack(ss), K, V, seed * 101 + j))
        names += [name] * len(ss)
    mats.append(_from_spectra(_gdn_like_spectra(12, m, seed), K, V, seed * 101 + 7))
    names += ["gdn_like"] * 12
    mats.append(_toy_gdn_states(6, K, V, 0).clone())
    names += ["toy_gdn"] * 6
    scaled = _from_spectra(_gdn_like_spectra(2, m, seed + 1), K, V, seed * 101 + 8)
    mats.append(scaled * torch.tensor([1e-30, 1e30], dtype=F64)[:, None, None])
    names += ["scaled"] * 2
    g = torch.Generator().manual_seed(seed + 3)
    lr = torch.randn(2, K, 3, generator=g, dtype=F64) @ torch.randn(2, 3, V, generator=g, dtype=F64)
    mats.append(lr + 1e-4 * torch.randn(2, K, V, generator=g, dtype=F64))
    names += ["lowrank_noise"] * 2
    mats.append(torch.zeros(1, K, V, dtype=F64))
    names += ["zero"]
    return torch.cat(mats), names


def _check_energy(S, out, r, names, tol=TOL):
    err = energy_error(S, out, r)
    assert torch.isfinite(out).all()
    bad = [(names[i], f"{err[i].item():.2e}") for i in range(len(names)) if not err[i] <= tol]
    assert not bad, f"rank {r}: energy error above {tol} for {bad}"
    return err


# ---------------------------------------------------------------------------------------------- exactness
@pytest.fixture(scope="module", params=RANKS)
def battery(request, one_thread):
    r = request.param
    S, names = hard_states(r, seed=r)
    out, basis = truncate_states(S, r, return_basis=True)
    return r, S, names, out, basis


def test_energy_within_tolerance_for_every_state(battery):
    r, S, names, out, _ = battery
    _check_energy(S, out, r, names)
    assert out.shape == S.shape and out.dtype == S.dtype


def test_close_to_exact_truncation_where_the_gap_allows(battery):
    """‖ours − exact‖²_F ≤ 2 σ₁² · (energy deficit) / (σ_r² − σ_{r+1}²): a deficit in energy bounds the distance to
    the exact projection by the gap. Tight where the cut has a gap, vacuous where σ_r = σ_{r+1} (non-unique)."""
    r, S, names, out, _ = battery
    U, s, _ = torch.linalg.svd(S, full_matrices=False)
    ref = U[..., :r] @ (U[..., :r].mT @ S)  # = exact_truncate(S, r)
    s2 = s.square()
    gap = s2[:, r - 1] - s2[:, r]
    deficit = (ref.square().sum((-1, -2)) - out.square().sum((-1, -2))).clamp_min(0)
    slack = 1e-13 * s2.sum(-1)
    dist2 = (out - ref).square().sum((-1, -2))
    bound = 2 * s2[:, 0] * (deficit + slack) / gap.clamp_min(1e-300)
    ok = (dist2 <= bound) | (gap <= 1e-12 * s2.sum(-1))
    assert ok.all(), [names[i] for i in torch.nonzero(~ok).flatten().tolist()]
    # and on well separated cuts the two answers agree to high accuracy
    sep = (gap > 1e-2 * s2.sum(-1)) & (s2[:, 0] > 0)
    rel = dist2[sep].sqrt() / s2[sep].sum(-1).sqrt()
    assert (rel < 1e-6).all(), rel.max()


def test_projection_properties(battery):
    r, S, names, out, basis = battery
    U = basis[..., :r]
    n = S.square().sum((-1, -2)).sqrt()[:, None, None].clamp_min(1e-300)
    # the basis is orthonormal for every state (rank-deficient and zero states included)
    eye = torch.eye(r, dtype=F64)
    assert (U.mT @ U - eye).abs().amax() < 1e-12
    # S_r = U_r U_rᵀ S, so S − S_r ⟂ U_r and rank(S_r) ≤ r
    assert ((U.mT @ (S - out)).abs() / n).amax() < 1e-12
    assert ((U @ (U.mT @ S) - out).abs() / n).amax() < 1e-12
    sv = torch.linalg.svdvals(out)
    if r < sv.shape[-1]:
        assert (sv[:, r] <= 1e-12 * n[:, 0, 0]).all()
    # truncating twice = truncating once: exactly (to rounding) where the kept part is well conditioned; to the
    # G² precision floor (directions below ~1e-4 σ₁ are resolved only to ~1e-8 of the energy) elsewhere
    twice = truncate_states(out, r)
    n2 = S.square().sum((-1, -2)).clamp_min(1e-300)
    d = (twice - out).square().sum((-1, -2)) / n2
    assert d.max() < 1e-6
    s = torch.linalg.svdvals(S)
    well = s[:, r - 1] > 1e-2 * s[:, 0]
    assert d[well].max() < 1e-20
    assert ((retained_energy(S, out) - retained_energy(S, twice)).abs() < 1e-6).all()


@pytest.mark.parametrize("K,V,r", [(128, 64, 4), (128, 64, 32), (64, 128, 1), (64, 128, 12), (96, 128, 20)])
def test_rectangular_states(K, V, r):
    S, names = hard_states(r, K=K, V=V, seed=10 + r)
    out = truncate_states(S, r)
    assert out.shape == S.shape
    _check_energy(S, out, r, names)


def test_exact_reference_is_the_svd_truncation():
    S, _ = hard_states(4, seed=3)
    U, s, Vh = torch.linalg.svd(S)
    ref = (U[..., :4] * s[:, None, :4]) @ Vh[..., :4, :]
    assert torch.allclose(exact_truncate(S, 4), ref, atol=1e-12 * S.abs().max().item())
    assert torch.equal(exact_truncate(S, 128), S)


@pytest.mark.parametrize("method", ["eigh", "svd", "subspace"])
def test_methods_agree(method):
    S, names = hard_states(12, seed=5)
    _check_energy(S, truncate_states(S, 12, method=method), 12, names)


@pytest.mark.parametrize("r", [4, 20])
def test_chebyshev_filter_option(monkeypatch, r):
    """The optional degree-2 Chebyshev filter (one more eigh per pass, one step fewer) meets the same tolerance."""
    import gdnviz.truncate as tr

    monkeypatch.setattr(tr, "_FILTER", "chebyshev")
    S, names = hard_states(r, seed=15)
    out, basis = truncate_states(S, r, return_basis=True)
    _check_energy(S, out, r, names)
    assert (basis.mT @ basis - torch.eye(basis.shape[-1], dtype=F64)).abs().max() < 1e-12


def test_large_ranks_use_an_exact_decomposition():
    S, names = hard_states(40, seed=6)
    for r in (33, 64, 127):
        _check_energy(S, truncate_states(S, r), r, names, tol=1e-10)
    with pytest.raises(ValueError, match="subspace"):
        truncate_states(S, 40, method="subspace")


# ------------------------------------------------------------------------------------- unchanged / shapes
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_rank_at_least_min_dim_returns_input_unchanged(dtype):
    S = torch.randn(5, 128, 64).to(dtype)
    for r in (64, 65, 1000):
        out = truncate_states(S, r)
        assert out.dtype == dtype and torch.equal(out, S)
    out = truncate_states(S, [64, 3, 200, 1, 64])
    assert torch.equal(out[[0, 2, 4]], S[[0, 2, 4]])
    assert not torch.equal(out[1], S[1])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_dtype_shape_and_device_preserved(dtype):
    sig = _gdn_like_spectra(6, 128, seed=7)
    sig[:, 4:] *= 0.5 * sig[:, 3:4] / sig[:, 4:5]  # a clear gap at the cut: the truncation is unique
    S = _from_spectra(sig, 128, 128, seed=7)
    S = (S / S.abs().amax((-1, -2), keepdim=True)).reshape(2, 3, 128, 128).to(dtype)
    out, basis = truncate_states(S, 4, return_basis=True)
    assert out.dtype == dtype and out.shape == S.shape and out.device == S.device
    assert basis.dtype == torch.float64 and basis.shape[:2] == (6, 128)
    ref = exact_truncate(S.double(), 4)
    tol = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    assert (out.double() - ref).abs().max() <= tol * max(1.0, S.double().abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    S, names = hard_states(12, seed=8)
    out = truncate_states(S.cuda().float(), 12)
    assert out.is_cuda and out.dtype == torch.float32
    _check_energy(S, out.cpu().double(), 12, names, tol=2e-5)


# ------------------------------------------------------------------------------------------ per-head ranks
def test_per_state_ranks():
    S, names = hard_states(32, seed=9)
    n = S.shape[0]
    choices = [1, 2, 4, 12, 16, 17, 32, 40, 128, 500]
    ranks = [choices[i % len(choices)] for i in range(n)]
    out, basis = truncate_states(S, torch.tensor(ranks), return_basis=True)
    _check_energy(S, out, ranks, names)
    for i, r in enumerate(ranks):
        if r >= 128:
            assert torch.equal(out[i], S[i])
    # same answer from a list, a tuple, and per-group single-rank calls
    assert torch.equal(truncate_states(S, ranks), out)
    assert torch.equal(truncate_states(S, tuple(ranks)), out)
    np = pytest.importorskip("numpy")
    assert torch.equal(truncate_states(S, np.array(ranks)), out)
    for r in (4, 40):
        idx = [i for i, x in enumerate(ranks) if x == r]
        assert energy_error(S[idx], out[idx], r).max() <= TOL
    # the leading r_i basis columns are orthonormal and span the kept part
    for i, r in enumerate(ranks):
        if r < 128:
            U = basis[i, :, :r]
            assert (U.mT @ U - torch.eye(r, dtype=F64)).abs().max() < 1e-12
            assert torch.allclose(U @ (U.mT @ S[i]), out[i], atol=1e-12 * S[i].abs().max().item())


def test_per_state_ranks_one_group_has_no_gather():
    S, names = hard_states(12, seed=11)
    ranks = [1 + (i % 12) for i in range(S.shape[0])]
    _check_energy(S, truncate_states(S, ranks), ranks, names)


# ----------------------------------------------------------------------------------------------- warm start
def test_warm_start_gives_the_same_answer():
    torch.manual_seed(0)
    S0, names = hard_states(12, seed=12)
    S0 = S0[[i for i, nm in enumerate(names) if nm in ("gdn_like", "toy_gdn")]]
    r = 12
    out0, basis = truncate_states(S0, r, return_basis=True)
    S = S0
    for t in range(3):  # slow drift: rotate a little and write a few new directions
        A = torch.randn(S.shape[0], 128, 128, dtype=F64)
        R = torch.linalg.matrix_exp(0.01 * (A - A.mT))
        S = 0.97 * R @ S + 0.05 * S.norm(dim=(-1, -2), keepdim=True) / 128 * torch.randn_like(S)
        cold = truncate_states(S, r)
        warm, basis = truncate_states(S, r, warm_start=basis, return_basis=True)
        _check_energy(S, warm, r, ["drift"] * S.shape[0])
        assert (energy_error(S, warm, r) - energy_error(S, cold, r)).abs().max() < TOL
    # one iteration fewer from the warm start still meets the tolerance on slowly drifting states
    fewer = truncate_states(S, r, warm_start=basis, iters=iterations_for(r) - 1)
    _check_energy(S, fewer, r, ["drift"] * S.shape[0])


def test_stale_or_bad_warm_start_is_harmless():
    S, names = hard_states(4, seed=13)
    n = S.shape[0]
    junk = torch.linalg.qr(torch.randn(n, 128, 32, dtype=F64))[0]
    for ws in (junk, torch.zeros(n, 128, 32, dtype=F64), junk[..., :2]):
        _check_energy(S, truncate_states(S, 4, warm_start=ws), 4, names)
    with pytest.raises(ValueError, match="warm_start"):
        truncate_states(S, 4, warm_start=junk[:3])


# ------------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("bad", [0, -1, 2.5, "3", True, None, torch.tensor(1.0), torch.tensor([0, 1])])
def test_bad_ranks_raise(bad):
    S = torch.randn(2, 128, 128)
    with pytest.raises(RankOutOfRange, match="rank"):
        truncate_states(S, bad)


def test_bad_per_state_ranks_raise():
    S = torch.randn(3, 128, 128)
    with pytest.raises(RankOutOfRange, match="state 1"):
        truncate_states(S, [4, 0, 4])
    with pytest.raises(RankOutOfRange, match="state 2"):
        truncate_states(S, [4, 4, 1.5])
    with pytest.raises(ValueError, match="one entry per state"):
        truncate_states(S, [4, 4])
    with pytest.raises(ValueError, match="iters"):
        truncate_states(S, 4, iters=-1)
    with pytest.raises(RankOutOfRange):
        exact_truncate(S, 0)


def test_zero_states_give_zeros():
    S = torch.zeros(3, 128, 128)
    S[1] = torch.randn(128, 128)
    for r in (1, 4, 20, 40):
        out = truncate_states(S, r)
        assert torch.isfinite(out).all()
        assert torch.equal(out[0], torch.zeros(128, 128)) and torch.equal(out[2], torch.zeros(128, 128))
    assert torch.equal(retained_energy(S, truncate_states(S, 4))[[0, 2]], torch.ones(2, dtype=F64))


def test_empty_batch():
    S = torch.zeros(0, 128, 128)
    assert truncate_states(S, 4).shape == (0, 128, 128)


# ------------------------------------------------------------------------------------------------- teeth
def test_the_checks_have_teeth():
    """Unconverged variants must fail the same checks: 0 or 1 filter step instead of the default, and a naive subspace
    iteration without oversampling (block = r, like the first probe) — all miss by far more than the tolerance."""
    r = 12
    S, names = hard_states(r, seed=14)
    for it in (0, 1):
        err = energy_error(S, truncate_states(S, r, iters=it), r)
        assert err.max() > 10 * TOL, (it, err.max())
        with pytest.raises(AssertionError):
            _check_energy(S, truncate_states(S, r, iters=it), r, names)

    def naive(X, r, iters=4):  # block size r, random start, no Rayleigh–Ritz oversampling
        G = X @ X.mT
        Q = torch.randn(X.shape[0], X.shape[1], r, dtype=F64, generator=torch.Generator().manual_seed(0))
        for _ in range(iters):
            Q = torch.linalg.qr(G @ Q)[0]
        return Q @ (Q.mT @ X)

    err = energy_error(S, naive(S, r), r)
    assert err.max() > 10 * TOL
    # ... and it misses on the clustered spectra in particular (σ near σ_r repeated)
    assert max(err[i].item() for i, nm in enumerate(names) if nm == "clustered") > TOL
