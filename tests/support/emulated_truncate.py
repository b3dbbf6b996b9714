"""The CUDA truncation kernel's launches run on the CPU through ``tests.support.cuda_emul`` (needs ``g++``).

``emulate(X, ranks, ...)`` makes the launches ``gdnviz.truncation.cuda.launch`` makes, on the same kernel source,
with every thread of a block emulated. Slow (~0.1–1 s per state and launch).
"""
from __future__ import annotations

import numpy as np
import torch

from gdnviz.truncation import constants as C
from gdnviz.truncation import cuda
from tests.support.cuda_emul import Emulated

# The profile build's counters (GDNVIZ_PROFILE; the same layout as bench/bench_truncate_phases.py's PHASES): index
# 15 counts Jacobi sweeps, 16 the checked Cholesky-QRs that left their block as it was; clock readings are 0 here.
N_COUNTERS = 20
JACOBI_SWEEPS, CHOLQR_SKIPPED = 15, 16


def emulate(X: torch.Tensor, ranks, iters: int | None = None, attempts: bool = True, info: bool = False,
            concurrent: int = 4, dmma: bool = False, split: bool = False, counters: bool = False,
            phased: int = 0):
    """``X [N, K, V]`` float32/float64, ``ranks`` an int (a host-side rank: attempts when ``attempts``) or N ints (run
    as device-side ranks: no attempts). ``concurrent`` blocks run at once, in lockstep by barrier phases, so a block
    writing into another block's part of a buffer changes the answers here as it would on a GPU. Returns the output,
    or with ``info`` (output, done int32 ``[N]``, bound float64 ``[N]``) as in ``cuda.Launched``. ``dmma``: the
    tensor-core build (the GPU's), its instructions emulated by warp collectives — several times slower than the
    FMA build the other tests run. ``split``: the split launches. ``counters``: the ``GDNVIZ_PROFILE`` build (not
    with ``split``), returning ``(output, counters float64 [N, 20])``. ``phased``: the full algorithm's launch as
    ``PHASED`` (three thread blocks per state), whatever the rank and the number of states."""
    N, K, V = X.shape
    ctype = cuda.CTYPES[X.dtype]
    omega, fill, table = (t.cpu().numpy() for t in C.start_matrices(K, V, torch.device("cpu")))
    x = np.ascontiguousarray(X.detach().cpu().numpy())
    out = np.full_like(x, np.nan)
    if isinstance(ranks, int):
        rk, rank_int, stride = table.astype(np.int32), ranks, -1
    else:
        rk = np.ascontiguousarray(np.asarray([int(v) for v in ranks], dtype=np.int32))
        rank_int, stride = 0, 1
    steps = cuda.plan(rank_int if stride < 0 and attempts else None, iters)
    scratch = np.empty((N, K, cuda.Q), dtype=np.float64)
    done = np.zeros(N, dtype=np.int32)
    bound = np.full(N, C.NO_BOUND)
    G = np.full((N, K, K), np.nan) if split else np.zeros(1)
    if counters and split:
        raise ValueError("counters come from the fused kernel's profile build: not with split")
    if phased not in (0, 3):
        raise ValueError("phased takes 0 (one block per state) or 3 thread blocks per state")
    if phased and (split or counters):
        raise ValueError("phased launches run without split launches and without the profile build")
    if split:
        emu = Emulated(cuda.source(K, V, ctype, cuda.Q, dmma), "gdnviz_gram",
                       [s.format(T=ctype) for s in cuda.GRAM_SIGNATURE])
        emu.launch(N * cuda.gram_blocks(K), cuda.NT, [x, G], 0, concurrent=concurrent)
    prof = "#define GDNVIZ_PROFILE\n" if counters else ""
    count = np.zeros((N, N_COUNTERS))
    for qb, mode in steps:
        if counters:
            scratch[:] = 0.0
        emu = Emulated(prof + cuda.source(K, V, ctype, qb, dmma), "gdnviz_truncate",
                       [s.format(T=ctype) for s in cuda.SIGNATURE])
        tab = np.asarray(C.attempt_table(qb), dtype=np.int32) if mode & cuda.ATTEMPT else table.astype(np.int32)
        items = int(phased) if phased and not mode & cuda.ATTEMPT else 1
        gsave = np.full((N, cuda.gsave_cols(K)), np.nan) if items > 1 else np.zeros(1)
        sync = np.zeros(N + 1, dtype=np.int32)
        mode_bits = (mode | (cuda.GRAM_IN | cuda.NO_PROJ if split else 0)
                     | (cuda.PHASED if items > 1 else 0))
        emu.launch(items * N, cuda.NT,
                   [x, out, rk, rank_int, stride, np.ascontiguousarray(omega), np.ascontiguousarray(fill),
                    np.ascontiguousarray(tab), -1 if iters is None else int(iters), scratch, C.JACOBI_MAX_SWEEPS,
                    cuda.tol2(mode, qb), C.JACOBI_SKIP, mode_bits, done, bound, C.CERT_TOL, G, gsave, sync],
                   cuda.smem_bytes(K, qb), concurrent=concurrent)
        if counters:
            count += scratch[:, 0, :N_COUNTERS]
    if split:
        emu = Emulated(cuda.source(K, V, ctype, cuda.Q, dmma), "gdnviz_project",
                       [s.format(T=ctype) for s in cuda.PROJECT_SIGNATURE])
        emu.launch(N * (V // cuda.PCOLS), cuda.NT, [x, out, rk, rank_int, stride, scratch],
                   cuda.project_smem_bytes(K), concurrent=concurrent)
    res = torch.from_numpy(out)
    if counters:
        return res, torch.from_numpy(count)
    return (res, torch.from_numpy(done), torch.from_numpy(bound)) if info else res
