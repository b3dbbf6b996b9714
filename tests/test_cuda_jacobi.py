"""The one-warp CUDA Jacobi eigensolver (gdnviz.gpu.cuda_jacobi) pinned to torch.linalg.eigh and to the Triton kernel.

CPU: the switch, and — where an NVRTC library is found — that the source compiles for sm_90 without spills.
CUDA: eigenvalues within 1e-13·‖A‖_F of float64 ``torch.linalg.eigh``, residual and orthogonality at rounding level
on random, graded (to 1e-16), clustered, zero and diagonal 32×32 matrices; eigenvalues equal to the Triton kernel's
to 1e-14·‖A‖_F; ``truncate_states`` with it keeps the 1e-5 energy criterion and replays in a CUDA graph.
"""
import ctypes

import pytest
import torch

from gdnviz.gpu import cuda_jacobi
from nvrtc_lib import nvrtc as _nvrtc


def test_off_by_default(monkeypatch):
    monkeypatch.delenv("GDNVIZ_CUDA_JACOBI", raising=False)
    assert not cuda_jacobi.enabled()
    monkeypatch.setenv("GDNVIZ_CUDA_JACOBI", "1")
    assert cuda_jacobi.enabled() == (cuda_jacobi.available and torch.version.hip is None)
    assert not cuda_jacobi.supports(torch.zeros(2, 32, 32, dtype=torch.float64))  # CPU: never
    with pytest.raises(ValueError):
        cuda_jacobi.eigh32(torch.zeros(2, 32, 32, dtype=torch.float64))


def test_source_compiles_for_hopper():
    lib = _nvrtc()
    if lib is None:
        pytest.skip("no NVRTC library here (CPU torch without the nvidia-cuda-nvrtc wheel)")
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), cuda_jacobi.SOURCE.encode(), b"k.cu", 0, None, None) == 0
    opts = [b"--gpu-architecture=sm_90", b"--ptxas-options=-v"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    out = log.value.decode()
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

    assert cuda_jacobi._kernel(torch.device("cuda")) is not None, cuda_jacobi.unavailable_reason
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
    from bench.bench_truncate import gdn_like_spectra
    from gdnviz import truncate
    from gdnviz.gpu.cuda_graph import capture

    g = torch.Generator().manual_seed(3)
    sig = gdn_like_spectra(288, 128, g)
    U = torch.linalg.qr(torch.randn(288, 128, 128, generator=g, dtype=torch.float64))[0]
    S = ((U * sig[:, None, :]) @ U.mT).float().cuda()
    monkeypatch.setenv("GDNVIZ_CUDA_JACOBI", "1")
    for r in (1, 4, 12, 32):
        y = truncate.truncate_states(S, r)
        assert truncate.energy_error(S, y, r).max().item() <= 1e-5
        graph, out = capture(lambda x: truncate.truncate_states(x, r), S.clone())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, y)
