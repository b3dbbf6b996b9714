"""The CUDA Householder tridiagonalisation (gdnviz.gpu.cuda_tridiag), the first half of gdnviz.gpu.symeig's fast path.

CPU: what ``tridiag`` refuses; where an NVRTC library is found, that the source compiles for sm_90 (n = 64, 128)
without spills; the source run through tests.support.cuda_emul (g++, CUDA's threads emulated) returns a tridiagonal
with G's eigenvalues (1e-13·λ_max). CUDA: ``symeig.svdvals`` with the kernel meets test_symeig's bounds against float64
``torch.linalg.svdvals`` on the same test states (1e-7·σ_max absolute, 1e-9 relative for σ ≥ 1e-3 σ_max, the same
numerical ranks), and its eigenvalues equal float64 ``torch.linalg.eigvalsh`` of the same Gram matrices to 1e-12·λ_max
(exactly, for the zero states).
"""
import numpy as np
import pytest
import torch

from gdnviz.gpu import cuda_tridiag
from cuda_kernel_checks import compile_log, needs_gxx
from test_symeig import assert_matches_svdvals, cuda_cases


def test_sizes_and_refusals():
    assert cuda_tridiag.SIZES == (64, 128)
    assert not cuda_tridiag.supports(torch.zeros(2, 128, 128, dtype=torch.float64))  # CPU: never
    with pytest.raises(ValueError):
        cuda_tridiag.tridiag(torch.zeros(2, 128, 128, dtype=torch.float64))


@pytest.mark.parametrize("n", [64, 128])
def test_source_compiles_for_hopper(n):
    res = compile_log(cuda_tridiag.source(n))
    if res is None:
        pytest.skip("no NVRTC library here (CPU torch without the nvidia-cuda-nvrtc wheel)")
    rc, out = res
    assert rc == 0, out
    assert "0 bytes spill stores" in out, out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tridiag_spectra_match():
    from gdnviz.gpu import symeig

    assert cuda_tridiag.kernel(128, torch.device("cuda")) is not None, cuda_tridiag.KERNELS.reason
    for name, S in cuda_cases().items():
        G = symeig.gram(S)
        assert symeig.uses_kernels(G)
        ours = symeig.svdvals(S)
        assert_matches_svdvals(ours, torch.linalg.svdvals(S.double()), name)
        # eigenvalues of G (σ²) within 1e-12·λ_max of float64 eigvalsh's (the fallback's), as a product rather than a
        # quotient: the zero states' λ_max is 0, and there the bound asks for exact equality
        ref = torch.linalg.eigvalsh(G).clamp_min(0).flip(-1)
        diff = (ours.square() - ref).abs()
        bound = 1e-12 * ref[:, :1]
        assert (diff <= bound).all(), (name, (diff - bound).max().item())
        if name == "zero":
            assert ours.abs().max().item() == 0


@needs_gxx
@pytest.mark.parametrize("n", [64, 128])
def test_emulated_tridiagonal_keeps_the_eigenvalues(n):
    """The kernel's CUDA source run on the CPU (tests.support.cuda_emul): the tridiagonal (D, E) it returns has the
    eigenvalues of G to 1e-13·λ_max (float64 eigvalsh of both) — a random Gram matrix, a graded one (λ from 1 to
    1e-16), rank 3, repeated eigenvalues, and zero (D = E = 0 exactly)."""
    from tests.support import emulated_spectra

    g = torch.Generator().manual_seed(n)
    A = torch.randn(5, n, n, generator=g, dtype=torch.float64)
    Q = torch.linalg.qr(torch.randn(5, n, n, generator=g, dtype=torch.float64))[0]
    lam = torch.stack([torch.ones(n), torch.logspace(0, -16, n, dtype=torch.float64),
                       torch.cat([torch.ones(3), torch.zeros(n - 3)]), torch.tensor([1.0, 2.0]).repeat(n // 2),
                       torch.zeros(n)]).double()
    G = (Q * lam[:, None, :]) @ Q.mT
    G[0] = A[0] @ A[0].mT
    G = 0.5 * (G + G.mT)
    D, E = (torch.from_numpy(a) for a in emulated_spectra.tridiag(G.numpy()))  # every entry must be written (NaN)
    T = torch.diag_embed(D) + torch.diag_embed(E[:, :-1], 1) + torch.diag_embed(E[:, :-1], -1)
    want, got = torch.linalg.eigvalsh(G), torch.linalg.eigvalsh(T)
    scale = want.abs().max(-1).values
    for i in range(4):
        assert (got[i] - want[i]).abs().max().item() <= 1e-13 * scale[i].item(), i
    assert not D[4].any() and not E[4].any()


def _skip_cases(n: int):
    """Gram matrices [4, n, n] (random, graded, random, rank 3) and a skip mask that leaves out two of them."""
    g = torch.Generator().manual_seed(100 + n)
    A = torch.randn(4, n, n, generator=g, dtype=torch.float64)
    G = A @ A.mT
    Q = torch.linalg.qr(A[1])[0]
    G[1] = (Q * torch.logspace(0, -16, n, dtype=torch.float64)) @ Q.mT
    G[3] = A[3][:, :3] @ A[3][:, :3].mT
    return 0.5 * (G + G.mT), torch.tensor([0, 1, 0, 1], dtype=torch.int32)


@needs_gxx
@pytest.mark.parametrize("n", [64, 128])
def test_emulated_tridiag_skips_the_masked_matrices(n):
    """A skip mask (the contract's certified states): the masked matrices' blocks write nothing (their rows stay
    NaN here; ``tridiag`` starts them at zero), the others the same bits as without a mask; an all-zero mask changes
    nothing."""
    from tests.support import emulated_spectra

    G, skip = _skip_cases(n)
    D0, E0 = emulated_spectra.tridiag(G.numpy())
    D1, E1 = emulated_spectra.tridiag(G.numpy(), skip.numpy())
    keep = ~skip.bool().numpy()
    assert np.isnan(D1[~keep]).all() and np.isnan(E1[~keep]).all()
    assert (D1[keep].view("u8") == D0[keep].view("u8")).all() and (E1[keep].view("u8") == E0[keep].view("u8")).all()
    D2, E2 = emulated_spectra.tridiag(G.numpy(), [0, 0, 0, 0])
    assert (D2.view("u8") == D0.view("u8")).all() and (E2.view("u8") == E0.view("u8")).all()


def test_skip_arguments_are_checked():
    D = torch.zeros(3, 64, dtype=torch.float64)
    assert cuda_tridiag.skip_args(None, 3, D) == [D, 0]
    sk, on = cuda_tridiag.skip_args(torch.tensor([True, False, True]), 3, D)
    assert on == 1 and sk.dtype == torch.int32 and sk.tolist() == [1, 0, 1]
    for bad in (torch.zeros(2, dtype=torch.int32), torch.zeros(3), torch.zeros(3, 1, dtype=torch.int32)):
        with pytest.raises(ValueError):
            cuda_tridiag.skip_args(bad, 3, D)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tridiag_skip_mask():
    """On the GPU: masked rows exact zeros, the others the same bits as without the mask (288 matrices)."""
    from gdnviz.gpu import symeig

    S = torch.cat(list(cuda_cases().values()))
    G = symeig.gram(S)
    skip = torch.arange(G.shape[0], device=G.device) % 3 == 1
    D0, E0 = cuda_tridiag.tridiag(G)
    D1, E1 = cuda_tridiag.tridiag(G, skip)
    assert not D1[skip].any() and not E1[skip].any()
    assert torch.equal(D1[~skip], D0[~skip]) and torch.equal(E1[~skip], E0[~skip])
