"""The spectra's CUDA kernels (``gdnviz.gpu.cuda_gram``, ``gdnviz.gpu.cuda_tridiag``, ``gdnviz.gpu.cuda_bisect``) run on the CPU through
``tests.support.cuda_emul`` (g++, CUDA's threads emulated): the same sources and launches as on the GPU, NumPy in and
out. Needs g++ (``cuda_emul.available()``).
"""
from __future__ import annotations

import numpy as np

from gdnviz.gpu import cuda_bisect, cuda_gram, cuda_tridiag
from tests.support.cuda_emul import Emulated


def _skip_args(skip, N: int) -> list:
    """The kernels' ``(const int* SKIP, int skip_on)``, as ``cuda_tridiag.skip_args`` passes them: None → a
    placeholder (not read) and 0; else ``skip [N]`` (nonzero = skipped) as int32 and 1."""
    if skip is None:
        return [np.zeros(1, dtype=np.int32), 0]
    skip = np.ascontiguousarray(skip, dtype=np.int32)
    if skip.shape != (N,):
        raise ValueError(f"skip must have shape ({N},); got {skip.shape}")
    return [skip, 1]


def gram(X: np.ndarray, skip=None) -> tuple[np.ndarray, np.ndarray]:
    """``(G [N, n, n], bad [N] int32)`` of float32 / float64 states ``X [N, K, V]``, as ``cuda_gram.gram``
    (``skip``: N ints, nonzero = skipped). ``G`` starts as NaN and ``bad`` as -1: the kernel writes every entry but
    the skipped matrices' rows of ``G``."""
    N, K, V = X.shape
    ctype = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}[X.dtype]
    emu = Emulated(cuda_gram.source(K, V, ctype), "gdnviz_gram",
                   [f"const {ctype}*", "double*", "int*", "const int*", "int"])
    n = min(K, V)
    G, bad = np.full((N, n, n), np.nan), np.full(N, -1, dtype=np.int32)
    emu.launch(N, cuda_gram.THREADS, [np.ascontiguousarray(X), G, bad, *_skip_args(skip, N)],
               shared_mem=cuda_gram.smem_bytes(K, V, ctype))
    return G, bad


def tridiag(G: np.ndarray, skip=None) -> tuple[np.ndarray, np.ndarray]:
    """``(D [N, n], E [N, n])`` of symmetric float64 ``G [N, n, n]`` (n in ``cuda_tridiag.SIZES``), as
    ``cuda_tridiag.tridiag`` (``skip``: N ints, nonzero = skipped). The outputs start as NaN: the kernel writes every
    entry but the skipped matrices' rows (``tridiag`` starts those at zero)."""
    N, n, _ = G.shape
    emu = Emulated(cuda_tridiag.source(n), "gdnviz_tridiag",
                   ["const double*", "double*", "double*", "const int*", "int"])
    D, E = np.full((N, n), np.nan), np.full((N, n), np.nan)
    emu.launch(N, 2 * n, [np.ascontiguousarray(G, dtype=np.float64), D, E, *_skip_args(skip, N)])
    return D, E


def bisect(D: np.ndarray, E: np.ndarray, steps: int = cuda_bisect.STEPS, skip=None) -> np.ndarray:
    """Ascending eigenvalues ``[N, n]`` of the tridiagonals (D, E), as ``cuda_bisect.bisect`` (``skip``: N ints,
    nonzero = skipped). Every entry is written (the output starts as NaN)."""
    N, n = D.shape
    emu = Emulated(cuda_bisect.source(n), "gdnviz_bisect",
                   ["const double*", "const double*", "double*", "int", "const int*", "int"])
    W = np.full((N, n), np.nan)
    emu.launch(N, n, [np.ascontiguousarray(D, dtype=np.float64), np.ascontiguousarray(E, dtype=np.float64), W,
                      int(steps), *_skip_args(skip, N)])
    return W


def eigvalsh(G: np.ndarray, skip=None) -> np.ndarray:
    """Ascending eigenvalues ``[N, n]`` of symmetric float64 ``G [N, n, n]``: ``gdnviz.gpu.symeig.eigvalsh``'s fast
    path, emulated (skipped rows: zeros)."""
    return bisect(*tridiag(G, skip), skip=skip)
