"""Batched singular values (gdnviz.gpu.symeig) pinned to float64 torch.linalg.svdvals, on both paths.

The fallback (``torch.linalg.eigvalsh`` of the float64 Gram matrices) runs on the CPU; the fast path's CUDA kernels run
on the CPU through tests.support.cuda_emul (g++, CUDA's threads emulated), and for real on CUDA on full-size states
(288 heads of 128×128).
"""
import pytest
import torch

from cuda_kernel_checks import needs_gxx


def cases(n_big, K, V, device) -> dict:
    """Test states ``name -> [n_big, K, V]`` float32 on ``device``: decaying, repeated, rank-deficient, zero, random and
    12-decade spectra."""
    g = torch.Generator().manual_seed(0)
    n = min(K, V)
    out = {}
    U = torch.linalg.qr(torch.randn(n_big, K, K, generator=g, dtype=torch.float64))[0]
    W = torch.linalg.qr(torch.randn(n_big, V, V, generator=g, dtype=torch.float64))[0]
    def make(s):
        s = s.expand(n_big, n)
        return ((U[:, :, :n] * s[:, None, :]) @ W[:, :, :n].transpose(-1, -2)).float().to(device)
    r = torch.arange(n, dtype=torch.float64)
    out["decaying"] = make(torch.exp(-r * (0.05 + torch.rand(n_big, 1, generator=g, dtype=torch.float64) * 0.3)))
    out["repeated"] = make(torch.where(r < n // 2, 1.0, 0.5).expand(n_big, n))
    out["rank_deficient"] = make(torch.where(r < 3, 1.0 / (r + 1), 0.0).expand(n_big, n))
    out["zero"] = torch.zeros(n_big, K, V, device=device)
    out["random"] = torch.randn(n_big, K, V, generator=g).to(device)
    out["huge_range"] = make(10.0 ** (-r * 12 / n).expand(n_big, n))
    return out


def _max_errors(ours, ref):
    """(max |Δσ| / σ_max, max relative error on σ ≥ 1e-3·σ_max)."""
    smax = ref[:, :1].clamp_min(1e-300)
    abs_err = ((ours - ref).abs() / smax).max().item()
    big = ref >= 1e-3 * smax
    rel = ((ours - ref).abs() / ref.clamp_min(1e-300))[big]
    return abs_err, (rel.max().item() if rel.numel() else 0.0)


def cuda_cases() -> dict:
    """The :func:`cases` at full size on CUDA: name -> [288, 128, 128]."""
    return cases(288, 128, 128, "cuda")


def assert_matches_svdvals(ours, ref, name) -> None:
    """GPU singular values vs float64 ``torch.linalg.svdvals``: 1e-7·σ_max absolute, 1e-9 relative for σ ≥ 1e-3·σ_max,
    the same numerical ranks."""
    from gdnviz.analysis import spectra

    abs_err, rel_err = _max_errors(ours, ref)
    assert abs_err < 1e-7 and rel_err < 1e-9, (name, abs_err, rel_err)
    o, r = ours.cpu().numpy(), ref.cpu().numpy()
    assert (spectra.numerical_rank(o) == spectra.numerical_rank(r)).all(), name


def _check(ours, ref, case) -> None:
    """The bounds of every path: finite, 1e-7·σ_max absolute (≈ sqrt(ε_f64) on the smallest values), 1e-9 relative
    for σ ≥ 1e-3·σ_max (error ≈ ε·σ_max²/σ²)."""
    assert bool(torch.isfinite(ours).all()), case
    abs_err, rel_err = _max_errors(ours, ref)
    assert abs_err < 1e-7, (case, abs_err)
    assert rel_err < 1e-9, (case, rel_err)


def test_symeig_fallback_matches_svdvals():
    """The CPU path (and the one for sizes the kernels do not take): LAPACK eigvalsh of the float64 Gram matrix."""
    from gdnviz.gpu import symeig

    for (K, V) in [(8, 8), (16, 12), (12, 32), (64, 64), (128, 96)]:
        for name, S in cases(3, K, V, "cpu").items():
            assert not symeig.uses_kernels(symeig.gram(S))
            _check(symeig.svdvals(S), torch.linalg.svdvals(S.double()), f"{K}x{V}:{name}")


@needs_gxx
def test_symeig_emulated_kernels_match_svdvals():
    """The fast path's two kernels (tridiagonalisation, bisection) emulated on the CPU, on the Gram matrices symeig
    forms (both sides: K < V and K > V), against float64 torch.linalg.svdvals."""
    from gdnviz.gpu import symeig
    from tests.support import emulated_spectra

    for (K, V) in [(64, 64), (64, 96), (96, 64)]:
        for name, S in cases(2, K, V, "cpu").items():
            lam = torch.from_numpy(emulated_spectra.eigvalsh(symeig.gram(S).numpy()))
            ours = lam.clamp_min(0).sqrt().flip(-1)
            ref = torch.linalg.svdvals(S.double())
            _check(ours, ref, f"{K}x{V}:{name}")
            assert_matches_svdvals(ours, ref, f"{K}x{V}:{name}")


@pytest.mark.gpu
def test_symeig_cuda_full_size_matches_svdvals():
    from gdnviz.analysis import spectra
    from gdnviz.gpu import symeig

    for name, S in cuda_cases().items():
        assert symeig.uses_kernels(symeig.gram(S)), (symeig.cuda_tridiag.KERNELS.reason,
                                                     symeig.cuda_bisect.KERNELS.reason)
        ours = symeig.svdvals(S)
        ref = torch.linalg.svdvals(S.double())
        assert_matches_svdvals(ours, ref, name)
        o, r = ours.cpu().numpy(), ref.cpu().numpy()
        import numpy as np

        # σ agrees to ~1e-8·σ_max (sqrt(ε_f64) of the Gram route); the entropy sums 128 such terms, so erank
        # agrees to ~1e-7 relative (H200, 2026-11-29: worst 1.05e-7 of 288 states): 1e-6 leaves 10× margin.
        np.testing.assert_allclose(spectra.effective_rank(o), spectra.effective_rank(r), rtol=1e-6)


def test_symeig_fallback_ignores_a_skip_mask():
    """The fallback computes every row (a skip mask only saves the kernels' work; callers do not read skipped rows)."""
    from gdnviz.gpu import symeig

    G = symeig.gram(cases(2, 64, 64, "cpu")["random"])
    skip = torch.tensor([True, False])
    assert torch.equal(symeig.eigvalsh(G, skip=skip), symeig.eigvalsh(G))


@needs_gxx
def test_symeig_emulated_kernels_skip_the_masked_matrices():
    """The fast path emulated with a skip mask: skipped rows zeros, the others the same bits as without a mask."""
    from gdnviz.gpu import symeig
    from tests.support import emulated_spectra

    S = torch.cat([cases(1, 64, 64, "cpu")[k] for k in ("decaying", "random", "rank_deficient")])
    G = symeig.gram(S).numpy()
    skip = [0, 1, 0]
    full = emulated_spectra.eigvalsh(G)
    part = emulated_spectra.eigvalsh(G, skip)
    assert (part[1] == 0).all()
    assert (part[[0, 2]].view("u8") == full[[0, 2]].view("u8")).all()


@pytest.mark.gpu
def test_symeig_cuda_skip_mask():
    """On the GPU: ``eigvalsh(G, skip)`` leaves zeros in the skipped rows and the same bits elsewhere."""
    from gdnviz.gpu import symeig

    S = torch.cat(list(cuda_cases().values()))
    G = symeig.gram(S)
    assert symeig.uses_kernels(G)
    skip = torch.arange(G.shape[0], device=G.device) % 2 == 0
    full, part = symeig.eigvalsh(G), symeig.eigvalsh(G, skip=skip)
    assert not part[skip].any() and torch.equal(part[~skip], full[~skip])
