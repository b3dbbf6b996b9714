"""The CUDA Householder tridiagonalisation (gdnviz.gpu.cuda_tridiag) behind gdnviz.gpu.symeig.svdvals.

CPU: on by default (``GDNVIZ_CUDA_TRIDIAG=0`` turns it off), its shared-memory size, and — where an NVRTC library is
found — that the source compiles for sm_90 (n = 64, 128) without spills; the source run through tests.support.cuda_emul
(g++, CUDA's threads emulated) returns a tridiagonal with G's eigenvalues (1e-13·λ_max). CUDA: with the kernel (the switch set
explicitly on, and off for the Triton reference), ``symeig.svdvals`` meets test_symeig's bounds against float64
``torch.linalg.svdvals`` on the same test states (1e-7·σ_max absolute, 1e-9 relative for σ ≥ 1e-3 σ_max, the same
numerical ranks), and the tridiagonal's eigenvalues equal the Triton kernel's to 1e-12·‖G‖ (exactly, for the zero
states).
"""
import pytest
import torch

from gdnviz.gpu import cuda_tridiag
from cuda_kernel_checks import compile_log, needs_gxx
from test_symeig import assert_matches_svdvals, cuda_cases


def test_switch_and_sizes(monkeypatch):
    usable = cuda_tridiag.KERNELS.available and torch.version.hip is None
    assert cuda_tridiag.DEFAULT_ON  # measured 1.95× faster than the Triton kernel on the H200 (sixth session)
    monkeypatch.delenv("GDNVIZ_CUDA_TRIDIAG", raising=False)
    assert cuda_tridiag.enabled() == usable
    for env, on, regs in (("0", False, cuda_tridiag.REGS), (" 0 ", False, cuda_tridiag.REGS),
                          ("1", True, cuda_tridiag.REGS), ("regs", True, True), ("smem", True, False),
                          ("split", True, cuda_tridiag.SPLIT)):
        monkeypatch.setenv("GDNVIZ_CUDA_TRIDIAG", env)
        assert cuda_tridiag.enabled() == (on and usable), env
        assert cuda_tridiag.default_regs() == regs, env
    assert cuda_tridiag.smem_bytes(128, 4, False) == 8 * (128 * 132 + 256 + 32 + 1)  # > 48 KB: the kernel opts in
    assert cuda_tridiag.smem_bytes(128, 4, True) == 8 * (256 + 32 + 1)  # the register form: u, p, partials
    assert cuda_tridiag.smem_bytes(128, 2, cuda_tridiag.SPLIT) == 0  # static arrays only
    with pytest.raises(ValueError):
        cuda_tridiag.source(128, 4, cuda_tridiag.SPLIT)
    assert not cuda_tridiag.supports(torch.zeros(2, 128, 128, dtype=torch.float64))  # CPU: never
    with pytest.raises(ValueError):
        cuda_tridiag.tridiag(torch.zeros(2, 128, 128, dtype=torch.float64))


@pytest.mark.parametrize("n", [64, 128])
@pytest.mark.parametrize("tpr, regs", [(1, False), (2, False), (4, False), (2, True), (4, True), (2, "split")])
def test_source_compiles_for_hopper(n, tpr, regs):
    res = compile_log(cuda_tridiag.source(n, tpr, regs))
    if res is None:
        pytest.skip("no NVRTC library here (CPU torch without the nvidia-cuda-nvrtc wheel)")
    rc, out = res
    assert rc == 0, out
    assert "0 bytes spill stores" in out, out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tridiag_spectra_match(monkeypatch):
    from gdnviz.gpu import symeig

    assert cuda_tridiag._kernel(128, torch.device("cuda")) is not None, cuda_tridiag.KERNELS.reason
    for (name, S), form in ((item, form) for item in cuda_cases().items() for form in ("smem", "regs", "split")):
        monkeypatch.setenv("GDNVIZ_CUDA_TRIDIAG", form)
        ours = symeig.svdvals(S)
        monkeypatch.setenv("GDNVIZ_CUDA_TRIDIAG", "0")
        triton = symeig.svdvals(S)
        assert_matches_svdvals(ours, torch.linalg.svdvals(S.double()), (name, form))
        # eigenvalues of G (σ²) within 1e-12·λ_max of the Triton path's, as a product rather than a quotient: the
        # zero states' λ_max is 0 (a clamped 1e-300 squares to 0 and gave 0/0 = NaN on the H200), and there the
        # bound asks for exact equality
        diff = (ours.square() - triton.square()).abs()
        bound = 1e-12 * triton[:, :1].square()
        assert (diff <= bound).all(), (name, (diff - bound).max().item())
        if name == "zero":
            assert ours.abs().max().item() == 0 and triton.abs().max().item() == 0


@needs_gxx
@pytest.mark.parametrize("n, tpr, regs", [(64, 1, False), (64, 4, False), (128, 2, False), (128, 4, False),
                                          (64, 4, True), (128, 2, True), (128, 4, True), (64, 2, "split"),
                                          (128, 2, "split")])
def test_emulated_tridiagonal_keeps_the_eigenvalues(n, tpr, regs):
    """The kernel's CUDA source run on the CPU (tests.support.cuda_emul): the tridiagonal (D, E) it returns has the
    eigenvalues of G to 1e-13·λ_max (float64 eigvalsh of both) — a random Gram matrix, a graded one (λ from 1 to
    1e-16), rank 3, repeated eigenvalues, and zero (D = E = 0 exactly)."""
    import numpy as np

    from tests.support.cuda_emul import Emulated

    g = torch.Generator().manual_seed(n)
    A = torch.randn(5, n, n, generator=g, dtype=torch.float64)
    Q = torch.linalg.qr(torch.randn(5, n, n, generator=g, dtype=torch.float64))[0]
    lam = torch.stack([torch.ones(n), torch.logspace(0, -16, n, dtype=torch.float64),
                       torch.cat([torch.ones(3), torch.zeros(n - 3)]), torch.tensor([1.0, 2.0]).repeat(n // 2),
                       torch.zeros(n)]).double()
    G = (Q * lam[:, None, :]) @ Q.mT
    G[0] = A[0] @ A[0].mT
    G = 0.5 * (G + G.mT)
    emu = Emulated(cuda_tridiag.source(n, tpr, regs), "gdnviz_tridiag", ["const double*", "double*", "double*"])
    D, E = np.full((5, n), np.nan), np.full((5, n), np.nan)  # every entry must be written
    emu.launch(5, n * tpr, [np.ascontiguousarray(G.numpy()), D, E], cuda_tridiag.smem_bytes(n, tpr, regs))
    D, E = torch.from_numpy(D), torch.from_numpy(E)
    T = torch.diag_embed(D) + torch.diag_embed(E[:, :-1], 1) + torch.diag_embed(E[:, :-1], -1)
    want, got = torch.linalg.eigvalsh(G), torch.linalg.eigvalsh(T)
    scale = want.abs().max(-1).values
    for i in range(4):
        assert (got[i] - want[i]).abs().max().item() <= 1e-13 * scale[i].item(), i
    assert not D[4].any() and not E[4].any()
