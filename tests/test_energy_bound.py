"""gdnviz.truncation.energy_error_bound: a rigorous a-posteriori bound on a truncation's energy error (no SVD).

It must never be below the actual error (checked against the float64 SVD on every battery of test_truncate.py,
after 0, 1 and 2 filter steps, where many states are far from converged), it must certify converged states (GDN-like
spectra at the default iteration counts), refuse a cut inside a cluster (σ_r = σ_{r+1}: no gap, no bound), be ~0 on
the exact singular directions, and 0 on a zero state.
"""
import pytest
import torch

from gdnviz import truncation as tr
from gdnviz.truncation import reference
from tests.support.states import gdn_like_states, hard_states

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("r", [1, 4, 12, 16])
def test_never_below_the_actual_error(r):
    S, names = hard_states(r, seed=r)
    for iters in (0, 1, 2):
        Q = reference.subspace_pass(S, r, iters)
        bound = tr.energy_error_bound(S, Q, r)
        actual = tr.energy_error(S, Q[..., :r] @ (Q[..., :r].mT @ S), r)
        bad = [(names[i], bound[i].item(), actual[i].item()) for i in range(len(names))
               if not bound[i] >= actual[i] - 1e-12]
        assert not bad, (iters, bad)


def test_certifies_converged_states_and_refuses_a_cut_in_a_cluster():
    X = gdn_like_states(64, 128, 128, seed=3)
    for r, share in ((1, 1.0), (4, 1.0), (12, 0.9), (16, 0.85)):  # measured 1.0 / 1.0 / 0.92 / 0.88
        Q = reference.subspace_pass(X, r, tr.iterations_for(r))
        assert (tr.energy_error_bound(X, Q, r) <= 1e-5).double().mean().item() >= share, r
    # σ_4 = σ_5 exactly: the truncation is not unique and no gap exists, so the bound must not certify
    g = torch.Generator().manual_seed(0)
    s = torch.exp(-0.1 * torch.arange(128, dtype=F64))
    s[4] = s[3]
    U = torch.linalg.qr(torch.randn(128, 128, generator=g, dtype=F64))[0]
    V = torch.linalg.qr(torch.randn(128, 128, generator=g, dtype=F64))[0]
    S = ((U * s) @ V.mT)[None]
    Q = reference.subspace_pass(S, 4, 8)
    assert torch.isinf(tr.energy_error_bound(S, Q, 4)).all()


def test_exact_directions_and_zero_and_validation():
    g = torch.Generator().manual_seed(1)
    s = torch.exp(-0.2 * torch.arange(64, dtype=F64))
    U = torch.linalg.qr(torch.randn(2, 128, 128, generator=g, dtype=F64))[0]
    V = torch.linalg.qr(torch.randn(2, 64, 64, generator=g, dtype=F64))[0]
    S = (U[..., :64] * s) @ V.mT  # [2, 128, 64]
    S[1] = 0
    exact = U[..., :32]
    b = tr.energy_error_bound(S, exact, 6)
    assert b[0].item() <= 1e-12 and b[1].item() == 0.0
    # a basis of exact singular directions that misses the top one has zero residuals: only G's part outside it
    # (‖D‖_F ≥ σ_1²) shows that its "top 6" are not the top 6, so the bound must refuse (the error is σ_1² − σ_7²)
    missing = U[..., 1:33]
    assert tr.energy_error(S[:1], missing[:1, :, :6] @ (missing[:1, :, :6].mT @ S[:1]), 6).item() > 0.1
    assert torch.isinf(tr.energy_error_bound(S[:1], missing[:1], 6)).all()
    with pytest.raises(ValueError):
        tr.energy_error_bound(S, exact, 33)
    with pytest.raises(ValueError):
        tr.energy_error_bound(S, exact[:1], 4)


def rank24_small_gap_state() -> torch.Tensor:
    """``[1, 128, 128]`` float64 of rank 24 whose trace-1 Gram matrix has λ₆ = 2e-7, λ₇ = 1e-7 (then 5e-8 … 1e-9)."""
    g = torch.Generator().manual_seed(2)
    lam = torch.zeros(128, dtype=F64)
    lam[:24] = torch.tensor([0.5, 0.3, 0.15, 0.05, 1e-3, 2e-7, 1e-7] + torch.logspace(-7.3, -9, 17).tolist(),
                            dtype=F64)
    U = torch.linalg.qr(torch.randn(128, 128, generator=g, dtype=F64))[0]
    V = torch.linalg.qr(torch.randn(128, 128, generator=g, dtype=F64))[0]
    return ((U * lam.sqrt()) @ V.mT)[None]


def test_small_eigenvalues_are_certified_without_cancellation():
    """G's part outside the basis is not taken from ‖G‖² − ‖T‖² − 2‖R‖² alone: on a rank-24 state whose
    eigenvalues (of the trace-1 Gram matrix) at the cut are λ_6 = 2e-7 and λ_7 = 1e-7, that difference cancels to a
    ‖D‖_F of ~2.7e-7 (the true one is 0: the 32-column basis holds the whole range), above λ_6, so the cancelled form
    refused a converged state (the demo model's trajectories had such states); the bound caps it by tr(D) = 1 − tr(T),
which does not cancel."""
    S = rank24_small_gap_state()
    Q = reference.subspace_pass(S, 6, 2)
    b = tr.energy_error_bound(S, Q, 6)
    actual = tr.energy_error(S, Q[..., :6] @ (Q[..., :6].mT @ S), 6)
    assert b.item() <= 1e-10 and b.item() >= actual.item() - 1e-12
    # the cancelled form on the same basis: its ‖D‖_F is noise above λ_6 = 2e-7, which made the gap negative
    G = S @ S.mT / S.square().sum()
    T = Q.mT @ G @ Q
    T = 0.5 * (T + T.mT)
    R = G @ Q - Q @ T
    d2 = G.square().sum() - T.square().sum() - 2 * R.square().sum()
    assert d2.abs().sqrt().item() > 2e-7
