"""The CUDA bisection (gdnviz.gpu.cuda_bisect) behind gdnviz.gpu.symeig.eigvalsh_tridiag.

CPU: the switch, what ``bisect`` refuses, the source compiling for sm_90 without spills where an NVRTC library is
found, and the source run through tests.support.cuda_emul (g++, CUDA's threads emulated) returning every eigenvalue of
hard tridiagonals (random, graded over 16 decades, split into blocks by zero off-diagonals, repeated eigenvalues,
zero) to 32·ε_f64·‖T‖_∞ + 1e-299 of float64 ``eigvalsh`` (LAPACK's own error is part of the difference; 1e-299 is
the interval's floor). CUDA: equal to the Triton bisection kernel (the same algorithm) to 1e-15·‖T‖, and
``symeig.svdvals`` with it meets test_symeig's bounds against float64 ``torch.linalg.svdvals``.
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


def test_switch_and_refusals(monkeypatch):
    usable = cuda_bisect.KERNELS.available and torch.version.hip is None
    monkeypatch.delenv("GDNVIZ_CUDA_BISECT", raising=False)
    assert cuda_bisect.enabled() == (cuda_bisect.DEFAULT_ON and usable)
    monkeypatch.setenv("GDNVIZ_CUDA_BISECT", "0")
    assert not cuda_bisect.enabled()
    assert not cuda_bisect.supports(torch.zeros(2, 128, dtype=torch.float64))  # CPU: never
    with pytest.raises(ValueError):
        cuda_bisect.bisect(torch.zeros(2, 128, dtype=torch.float64), torch.zeros(2, 128, dtype=torch.float64), 64)


@pytest.mark.parametrize("form", cuda_bisect.FORMS)
@pytest.mark.parametrize("n", [64, 128])
def test_source_compiles_for_hopper(n, form):
    res = compile_log(cuda_bisect.source(n, form))
    if res is None:
        pytest.skip("no NVRTC library here (CPU torch without the nvidia-cuda-nvrtc wheel)")
    rc, out = res
    assert rc == 0, out
    assert "0 bytes spill stores" in out, out


@needs_gxx
@pytest.mark.parametrize("form", cuda_bisect.FORMS)
@pytest.mark.parametrize("n", [64, 128])
def test_emulated_bisection_finds_every_eigenvalue(n, form):
    from tests.support.cuda_emul import Emulated
    from gdnviz.gpu.symeig import BISECT_STEPS

    D, E = tridiagonals(n, seed=n)
    emu = Emulated(cuda_bisect.source(n, form), "gdnviz_bisect",
                   ["const double*", "const double*", "double*", "int"])
    W = np.empty_like(D)
    emu.launch(len(D), n, [D, E, W, BISECT_STEPS])
    for b in range(len(D)):
        T = np.diag(D[b]) + np.diag(E[b, :-1], 1) + np.diag(E[b, :-1], -1)
        want = np.linalg.eigvalsh(T)
        norm = np.abs(T).sum(1).max()  # ‖T‖_∞ ≥ ‖T‖_2: each Sturm count is exact for T perturbed by a few ε·|T|
        assert np.all(np.diff(W[b]) >= 0), b  # ascending
        err = np.abs(W[b] - want).max()
        assert err <= 32 * np.finfo(np.float64).eps * norm + 1e-299, (b, err, norm)
    assert np.abs(W[4]).max() <= 1e-299  # the zero matrix: the interval's 1e-300 floor, clamped by svdvals


def extreme_tridiagonals(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Cases for the minors' range: random at 1e140 and 1e-140 (the LDLᵀ form squares e: 1e250 overflows it), a Gram
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
def test_emulated_minors_form_equals_pivots_form_on_extreme_ranges(n):
    """The division-free form (signs of the leading minors, rescaled every 4 steps) against the LDLᵀ form and
    LAPACK where the minors would leave float64's range without the rescaling (both forms: 32·ε·‖T‖ + 1e-299)."""
    from tests.support.cuda_emul import Emulated
    from gdnviz.gpu.symeig import BISECT_STEPS

    D, E = extreme_tridiagonals(n, seed=n + 1)
    out = {}
    for form in cuda_bisect.FORMS:
        emu = Emulated(cuda_bisect.source(n, form), "gdnviz_bisect", ["const double*", "const double*", "double*",
                                                                       "int"])
        out[form] = np.empty_like(D)
        emu.launch(len(D), n, [D, E, out[form], BISECT_STEPS])
    for b in range(len(D)):
        T = np.diag(D[b]) + np.diag(E[b, :-1], 1) + np.diag(E[b, :-1], -1)
        norm = np.abs(T).sum(1).max()
        tol = 32 * np.finfo(np.float64).eps * norm + 1e-299
        want = np.linalg.eigvalsh(T)
        for form in cuda_bisect.FORMS:
            assert np.abs(out[form][b] - want).max() <= tol, (b, form, np.abs(out[form][b] - want).max() / norm)
        assert np.abs(out["det"][b] - out["ldl"][b]).max() <= tol, b


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("form", cuda_bisect.FORMS)
@pytest.mark.parametrize("n", [64, 128])
def test_cuda_bisection_equals_triton(n, form, monkeypatch):
    from gdnviz.gpu import symeig
    from test_symeig import assert_matches_svdvals, cuda_cases

    assert cuda_bisect._kernel(n, torch.device("cuda")) is not None, cuda_bisect.KERNELS.reason
    D, E = (torch.from_numpy(a).cuda() for a in tridiagonals(n, seed=1))
    ours = cuda_bisect.bisect(D, E, symeig.BISECT_STEPS, form)
    W = torch.empty_like(D)
    bm = max(1, 512 // n)
    symeig._bisect_kernel[((len(D) + bm - 1) // bm,)](D, E, W, len(D), N=n, BM=bm, STEPS=symeig.BISECT_STEPS,
                                                      num_warps=4)
    scale = W.abs().amax(dim=1, keepdim=True)
    # the same Sturm counts (ldl) or the same up to a few ulps of backward error per step (det, module comment)
    tol = 1e-15 if form == "ldl" else 32 * np.finfo(np.float64).eps
    assert ((ours - W).abs() <= tol * scale).all(), ((ours - W).abs() / scale.clamp_min(1e-300)).max().item()
    if n == 128:
        monkeypatch.setenv("GDNVIZ_CUDA_BISECT", form)
        for name, S in cuda_cases().items():
            assert_matches_svdvals(symeig.svdvals(S), torch.linalg.svdvals(S.double()), name)
