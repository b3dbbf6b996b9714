"""The one-warp CUDA Jacobi eigensolver (gdnviz.gpu.cuda_jacobi) pinned to torch.linalg.eigh and to the Triton kernel.

CPU: the switch, and — where an NVRTC library is found — that the source compiles for sm_90 without spills.
CUDA: eigenvalues within 1e-13·‖A‖_F of float64 ``torch.linalg.eigh``, residual and orthogonality at rounding level
on random, graded (to 1e-16), clustered, zero and diagonal 32×32 matrices; eigenvalues equal to the Triton kernel's
to 1e-14·‖A‖_F; ``truncate_states`` with it keeps the 1e-5 energy criterion and replays in a CUDA graph.
"""
import pytest
import torch

from gdnviz.gpu import cuda_jacobi
from cuda_kernel_checks import compile_log, truncation_checks


def test_off_by_default(monkeypatch):
    monkeypatch.delenv("GDNVIZ_CUDA_JACOBI", raising=False)
    assert not cuda_jacobi.enabled()
    monkeypatch.setenv("GDNVIZ_CUDA_JACOBI", "1")
    assert cuda_jacobi.enabled() == (cuda_jacobi.KERNELS.available and torch.version.hip is None)
    assert not cuda_jacobi.supports(torch.zeros(2, 32, 32, dtype=torch.float64))  # CPU: never
    with pytest.raises(ValueError):
        cuda_jacobi.eigh32(torch.zeros(2, 32, 32, dtype=torch.float64))


def test_source_compiles_for_hopper():
    res = compile_log(cuda_jacobi.SOURCE)
    if res is None:
        pytest.skip("no NVRTC library here (CPU torch without the nvidia-cuda-nvrtc wheel)")
    rc, out = res
    assert rc == 0, out
    assert "0 bytes spill stores" in out, out


def _matrices(g):
    F64 = torch.float64
    Y = torch.randn(64, 128, 32, generator=g, dtype=F64)
    spd = Y.mT @ Y
    Q = torch.linalg.qr(torch.randn(64, 32, 32, generator=g, dtype=F64))[0]
    graded = (Q * torch.logspace(0, -16, 32, dtype=F64)) @ Q.mT
    lam = torch.tensor([1.0] * 8 + [0.5] * 8 + [1e-3] * 16, dtype=F64)
    clustered = (Q * lam) @ Q.mT
    sym = torch.randn(64, 32, 32, generator=g, dtype=F64)
    sym = sym + sym.mT
    diag = torch.diag_embed(torch.randn(4, 32, generator=g, dtype=F64))
    return torch.cat([spd, graded, clustered, sym, diag, torch.zeros(2, 32, 32, dtype=F64)]).cuda()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
def test_cuda_jacobi_matches_eigh_and_the_triton_kernel():
    from gdnviz.gpu.jacobi import eigh_jacobi

    assert cuda_jacobi._kernel(torch.device("cuda")) is not None, cuda_jacobi.KERNELS.reason
    A = _matrices(torch.Generator().manual_seed(0))
    w, V, sweeps = cuda_jacobi.eigh32(A, return_sweeps=True)
    w_ref, _ = torch.linalg.eigh(A)
    scale = A.flatten(1).norm(dim=1).clamp_min(1e-300)[:, None]
    assert ((w - w_ref).abs() / scale).max().item() < 1e-13
    eye = torch.eye(32, dtype=torch.float64, device="cuda")
    assert (V.mT @ V - eye).abs().max().item() < 1e-12
    res = (A @ V - V * w[:, None, :]).flatten(1).norm(dim=1) / scale[:, 0]
    assert res.max().item() < 1e-13
    assert (w[-2:] == 0).all() and int(sweeps.max()) <= cuda_jacobi.MAX_SWEEPS
    w_tri, _ = eigh_jacobi(A)
    assert ((w - w_tri).abs() / scale).max().item() < 1e-14


@pytest.mark.gpu
@cuda
def test_truncation_with_the_cuda_jacobi_keeps_the_energy_and_replays(monkeypatch):
    truncation_checks(monkeypatch, "GDNVIZ_CUDA_JACOBI", "1", seed=3)
