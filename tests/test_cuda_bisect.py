"""The CUDA bisection (gdnviz.gpu.cuda_bisect), the second half of gdnviz.gpu.symeig's fast path.

CPU: what ``bisect`` refuses, the source compiling for sm_90 without spills where an NVRTC library is found, and the
source run through tests.support.cuda_emul (g++, CUDA's threads emulated) returning every eigenvalue of hard
tridiagonals (random, graded over 16 decades, split into blocks by zero off-diagonals, repeated eigenvalues, zero;
and extreme ranges for the minors' rescaling) to 32·ε_f64·‖T‖_∞ + 1e-299 of float64 ``eigvalsh`` (LAPACK's own error
is part of the difference; 1e-299 is the interval's floor). CUDA: the same bound on the GPU, and ``symeig.svdvals``
with it meets test_symeig's bounds against float64 ``torch.linalg.svdvals``.
"""
import numpy as np
import pytest
import torch

from gdnviz.gpu import cuda_bisect
from cuda_kernel_checks import compile_log, needs_gxx


def tridiagonals(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    D = np.empty((6, n))
    E = np.empty((6, n))
    D[0], E[0] = rng.standard_normal(n), rng.standard_normal(n)
    g = np.logspace(0, -16, n)  # graded: entries from 1 down to 1e-16
    D[1], E[1] = g * rng.uniform(0.5, 1.0, n), g * rng.uniform(-0.5, 0.5, n)
    D[2], E[2] = rng.standard_normal(n), rng.standard_normal(n)
    E[2, ::7] = 0.0  # blocks
    D[3], E[3] = np.tile([1.0, 2.0], n // 2), np.zeros(n)  # repeated eigenvalues, diagonal
    D[4], E[4] = np.zeros(n), np.zeros(n)  # zero
    D[5], E[5] = 1e6 * rng.standard_normal(n), 1e-3 * rng.standard_normal(n)  # large, nearly diagonal
    E[:, -1] = 0.0
    return D, E


def tolerance(D: np.ndarray, E: np.ndarray, b: int) -> tuple[np.ndarray, float]:
    """(float64 eigvalsh of tridiagonal b, 32·ε·‖T‖_∞ + 1e-299): ‖T‖_∞ ≥ ‖T‖_2, and each Sturm count is exact for T
    perturbed by a few ε·|T|."""
    T = np.diag(D[b]) + np.diag(E[b, :-1], 1) + np.diag(E[b, :-1], -1)
    return np.linalg.eigvalsh(T), 32 * np.finfo(np.float64).eps * np.abs(T).sum(1).max() + 1e-299


def test_refusals():
    assert not cuda_bisect.supports(torch.zeros(2, 128, dtype=torch.float64))  # CPU: never
    with pytest.raises(ValueError):
        cuda_bisect.bisect(torch.zeros(2, 128, dtype=torch.float64), torch.zeros(2, 128, dtype=torch.float64), 64)


@pytest.mark.parametrize("n", [64, 128])
def test_source_compiles_for_hopper(n):
    res = compile_log(cuda_bisect.source(n))
    if res is None:
        pytest.skip("no NVRTC library here (CPU torch without the nvidia-cuda-nvrtc wheel)")
    rc, out = res
    assert rc == 0, out
    assert "0 bytes spill stores" in out, out


@needs_gxx
@pytest.mark.parametrize("n", [64, 128])
def test_emulated_bisection_finds_every_eigenvalue(n):
    from tests.support import emulated_spectra

    D, E = tridiagonals(n, seed=n)
    W = emulated_spectra.bisect(D, E)
    for b in range(len(D)):
        want, tol = tolerance(D, E, b)
        assert np.all(np.diff(W[b]) >= 0), b  # ascending
        err = np.abs(W[b] - want).max()
        assert err <= tol, (b, err, tol)
    assert np.abs(W[4]).max() <= 1e-299  # the zero matrix: the interval's 1e-300 floor, clamped by svdvals


def extreme_tridiagonals(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Cases for the minors' range: random at 1e140 and 1e-140 (scaled by a power of two before the recurrence), a Gram
    matrix of rank 3 reduced to tridiagonal form (125 eigenvalues at rounding level: the minors near 0 shrink by
    ~1e-16 per step), graded over 300 decades, and a matrix whose leading 4×4 minor is exactly 0 at the first
    midpoint (0: the Gershgorin interval is [-4, 4]), at a step where the minors are rescaled (a zero has no
    exponent; the pivmin rule keeps every minor nonzero)."""
    rng = np.random.default_rng(seed)
    D = np.empty((5, n))
    E = np.empty((5, n))
    D[0], E[0] = 1e140 * rng.standard_normal(n), 1e140 * rng.standard_normal(n)
    D[1], E[1] = 1e-140 * rng.standard_normal(n), 1e-140 * rng.standard_normal(n)
    S = rng.standard_normal((n, 3)) @ rng.standard_normal((3, n))
    from scipy.linalg import hessenberg

    H = hessenberg(S @ S.T)  # symmetric: tridiagonal up to rounding
    D[2], E[2] = np.diag(H), np.append(np.diag(H, -1), 0.0)
    g = np.logspace(0, -300, n)
    D[3], E[3] = g, 0.5 * g
    D[4], E[4] = rng.uniform(-2.0, 2.0, n), np.zeros(n)
    D[4, :4], E[4, 3] = [4.0, -4.0, 1.0, 0.0], 0.25
    E[:, -1] = 0.0
    return D, E


@needs_gxx
@pytest.mark.parametrize("n", [64, 128])
def test_emulated_bisection_on_extreme_ranges(n):
    """Where the minors would leave float64's range without their rescaling every 4 steps: the same bound against
    LAPACK."""
    from tests.support import emulated_spectra

    D, E = extreme_tridiagonals(n, seed=n + 1)
    W = emulated_spectra.bisect(D, E)
    for b in range(len(D)):
        want, tol = tolerance(D, E, b)
        assert np.abs(W[b] - want).max() <= tol, (b, np.abs(W[b] - want).max() / tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n", [64, 128])
def test_cuda_bisection_finds_every_eigenvalue(n):
    """The kernel on the GPU: every eigenvalue of the hard and the extreme tridiagonals within 32·ε·‖T‖_∞ + 1e-299
    of LAPACK's; for n = 128, ``symeig.svdvals`` meets test_symeig's bounds."""
    from gdnviz.gpu import symeig
    from test_symeig import assert_matches_svdvals, cuda_cases

    assert cuda_bisect.kernel(n, torch.device("cuda")) is not None, cuda_bisect.KERNELS.reason
    for D, E in (tridiagonals(n, seed=1), extreme_tridiagonals(n, seed=2)):
        W = cuda_bisect.bisect(torch.from_numpy(D).cuda(), torch.from_numpy(E).cuda()).cpu().numpy()
        for b in range(len(D)):
            want, tol = tolerance(D, E, b)
            assert np.abs(W[b] - want).max() <= tol, (b, np.abs(W[b] - want).max() / tol)
    if n == 128:
        for name, S in cuda_cases().items():
            assert_matches_svdvals(symeig.svdvals(S), torch.linalg.svdvals(S.double()), name)


@needs_gxx
@pytest.mark.parametrize("n", [64, 128])
def test_emulated_bisection_skips_the_masked_tridiagonals(n):
    """A skip mask: masked rows exact zeros (written: the output starts as NaN), the others the same bits as without
    a mask."""
    from tests.support import emulated_spectra

    D, E = tridiagonals(n, seed=n + 7)
    skip = np.array([1, 0, 0, 1, 0, 1], dtype=np.int32)
    W0 = emulated_spectra.bisect(D, E)
    W1 = emulated_spectra.bisect(D, E, skip=skip)
    keep = skip == 0
    assert (W1[~keep] == 0).all()
    assert (W1[keep].view("u8") == W0[keep].view("u8")).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n", [64, 128])
def test_cuda_bisection_skip_mask(n):
    """On the GPU: masked rows exact zeros, the others the same bits as without the mask."""
    D, E = (torch.from_numpy(a).cuda() for a in tridiagonals(n, seed=3))
    skip = torch.tensor([True, False, True, False, False, True], device="cuda")
    W0 = cuda_bisect.bisect(D, E)
    W1 = cuda_bisect.bisect(D, E, skip=skip)
    assert not W1[skip].any() and torch.equal(W1[~skip], W0[~skip])
