"""The NVRTC Cholesky-QR kernel (gdnviz.gpu.cuda_cholqr) pinned to gdnviz.truncate._cholqr's torch definition.

CPU: the switch (GDNVIZ_CUDA_CHOLQR), the shapes it takes, and — where an NVRTC library can be found (CUDA builds
of torch, or the nvidia-cuda-nvrtc wheel) — that the source compiles for sm_90 without spills of consequence; and
the source itself run through tests.support.cuda_emul (g++, CUDA's threads emulated) with the CUDA test's criteria.
CUDA: equal to the torch path to 1e-12 on well-conditioned blocks, the same answer on graded, rank-deficient and zero
blocks, truncate_states with the kernel keeps the 1e-5 energy criterion, and a CUDA graph replays it.
"""
import pytest
import torch

from gdnviz.gpu import cuda_cholqr
from cuda_kernel_checks import compile_log, needs_gxx, truncation_checks


def test_switch_and_shapes(monkeypatch):
    monkeypatch.setenv("GDNVIZ_CUDA_CHOLQR", "0")
    assert not cuda_cholqr.enabled()
    assert cuda_cholqr.DEFAULT_FORM == "shfl"  # measured faster than "smem" on the H200 (sixth session)
    if cuda_cholqr.KERNELS.available and torch.version.hip is None:
        for env, form in (("shfl", "shfl"), ("1", "shfl"), ("smem", "smem"), ("SMEM ", "smem")):
            monkeypatch.setenv("GDNVIZ_CUDA_CHOLQR", env)
            assert cuda_cholqr.variant() == form, env
        monkeypatch.delenv("GDNVIZ_CUDA_CHOLQR")
        assert cuda_cholqr.variant() == ("shfl" if cuda_cholqr.DEFAULT_ON else None)
    monkeypatch.setenv("GDNVIZ_CUDA_CHOLQR", "1")
    assert cuda_cholqr.enabled() == (cuda_cholqr.KERNELS.available and torch.version.hip is None)
    monkeypatch.delenv("GDNVIZ_CUDA_CHOLQR")
    assert cuda_cholqr.enabled() == (cuda_cholqr.DEFAULT_ON and cuda_cholqr.KERNELS.usable())
    assert not cuda_cholqr.supports(torch.zeros(2, 128, 32, dtype=torch.float64))  # CPU tensors: never
    with pytest.raises(ValueError):
        cuda_cholqr.cholqr(torch.zeros(2, 128, 32, dtype=torch.float64))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the failure path: no CUDA here")
def test_a_failed_compilation_leaves_the_fallback():
    """gdnviz.gpu.nvrtc.Kernels: the first failure is recorded, later calls return None without trying again."""
    from gdnviz.gpu.nvrtc import Kernels

    kernels = Kernels()
    assert kernels.get(0, torch.device("cuda", 0), cuda_cholqr.source(128), "gdnviz_cholqr") is None
    assert not kernels.available and not kernels.usable() and kernels.reason
    assert kernels.get(1, torch.device("cuda", 0), cuda_cholqr.source(64), "gdnviz_cholqr") is None


@pytest.mark.parametrize("form", ["smem", "shfl"])
@pytest.mark.parametrize("R", [64, 128])
def test_source_compiles_for_hopper(R, form):
    res = compile_log(cuda_cholqr.source(R, form))
    if res is None:
        pytest.skip("no NVRTC library here (CPU torch without the nvidia-cuda-nvrtc wheel)")
    rc, out = res
    assert rc == 0, out
    assert "smem" in out  # ptxas reported the kernel's resources
    if form == "shfl":
        assert "0 bytes spill stores" in out, out  # the register-resident rows must not spill


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
def test_cuda_kernel_equals_the_torch_definition(monkeypatch):
    from gdnviz import truncate

    monkeypatch.setenv("GDNVIZ_CUDA_CHOLQR", "0")  # the reference is the torch path
    assert cuda_cholqr._kernel(128, torch.device("cuda")) is not None, cuda_cholqr.KERNELS.reason
    g = torch.Generator().manual_seed(0)
    for R in (128, 64):
        Z = torch.randn(288, R, 32, generator=g, dtype=torch.float64).cuda()
        a, b = cuda_cholqr.cholqr(Z), truncate._cholqr(Z)
        assert ((a - b).norm() / b.norm()).item() < 1e-12
        assert (a.mT @ a - torch.eye(32, dtype=torch.float64, device="cuda")).abs().max().item() < 1e-12
    Zg = Z * torch.logspace(0, -9, 32, dtype=torch.float64, device="cuda")  # graded columns
    a, b = cuda_cholqr.cholqr(Zg), truncate._cholqr(Zg)
    assert ((a - b).norm() / b.norm()).item() < 1e-8
    Zd = Z.clone()
    Zd[:, :, 16:] = Zd[:, :, :16]  # rank-deficient
    a, b = cuda_cholqr.cholqr(Zd), truncate._cholqr(Zd)
    assert torch.isfinite(a).all() and ((a - b).norm() / b.norm()).item() < 1e-6
    assert cuda_cholqr.cholqr(torch.zeros(3, 128, 32, dtype=torch.float64, device="cuda")).abs().max().item() == 0


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("form", ["shfl", "smem"])
def test_truncation_with_the_cuda_kernel_keeps_the_energy_and_replays(monkeypatch, form):
    truncation_checks(monkeypatch, "GDNVIZ_CUDA_CHOLQR", form)


@pytest.mark.gpu
@cuda
def test_shuffle_form_gives_the_same_bits_and_energy(monkeypatch):
    """The register/shuffle factorisation does the same arithmetic as the shared-memory one: equal bit for bit."""
    from gdnviz import truncate

    g = torch.Generator().manual_seed(2)
    Z = torch.randn(288, 128, 32, generator=g, dtype=torch.float64).cuda()
    Zg = Z * torch.logspace(0, -9, 32, dtype=torch.float64, device="cuda")
    for blocks in (Z, Zg, Z[:16, :64].contiguous(), torch.zeros(2, 128, 32, dtype=torch.float64, device="cuda")):
        a = cuda_cholqr.cholqr(blocks, form="smem")
        b = cuda_cholqr.cholqr(blocks, form="shfl")
        assert torch.equal(a, b)
    monkeypatch.setenv("GDNVIZ_CUDA_CHOLQR", "shfl")
    S = torch.randn(32, 128, 128, generator=g).cuda()
    for r in (4, 32):
        y = truncate.truncate_states(S, r)
        assert truncate.energy_error(S, y, r).max().item() <= 1e-5


# ------------------------------------------------------------------------------ the kernel's source, emulated on CPU
@needs_gxx
@pytest.mark.parametrize("form", ["smem", "shfl"])
@pytest.mark.parametrize("R", [64, 128])
def test_emulated_kernel_equals_the_torch_definition(R, form):
    """The kernel's CUDA source run on the CPU (tests.support.cuda_emul) against truncate._cholqr's torch kernels, with
    the CUDA test's criteria: a random block equal to 1e-12 (and orthonormal to 1e-12), graded columns (1 … 1e-9) to
    1e-8, duplicated columns (rank 16) finite and to 1e-6, zero stays zero; both forms give the same bits."""
    import numpy as np

    from gdnviz import truncate as tr
    from tests.support.cuda_emul import Emulated

    g = torch.Generator().manual_seed(R)
    Z = torch.randn(4, R, 32, generator=g, dtype=torch.float64)
    Z[1] *= torch.logspace(0, -9, 32, dtype=torch.float64)
    Z[2, :, 16:] = Z[2, :, :16]
    Z[3] = 0
    outs = {}
    for f in ("smem", "shfl"):
        emu = Emulated(cuda_cholqr.source(R, f), "gdnviz_cholqr", ["const double*", "double*", "double", "double"])
        outs[f] = np.empty((4, R, 32))
        emu.launch(4, R, [np.ascontiguousarray(Z.numpy()), outs[f], tr._CHOL_SHIFT, tr._TINY])
    assert np.array_equal(outs["smem"], outs["shfl"])
    got, ref = torch.from_numpy(outs[form]), tr._cholqr(Z)
    assert torch.isfinite(got).all()
    rel = [((got[i] - ref[i]).norm() / ref[i].norm()).item() for i in range(3)]
    assert rel[0] < 1e-12 and rel[1] < 1e-8 and rel[2] < 1e-6, rel
    assert (got[0].mT @ got[0] - torch.eye(32, dtype=torch.float64)).abs().max().item() < 1e-12
    assert torch.equal(got[3], torch.zeros_like(got[3]))
