"""Tests of gdnviz.truncation: the batched top-r truncation of GDN head states, on the CPU.

The accuracy criterion is the one the probe relies on: the retained energy ‖S_r‖²_F is within 1e-5 (relative to
‖S‖²_F) of the exact top-r energy, for every state of hard batteries (tests.support.states). ``truncate_states`` on the
CPU runs the CUDA kernel's algorithm in float64 torch (``reference.subspace_truncate``), certifies every state with
the energy-error bound and answers the uncertified ones exactly; the algorithm alone is tested on the same batteries.
"""

from __future__ import annotations

import pytest
import torch

from gdnviz.errors import RankOutOfRange
from gdnviz.truncation import (
    TruncationSpec,
    energy_error,
    energy_error_bound,
    exact_truncate,
    retained_energy,
    truncate_states,
)
from gdnviz.truncation import constants as C
from gdnviz.truncation import reference
from gdnviz.truncation.callback import graph_truncation
from tests.support.states import from_spectra, hard_states, seeded_gdn_like_spectra, slow_states

TOL = 1e-5
RANKS = (1, 2, 4, 12, 32)
F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")


def _full(n: int, r: int) -> torch.Tensor:
    return torch.full((n,), r)


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
    return r, S, names, truncate_states(S, r), reference.subspace_truncate(S, _full(S.shape[0], r))


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
    r, S, names, out, res = battery
    U = res.U[..., :r]
    n = S.square().sum((-1, -2)).sqrt()[:, None, None].clamp_min(1e-300)
    # the subspace algorithm's basis is orthonormal for every state (rank-deficient and zero states included), to
    # its checked Cholesky-QR's tolerance: a block within ORTH_TOL of orthonormal (its shifted Gram matrix) is kept
    eye = torch.eye(r, dtype=F64)
    assert (U.mT @ U - eye).abs().amax() < C.ORTH_TOL + 2 * C.CHOL_SHIFT
    # S_r = U_r U_rᵀ S, so S − S_r ⟂ U_r and rank(S_r) ≤ r
    assert ((U.mT @ (S - res.out)).abs() / n).amax() < 1e-12
    assert ((U @ (U.mT @ S) - res.out).abs() / n).amax() < 1e-12
    # the answer (the algorithm's, or the exact one where it was not certified) is a projection of S
    Sn, on = S / n, out / n
    assert (on.mT @ (Sn - on)).abs().amax() < 1e-10
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
    sig = seeded_gdn_like_spectra(6, 128, seed=7)
    sig[:, 4:] *= 0.5 * sig[:, 3:4] / sig[:, 4:5]  # a clear gap at the cut: the truncation is unique
    S = from_spectra(sig, 128, 128, seed=7)
    S = (S / S.abs().amax((-1, -2), keepdim=True)).reshape(2, 3, 128, 128).to(dtype)
    out = truncate_states(S, 4)
    assert out.dtype == dtype and out.shape == S.shape and out.device == S.device
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
    out = truncate_states(S, torch.tensor(ranks))
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
    # each answer is a projection of its state of rank ≤ r_i
    for i, r in enumerate(ranks):
        if r < 128:
            n2 = S[i].square().sum().clamp_min(1e-300)
            assert ((out[i].mT @ (S[i] - out[i])).square().sum().sqrt() / n2).item() < 1e-10
            assert torch.linalg.matrix_rank(out[i], rtol=1e-9).item() <= r


def test_per_state_ranks_one_group_has_no_gather():
    S, names = hard_states(12, seed=11)
    ranks = [1 + (i % 12) for i in range(S.shape[0])]
    _check_energy(S, truncate_states(S, ranks), ranks, names)


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


# ------------------------------------------------------------------------------ the subspace algorithm alone
@pytest.mark.parametrize("K,V,r", [(128, 64, 4), (128, 64, 32), (64, 128, 1), (64, 128, 20), (64, 64, 12)])
def test_reference_rectangular_states(K, V, r):
    S, names = hard_states(r, K=K, V=V, seed=10 + r)
    err = energy_error(S, reference.subspace_truncate(S, _full(S.shape[0], r)).out, r)
    assert err.max() <= TOL, [(names[i], err[i].item()) for i in range(len(names)) if err[i] > TOL]


@pytest.mark.parametrize("r", [1, 2, 4, 12, 16, 17, 20, 32])
def test_reference_meets_the_tolerance_on_every_battery_state(r):
    """The kernel's algorithm in torch, without the certificate's exact answers, on all of hard_states."""
    S, names = hard_states(r, seed=r)
    out = reference.subspace_truncate(S, _full(S.shape[0], r)).out
    err = energy_error(S, out, r)
    bad = [(names[i], f"{err[i].item():.1e}") for i in range(len(names)) if not err[i] <= TOL]
    assert not bad, bad
    assert torch.equal(out[names.index("zero")], torch.zeros_like(S[0]))


def test_checked_cholqr_leaves_only_orthonormal_blocks_as_they_are():
    """A block whose shifted Gram matrix is within ORTH_TOL of the identity comes back bit for bit, any other is
    factorised (``cholqr``) bit for bit; only the leading ``check`` columns are tested, per state; ``check = 0``
    always factorises. Teeth: the factorisation moves an orthonormal block (so a skip is visible), by less than
    ORTH_TOL."""
    cholqr, checked = reference.cholqr, reference.checked_cholqr
    g = torch.Generator().manual_seed(3)
    Z = torch.randn(3, 128, 32, generator=g, dtype=F64)
    Q = cholqr(cholqr(Z))  # orthonormal to ~1e-13 (the shift)
    assert not torch.equal(cholqr(Q), Q) and (cholqr(Q) - Q).abs().max().item() < C.ORTH_TOL
    assert torch.equal(checked(Q, 32), Q)
    assert torch.equal(checked(Q, 0), cholqr(Q))
    assert torch.equal(checked(Z, 32), cholqr(Z))
    X = torch.cat([Q[:1], Z[:1], Q[2:]])  # per state: kept, factorised, kept
    got = checked(X, 32)
    assert torch.equal(got[0], Q[0]) and torch.equal(got[1], cholqr(Z[:1])[0]) and torch.equal(got[2], Q[2])
    # only the leading columns count: U of a rank-20 state (columns 20 … 31 zero) is orthonormal where it matters
    U = Q.clone()
    U[..., 20:] = 0.0
    assert torch.equal(checked(U, 20), U)
    assert torch.equal(checked(U, torch.tensor([20, 32, 20])), torch.stack([U[0], cholqr(U[1:2])[0], U[2]]))
    # just outside the tolerance: factorised
    W = Q.clone()
    W[:, :, 0] *= 1.0 + 2 * C.ORTH_TOL
    assert torch.equal(checked(W, 32), cholqr(W))
    Wn = Q.clone()
    Wn[0, 5, 3] = float("nan")
    assert torch.isnan(checked(Wn, 32)[0]).all()  # a NaN is never orthonormal: factorised (all NaN)


def test_kernel_source_constants_are_the_references():
    """The CUDA source's #defines are the constants the torch implementation uses."""
    import re

    from gdnviz.truncation import cuda

    src = cuda.source(128, 128)
    for name, value in (("ORTH_TOL", C.ORTH_TOL), ("SHIFT", C.CHOL_SHIFT), ("TINY", C.TINY), ("FILLC", C.FILL)):
        assert float(re.search(rf"#define {name} (\S+)", src).group(1)) == value, name


def test_reference_unconverged_fails():
    """With 0 filter steps the same algorithm misses the tolerance: the iteration counts are load-bearing."""
    S, _ = hard_states(12, seed=12)
    err = energy_error(S, reference.subspace_truncate(S, _full(S.shape[0], 12), iters=0).out, 12)
    assert err.max() > 10 * TOL


# ------------------------------------------------------------------------------------- the 1e-5 contract
@pytest.mark.parametrize("r", [1, 4, 12, 16, 17, 32])
def test_slowly_decaying_spectra_meet_the_contract(r):
    """Nearly flat and slowly decaying spectra (Gaussian matrices, σᵢ = exp(−c i) with c = 0.003 … 0.01, sqrt-linear,
    a small gap and a near-cluster at the cut, a zero state): the default steps alone miss 1e-5 on several (teeth,
    checked here), the certificate refuses those, and their exact answers meet it."""
    S, names = slow_states(r, seed=r)
    raw = reference.subspace_truncate(S, _full(S.shape[0], r))
    raw_err = energy_error(S, raw.out, r)
    assert raw_err.max() > TOL, raw_err.tolist()  # the algorithm alone fails here
    bound = reference.certificate(S, raw, [r] * S.shape[0])
    assert (bound >= raw_err - 1e-12).all(), (bound.tolist(), raw_err.tolist())  # never below the actual error
    assert not (bound[raw_err > TOL] <= C.CERT_TOL).any()
    out = truncate_states(S, r)
    _check_energy(S, out, r, names)
    assert torch.equal(out[names.index("zero")], torch.zeros_like(S[0]))
    # per-state ranks and float32 states take the same route
    out32 = truncate_states(S.float(), [r] * S.shape[0])
    _check_energy(S, out32.double(), r, names, tol=TOL + 1e-6)


@pytest.mark.parametrize("r", [1, 4, 12, 16, 17, 32])
def test_certificate_is_never_below_the_actual_error(r):
    """On every battery state, after 0, 2 and the default filter steps: the certificate bounds the actual error."""
    S, names = hard_states(r, seed=r)
    for iters in (0, 2, None):
        res = reference.subspace_truncate(S, _full(S.shape[0], r), iters=iters)
        bound = reference.certificate(S, res, [r] * S.shape[0])
        actual = energy_error(S, res.out, r)
        bad = [(names[i], bound[i].item(), actual[i].item()) for i in range(len(names))
               if not bound[i] >= actual[i] - 1e-12]
        assert not bad, (iters, bad)


def test_certificate_certifies_gdn_like_states():
    """On GDN-like states the algorithm's answers are certified (few exact answers are needed): ≥ 95% at r = 1 … 16."""
    from tests.support.states import gdn_like_states

    X = gdn_like_states(64, 128, 128, seed=3)
    for r in (1, 4, 12, 16):
        res = reference.subspace_truncate(X, _full(64, r))
        share = (reference.certificate(X, res, [r] * 64) <= C.CERT_TOL).double().mean().item()
        assert share >= 0.95, (r, share)


# --------------------------------------------------------------------------------------------- spec, callback
def test_spec_ranks_are_validated_not_rounded():
    with pytest.raises(RankOutOfRange, match="2.5"):
        TruncationSpec({(0, 0): 2.5})
    for bad in (True, 0, -3, "4", None, 4.0):
        with pytest.raises(RankOutOfRange):
            TruncationSpec([(0, 1, bad)])
    with pytest.raises(ValueError):
        TruncationSpec([(0,)])
    with pytest.raises(ValueError):
        TruncationSpec([(0.5, 1, 4)])
    np = pytest.importorskip("numpy")
    spec = TruncationSpec({(np.int64(3), 1): np.int32(4), (0, 2): 1})
    assert spec.ranks == (((0, 2), 1), ((3, 1), 4)) and all(type(r) is int for _, r in spec.ranks)


def test_graph_boundary_function_every_head_equals_the_gather_path():
    """``graph_truncation`` off CUDA (truncate_states): with every head of every row cut it skips the gather /
    scatter; the result equals the gathered path (``rows`` given) bit for bit, equals each head truncated alone, and a
    subset of heads leaves the other heads' bits untouched; per-head ranks repeat over the rows."""
    S, _ = hard_states(4, seed=23)
    S = S[:8].float().reshape(2, 4, 128, 128)
    fn = graph_truncation(torch.arange(4), 4, kernel=False)
    fast = fn(S)
    assert torch.equal(fast, fn(S, rows=torch.arange(2)))  # rows given: the gather / scatter path
    assert torch.equal(fast, truncate_states(S.reshape(8, 128, 128), 4).reshape(S.shape))
    assert energy_error(S.double().reshape(8, 128, 128), fast.double().reshape(8, 128, 128), 4).max() <= 1e-5
    part = graph_truncation(torch.tensor([1, 3]), 4, kernel=False)(S)
    assert torch.equal(part[:, 0], S[:, 0]) and torch.equal(part[:, 2], S[:, 2])
    assert not torch.equal(part[:, 1], S[:, 1])
    rk = [1, 4, 12, 32]
    out = graph_truncation(torch.arange(4), rk, kernel=False)(S)
    assert torch.equal(out, truncate_states(S.reshape(8, 128, 128), rk * 2).reshape(S.shape))
