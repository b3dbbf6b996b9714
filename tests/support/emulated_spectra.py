"""The spectra's CUDA kernels (``gdnviz.gpu.cuda_tridiag``, ``gdnviz.gpu.cuda_bisect``) run on the CPU through
``tests.support.cuda_emul`` (g++, CUDA's threads emulated): the same sources and launches as on the GPU, NumPy in and
out. Needs g++ (``cuda_emul.available()``).
"""
from __future__ import annotations

import numpy as np

from gdnviz.gpu import cuda_bisect, cuda_tridiag
from tests.support.cuda_emul import Emulated


def tridiag(G: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(D [N, n], E [N, n])`` of symmetric float64 ``G [N, n, n]`` (n in ``cuda_tridiag.SIZES``), as
    ``cuda_tridiag.tridiag``. Every entry is written (the outputs start as NaN)."""
    N, n, _ = G.shape
    emu = Emulated(cuda_tridiag.source(n), "gdnviz_tridiag", ["const double*", "double*", "double*"])
    D, E = np.full((N, n), np.nan), np.full((N, n), np.nan)
    emu.launch(N, 2 * n, [np.ascontiguousarray(G, dtype=np.float64), D, E])
    return D, E


def bisect(D: np.ndarray, E: np.ndarray, steps: int = cuda_bisect.STEPS) -> np.ndarray:
    """Ascending eigenvalues ``[N, n]`` of the tridiagonals (D, E), as ``cuda_bisect.bisect``."""
    N, n = D.shape
    emu = Emulated(cuda_bisect.source(n), "gdnviz_bisect", ["const double*", "const double*", "double*", "int"])
    W = np.full((N, n), np.nan)
    emu.launch(N, n, [np.ascontiguousarray(D, dtype=np.float64), np.ascontiguousarray(E, dtype=np.float64), W,
                      int(steps)])
    return W


def eigvalsh(G: np.ndarray) -> np.ndarray:
    """Ascending eigenvalues ``[N, n]`` of symmetric float64 ``G [N, n, n]``: ``gdnviz.gpu.symeig.eigvalsh``'s fast
    path, emulated."""
    return bisect(*tridiag(G))
