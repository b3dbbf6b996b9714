"""The CUDA Gram kernel (gdnviz.gpu.cuda_gram), the fast path of gdnviz.gpu.symeig.finite_gram.

CPU: what ``gram`` refuses; where an NVRTC library is found, that every build compiles for sm_90 without spills; the
source run through tests.support.cuda_emul (g++, CUDA's threads emulated) equals the float64 reference
``symeig.gram`` to float64 rounding for every shape and dtype, is exactly symmetric, flags and zeroes the states whose
Gram matrix is not finite (NaN, inf, a float64 overflow), leaves skipped matrices unwritten and the other rows the
same bits. CUDA: the kernel's bits equal the emulation's (both are fused multiply-adds in the same order on exact
float64 operands); ``finite_gram`` runs it when given a mask, and cuBLAS without one (the same flags and matrices).
"""
import numpy as np
import pytest
import torch

from gdnviz.gpu import cuda_gram, symeig
from cuda_kernel_checks import compile_log, needs_gxx

SHAPES = [(128, 128), (64, 128), (128, 64), (64, 64)]


def states(N, K, V, dtype, seed=0):
    """Random states with the nasty ones: zero, NaN, inf, huge and tiny scales, rank one; for float64 also one whose
    Gram matrix overflows (entries 1e200) while its entries are finite."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, K, V, generator=g, dtype=torch.float64)
    X[1] = 0
    X[2, K // 2, V // 3] = float("nan")
    X[3, 0, V - 1] = float("inf")
    X[4] *= 1e30
    X[5] *= 1e-30
    X[6] = torch.outer(torch.randn(K, generator=g, dtype=torch.float64), torch.randn(V, generator=g, dtype=torch.float64))
    X = X.to(dtype)
    if dtype == torch.float64:
        X[7] = 1e200
    return X


def expected_bad(X):
    return ~torch.isfinite(symeig.gram(X)).all(-1).all(-1)


def test_refusals_and_the_fallback_on_cpu():
    assert cuda_gram.DIMS == (64, 128)
    X = states(8, 128, 64, torch.float32)
    assert not cuda_gram.supports(X)  # CPU: never
    with pytest.raises(ValueError):
        cuda_gram.gram(X)
    G, bad = symeig.finite_gram(X)  # the torch fallback
    assert bad.tolist() == expected_bad(X).tolist() == [False, False, True, True, False, False, False, False]
    ref = symeig.gram(X)
    assert torch.equal(G[~bad], ref[~bad]) and (G[bad] == 0).all()


@pytest.mark.parametrize("K,V", SHAPES)
@pytest.mark.parametrize("ctype", ["float", "double"])
def test_source_compiles_for_hopper(K, V, ctype):
    res = compile_log(cuda_gram.source(K, V, ctype))
    if res is None:
        pytest.skip("no NVRTC library here (CPU torch without the nvidia-cuda-nvrtc wheel)")
    rc, out = res
    assert rc == 0, out
    assert "0 bytes spill stores" in out, out


def _check_against_reference(X, G, bad):
    G, bad = torch.from_numpy(G), torch.from_numpy(bad)
    exp = expected_bad(X)
    assert bad.tolist() == exp.int().tolist()
    assert (G[exp] == 0).all()
    ok = ~exp
    ref = symeig.gram(X)[ok]
    # each entry a sum of n products: float64 rounding, relative to the row scales (Cauchy-Schwarz)
    d = ref.diagonal(dim1=-2, dim2=-1)
    scale = (d[:, :, None] * d[:, None, :]).sqrt()
    assert ((G[ok] - ref).abs() <= 1e-13 * scale + 1e-300).all()
    assert torch.equal(G, G.transpose(-1, -2))  # symmetric bit for bit


@needs_gxx
@pytest.mark.parametrize("K,V", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_emulated_gram_is_the_reference(K, V, dtype):
    from tests.support import emulated_spectra

    X = states(8, K, V, dtype, seed=K + V)
    G, bad = emulated_spectra.gram(X.numpy())
    _check_against_reference(X, G, bad)


@needs_gxx
def test_emulated_gram_skips_the_masked_states():
    from tests.support import emulated_spectra

    X = states(8, 128, 128, torch.float32).numpy()
    G0, bad0 = emulated_spectra.gram(X)
    skip = np.array([1, 0, 1, 0, 0, 1, 0, 0])
    G1, bad1 = emulated_spectra.gram(X, skip)
    s = skip.astype(bool)
    assert np.isnan(G1[s]).all()  # never written
    assert (bad1[s] == 0).all()
    assert np.array_equal(G1[~s], G0[~s]) and np.array_equal(bad1[~s], bad0[~s])
    G2, bad2 = emulated_spectra.gram(X, np.zeros(8, dtype=np.int32))
    assert np.array_equal(G2, G0) and np.array_equal(bad2, bad0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("K,V", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_gram_is_the_emulation_bit_for_bit(K, V, dtype):
    from tests.support import cuda_emul, emulated_spectra

    X = states(8, K, V, dtype, seed=K + V)
    assert cuda_gram.kernel(K, V, cuda_gram.CTYPES[dtype], torch.device("cuda")) is not None, cuda_gram.KERNELS.reason
    G, bad = cuda_gram.gram(X.cuda())
    _check_against_reference(X, G.cpu().numpy(), bad.int().cpu().numpy())
    skip = torch.tensor([0, 1, 0, 0, 1, 0, 0, 1], dtype=torch.bool, device="cuda")
    G1, bad1 = cuda_gram.gram(X.cuda(), skip)
    keep = ~skip
    assert torch.equal(G1[keep], G[keep]) and torch.equal(bad1[keep], bad[keep]) and not bad1[skip].any()
    Gf, badf = symeig.finite_gram(X.cuda(), skip=torch.zeros(8, dtype=torch.bool, device="cuda"))
    assert torch.equal(Gf, G) and torch.equal(badf, bad)  # with a mask, finite_gram runs the kernel
    Gt, badt = symeig.finite_gram(X.cuda())  # without one, cuBLAS: the same flags, the same matrices to rounding
    assert torch.equal(badt, bad)
    ok = ~badt
    d = Gt[ok].diagonal(dim1=-2, dim2=-1)
    assert ((Gt[ok] - G[ok]).abs() <= 1e-13 * (d[:, :, None] * d[:, None, :]).sqrt() + 1e-300).all()
    if cuda_emul.available():
        Ge, bade = emulated_spectra.gram(X.numpy())
        assert np.array_equal(G.cpu().numpy(), Ge) and np.array_equal(bad.int().cpu().numpy(), bade)
