"""The CUDA truncation kernel (NVRTC; source ``cuda_truncate_src.cu`` beside this file): launches and their plan.

``truncate_cuda(X, ranks)`` computes what ``gdnviz.truncation.reference.subspace_truncate`` computes — ``U_r U_rᵀ S``
for every state ``S [K, V]`` (K, V ∈ {64, 128}), ranks 1 … 32 — with one thread block of 256 threads per state
(``docs/kernels-truncation.md`` describes its design and numbers). The launches of one call (``plan``):

* certified attempts first when every state has the same host-side rank (an int) and default filter steps: a
  16-column block with 2 steps for r ≤ 4; a 32-column block with 2 steps for 5 ≤ r ≤ 16 when the states fit in one
  wave over the multiprocessors. The kernel bounds each attempt's energy error itself; a state whose bound is ≤
  ``CERT_TOL`` is written and flagged done on the device, the others run the full algorithm in the next launch
  (mode ``READ_DONE``). No host sync.
* ≤ ``SPLIT_MAX_STATES`` states (a layer's heads at one boundary): split launches — ``gdnviz_gram`` (S Sᵀ over many
  thread blocks), the algorithm reading G and leaving U (modes ``GRAM_IN | NO_PROJ``), ``gdnviz_project`` (U (Uᵀ S))
  — the same bits as one block per state, with the Gram matrix and the projection spread over the GPU.
* more states than multiprocessors with a second pass (rank > 16, or device-side ranks): the phased launch, each
  state as ``PHASED_ITEMS`` consecutive thread blocks handed over through global memory (the same bits), so that the
  last wave of one-SM blocks does not leave most multiprocessors idle (a two-item form measured slower).

Contract (``truncate_cuda``): ``X [N, K, V]`` float32 or float64 CUDA, contiguous; ``ranks`` an int (1 … 32, or
≥ min(K, V): copied bit for bit) or an int32 CUDA tensor ``[N]`` (or 0-d) read only by the kernel — a device-side
rank < 1 or 33 … min(K, V) − 1 gives a NaN state; ``iters`` filter steps of every pass (None: ``iterations_for(r, p)``
per state and pass). No host sync; the constant buffers are cached per device (make the first call outside a graph
capture). Raises ValueError for unsupported inputs, RuntimeError when the kernel cannot be compiled.

Builds: the tensor-core build is the one that runs. The fused multiply-add build (``dmma=False``, no
``GDNVIZ_DMMA``) exists for the CPU emulation only: the emulated tensor-core instructions are several times slower,
so most emulated tests run the FMA build and one test pins the two builds together. ``profile=True`` (the
``GDNVIZ_PROFILE`` build: clock64() counters per phase, read by ``bench/bench_truncate_phases.py``).
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch

from gdnviz.gpu.nvrtc import Kernels
from gdnviz.truncation import constants as C

Q = C.BLOCK
BLOCKS = (16, 32)  # block widths: the 16-column attempt's, the full algorithm's (and the 32-column attempt's)
NT = 256
SRC_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_truncate_src.cu")
CTYPES = {torch.float32: "float", torch.float64: "double"}
SIGNATURE = ["const {T}*", "{T}*", "const int*", "int", "int", "const double*", "const double*", "const int*", "int",
             "double*", "int", "double", "double", "int", "int*", "double*", "double", "const double*", "double*",
             "int*"]
GRAM_SIGNATURE = ["const {T}*", "double*"]
PROJECT_SIGNATURE = ["const {T}*", "{T}*", "const int*", "int", "int", "const double*"]
READ_DONE, ATTEMPT, GRAM_IN, NO_PROJ, PHASED = 1, 2, 4, 8, 16  # the kernel's mode bits (the source)
SPLIT_MAX_STATES = 64  # split launches up to this many states (above, they measured 10–30% slower)
PHASED_ITEMS = 3  # thread blocks per state of a phased launch (the source's PHASED items)
PCOLS = 16  # columns of S per gdnviz_project thread block (the kernel's PCOLS)

KERNELS = Kernels()  # KERNELS.available / KERNELS.reason: whether compilation worked, and why not


def source(K: int, V: int, ctype: str = "float", qb: int = Q, dmma: bool = True) -> str:
    """The kernel's CUDA source for ``[K, V]`` states of C type ``ctype`` ("float" or "double") with a block of ``qb``
    columns (32: the full algorithm; 16: the small block of the certified attempt). ``dmma=False``: the fused
    multiply-add build (emulation only, module docstring)."""
    if K not in C.DIMS or V not in C.DIMS or ctype not in ("float", "double") or qb not in BLOCKS:
        raise ValueError(f"the CUDA truncation kernel takes K, V in {C.DIMS}, float/double and a block in {BLOCKS}; "
                         f"got {K}, {V}, {ctype}, {qb}")
    with open(SRC_PATH) as f:
        text = f.read()
    for key, val in (("@K@", K), ("@V@", V), ("@T@", ctype), ("@QB@", qb), ("@LQB@", qb.bit_length() - 1)):
        text = text.replace(key, str(val))
    return ("#define GDNVIZ_DMMA\n" if dmma else "") + text


def smem_bytes(K: int, qb: int = Q) -> int:
    """Dynamic shared memory per block: G [K, K + 1] (rows padded to an odd stride), two [K, qb + 1] blocks, two
    [qb, qb + 2] matrices (the Jacobi's), 384 doubles of scalars."""
    return 8 * (K * (K + 1) + 2 * K * (qb + 1) + 2 * qb * (qb + 2) + 384)


def project_smem_bytes(K: int) -> int:
    """Dynamic shared memory of ``gdnviz_project``: U [K, 32], its 16 columns of S [K, 16], M [32, 16] (float64)."""
    return 8 * (K * C.MAX_RANK + K * PCOLS + C.MAX_RANK * PCOLS)


def gsave_cols(K: int) -> int:
    """Doubles per state of a phased launch's hand-over buffer: G [K, K], Q [K, 32], zscale, the trace (3 × 4)."""
    return K * K + K * Q + 16


def gram_blocks(K: int) -> int:
    """Thread blocks of ``gdnviz_gram`` per state: one item of G's lower triangle per warp (K = 128: 72 items of
    16 rows × 8 columns; K = 64: the 36 lower 8 × 8 tiles)."""
    items = 72 if K == 128 else (K // 8) * (K // 8 + 1) // 2
    return -(-items // (NT // 32))


def plan(rank: int | None, iters: int | None, n: int = 0, sms: int = 0) -> list[tuple[int, int]]:
    """The launches of one call, in order: ``(block width, mode)``. Attempts only for a host-side ``rank`` and
    default filter steps (per-state device ranks, None, run the full algorithm in one launch: a chain of launches
    would serialise states that one launch runs side by side); the 32-column attempt only when the ``n`` states fit
    in one wave over ``sms`` multiprocessors (0: unknown, allowed)."""
    out: list[tuple[int, int]] = []
    if iters is None and rank is not None and 1 <= rank <= C.MAX_RANK:
        for qb, _ in C.ATTEMPTS:
            if C.attempt_table(qb)[rank] >= 0 and (qb == min(BLOCKS) or not sms or n <= sms):
                out.append((qb, ATTEMPT))
    out.append((Q, READ_DONE if out else 0))
    return out


def split_on(n: int) -> bool:
    """Whether a call on ``n`` states uses the split launches."""
    return n <= SPLIT_MAX_STATES


def phased_on(n: int, rank: int | None, sms: int, split: bool = False, profile: bool = False) -> bool:
    """Whether the full-algorithm launch runs phased: some state may take a second pass (``rank`` None, i.e.
    device-side ranks, or > 16), the states outnumber the ``sms`` multiprocessors, and neither the split launches nor
    the profile build run."""
    if split or profile:
        return False
    return (rank is None or rank > C.HALF) and sms > 0 and n > sms


def tol2(mode: int, qb: int) -> float:
    """The Jacobi stop (squared relative off-diagonal norm) of a launch: the attempts' or the full algorithm's."""
    return C.ATTEMPT_JACOBI_TOL[qb] ** 2 if mode & ATTEMPT else C.FULL_JACOBI_TOL**2


def available() -> bool:
    """Whether the kernel can run here: NVRTC worked so far and this is an NVIDIA build (32-lane warps)."""
    return KERNELS.usable()


def supports(X: torch.Tensor) -> bool:
    """CUDA ``[N, K, V]`` float32/float64 with K, V in DIMS."""
    return X.is_cuda and X.dim() == 3 and X.dtype in CTYPES and X.shape[1] in C.DIMS and X.shape[2] in C.DIMS


def kernel(K: int, V: int, dtype: torch.dtype, device: torch.device, qb: int = Q, profile: bool = False,
           name: str = "gdnviz_truncate"):
    """The compiled entry ``name`` (compiled on first use, cached in memory and on disk), or None if NVRTC fails."""
    ctype = CTYPES[dtype]
    src = ("#define GDNVIZ_PROFILE\n" if profile else "") + source(K, V, ctype, qb)
    smem = {"gdnviz_truncate": smem_bytes(K, qb), "gdnviz_project": project_smem_bytes(K)}.get(name, 0)
    return KERNELS.get((K, V, ctype, device.index, qb, profile, name), device, src, name, shared_mem=smem)


def truncate_cuda(X: torch.Tensor, ranks, iters: int | None = None) -> torch.Tensor:
    """``U_r U_rᵀ S`` for every state of ``X`` (module docstring)."""
    return launch(X, ranks, iters).out


class Launched(NamedTuple):
    """What one call left on the device: the output ``[N, K, V]``; the float64 scratch ``[N, K, 32]`` (U, or the
    profile counters); per state whether a certified attempt wrote it (int32 ``[N]``, 1 = yes) and its attempt's
    energy-error bound (float64 ``[N]``; ``NO_BOUND`` where none holds; both zero-length when no attempt ran)."""
    out: torch.Tensor
    scratch: torch.Tensor
    done: torch.Tensor
    bound: torch.Tensor


_SMS: dict[str, int] = {}


def sm_count(device: torch.device) -> int:
    key = str(device)
    if key not in _SMS:
        _SMS[key] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[key]


_TABLES: dict[str, dict[int, torch.Tensor]] = {}


def _attempt_tables(device: torch.device) -> dict[int, torch.Tensor]:
    """The attempts' step tables, int32 ``[66]`` per block width, cached per device (first call outside a graph)."""
    key = str(device)
    if key not in _TABLES:
        _TABLES[key] = {qb: torch.tensor(C.attempt_table(qb), dtype=torch.int32, device=device)
                        for qb, _ in C.ATTEMPTS}
    return _TABLES[key]


def launch(X: torch.Tensor, ranks, iters: int | None = None, profile: bool = False,
           attempts: bool = True) -> Launched:
    """One call on ``X [N, K, V]``: the launches of ``plan`` (``attempts=False``: the full algorithm only, for tests
    and the profile benchmark)."""
    if not supports(X):
        raise ValueError(f"truncate_cuda takes float32/float64 CUDA [N, K, V] with K, V in {C.DIMS}; got {X.dtype} "
                         f"{tuple(X.shape)} on {X.device}")
    N, K, V = X.shape
    device_ranks = isinstance(ranks, torch.Tensor)
    sms = sm_count(X.device)
    steps = plan(None if device_ranks or not attempts else int(ranks), iters, N, sms)
    split = not profile and split_on(N)
    kernels = {qb: kernel(K, V, X.dtype, X.device, qb, profile) for qb, _ in steps}
    if split:
        gram = kernel(K, V, X.dtype, X.device, Q, False, "gdnviz_gram")
        project = kernel(K, V, X.dtype, X.device, Q, False, "gdnviz_project")
    if any(k is None for k in kernels.values()) or (split and (gram is None or project is None)):
        raise RuntimeError(f"the CUDA truncation kernel is unavailable: {KERNELS.reason}")
    X = X.contiguous()
    omega, fill, table = C.start_matrices(K, V, X.device)
    out = torch.empty_like(X)
    if device_ranks:
        rt = ranks.to(X.device, torch.int32)
        rank_int, stride = 0, (rt.stride(0) if rt.dim() == 1 else 0)
    else:
        rt, rank_int, stride = table, int(ranks), -1
    scratch = (torch.zeros if profile else torch.empty)(N, K, Q, dtype=torch.float64, device=X.device)
    n_att = N if len(steps) > 1 else 0
    done = torch.empty(n_att, dtype=torch.int32, device=X.device)
    bound = torch.empty(n_att, dtype=torch.float64, device=X.device)
    phased = phased_on(N, None if device_ranks else int(ranks), sms, split, profile)
    if N:
        tables = _attempt_tables(X.device)
        with torch.cuda.device(X.device):
            G = torch.empty(N, K, K, dtype=torch.float64, device=X.device) if split else scratch
            if split:
                gram(grid=(N * gram_blocks(K), 1, 1), block=(NT, 1, 1), args=[X, G])
            for qb, mode in steps:
                tab = tables[qb] if mode & ATTEMPT else table
                items = PHASED_ITEMS if phased and not mode & ATTEMPT else 1
                gsave = (torch.empty(N, gsave_cols(K), dtype=torch.float64, device=X.device) if items > 1
                         else scratch)
                sync = torch.zeros(N + 1, dtype=torch.int32, device=X.device) if items > 1 else table
                kernels[qb](grid=(items * N, 1, 1), block=(NT, 1, 1),
                            args=[X, out, rt, rank_int, stride, omega, fill, tab,
                                  -1 if iters is None else int(iters), scratch, C.JACOBI_MAX_SWEEPS, tol2(mode, qb),
                                  C.JACOBI_SKIP,
                                  mode | (GRAM_IN | NO_PROJ if split else 0) | (PHASED if items > 1 else 0),
                                  done if n_att else table, bound if n_att else scratch, C.CERT_TOL, G, gsave, sync],
                            shared_mem=smem_bytes(K, qb))
            if split:
                project(grid=(N * (V // PCOLS), 1, 1), block=(NT, 1, 1), args=[X, out, rt, rank_int, stride, scratch],
                        shared_mem=project_smem_bytes(K))
    return Launched(out, scratch, done, bound)
