"""The CUDA QL eigenvalue kernel (gdnviz.gpu.cuda_ql), a candidate for symeig's second stage.

CPU: its source compiles for sm_90 without spills (where NVRTC is found) and, run through gdnviz.gpu.cuda_emul,
returns every eigenvalue of test_cuda_bisect's hard tridiagonals (random, graded over 16 decades, blocks, repeated,
zero, large and nearly diagonal) and of a GDN-like Gram spectrum to 32·ε_f64·‖T‖_∞ of float64 ``eigvalsh``, ascending;
with ``max_iter = 0`` every matrix takes the bisection fallback and must meet the same bound. CUDA: equal to the
bisection kernel to 64·ε·‖T‖.
"""
import numpy as np
import pytest
import torch

from gdnviz.gpu import cuda_ql
from cuda_kernel_checks import compile_log, needs_gxx
from test_cuda_bisect import tridiagonals


def gdn_like_tridiagonal(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The tridiagonal of a Gram matrix with σ_i = exp(−0.1 i) (λ over 11 decades), by numpy's Householder."""
    rng = np.random.default_rng(3)
    Q = np.linalg.qr(rng.standard_normal((n, n)))[0]
    G = (Q * np.exp(-0.2 * np.arange(n))) @ Q.T
    from scipy.linalg import hessenberg

    H = hessenberg(0.5 * (G + G.T))
    return np.diag(H).copy(), np.append(np.diag(H, -1), 0.0)


def check(W, D, E):
    for b in range(len(D)):
        T = np.diag(D[b]) + np.diag(E[b, :-1], 1) + np.diag(E[b, :-1], -1)
        want = np.linalg.eigvalsh(T)
        norm = np.abs(T).sum(1).max()
        assert np.all(np.diff(W[b]) >= 0), b
        err = np.abs(W[b] - want).max()
        assert err <= 32 * np.finfo(np.float64).eps * norm + 1e-299, (b, err, norm)


@pytest.mark.parametrize("n", [64, 128])
def test_source_compiles_for_hopper(n):
    res = compile_log(cuda_ql.source(n))
    if res is None:
        pytest.skip("no NVRTC library here (CPU torch without the nvidia-cuda-nvrtc wheel)")
    rc, out = res
    assert rc == 0, out
    assert "0 bytes spill stores" in out, out


@needs_gxx
@pytest.mark.parametrize("n", [64, 128])
@pytest.mark.parametrize("max_iter", [cuda_ql.MAX_ITER, 0])
def test_emulated_ql_finds_every_eigenvalue(n, max_iter):
    from gdnviz.gpu.cuda_emul import Emulated

    D, E = tridiagonals(n, seed=n)
    try:
        d, e = gdn_like_tridiagonal(n)
        D, E = np.vstack([D, d]), np.vstack([E, e])
    except ImportError:  # scipy absent: the six hard cases only
        pass
    emu = Emulated(cuda_ql.source(n), "gdnviz_ql", ["const double*", "const double*", "double*", "int", "int", "int"])
    W = np.full_like(D, np.nan)
    emu.launch(1, 32, [np.ascontiguousarray(D), np.ascontiguousarray(E), W, len(D), max_iter, 64],
               cuda_ql.smem_bytes(n))
    check(W, D, E)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ql_equals_bisection():
    from gdnviz.gpu import cuda_bisect

    D, E = (torch.from_numpy(a).cuda() for a in tridiagonals(128, seed=1))
    D, E = D.repeat(40, 1), E.repeat(40, 1)  # several blocks of 32 lanes
    ql = cuda_ql.ql_eigvals(D, E)
    bi = cuda_bisect.bisect(D, E, 64)
    scale = E.abs().sum(1, keepdim=True) * 2 + D.abs().amax(1, keepdim=True)
    assert ((ql - bi).abs() <= 64 * 2.220446049250313e-16 * scale + 1e-299).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_svdvals_with_ql_match_float64(monkeypatch):
    from gdnviz.gpu import symeig
    from test_symeig import assert_matches_svdvals, cuda_cases

    monkeypatch.setenv("GDNVIZ_EIG_QL", "1")
    for name, S in cuda_cases().items():
        assert_matches_svdvals(symeig.svdvals(S), torch.linalg.svdvals(S.double()), name)
