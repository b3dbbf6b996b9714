"""Fused top-r truncation of GDN head states as one CUDA kernel (NVRTC): one thread block of 256 threads per state.

``truncate_cuda(X, ranks)`` computes what ``gdnviz.gpu.fused_truncate.reference_fused`` computes — the projection
``S_r = U_r U_rᵀ S`` of each state ``S [K, V]`` (K, V ∈ {64, 128}) onto its top-``r`` left singular directions by
float64 block subspace iteration with Rayleigh–Ritz, ranks 1 … 32, the same start matrices, iteration counts,
shifted Cholesky-QR, refill and second pass on the deflated state (see that module) — in one launch, with the whole
algorithm of one state inside one thread block (source: ``cuda_truncate_src.cu`` beside this file):

**Certified attempts first** (``ATTEMPTS``, default on; ``GDNVIZ_CUDA_TRUNCATE_ATTEMPT=0`` off). When every state
has the same host-side rank, each is first tried with a narrower block and fewer filter steps — 16 columns with 2
steps for r ≤ 4; 32 columns with 2 steps for 5 ≤ r ≤ 16 when the states fit in one wave (``plan``) — and the
kernel certifies the result itself with the bound of
``gdnviz.truncate.energy_error_bound`` in the Ritz basis (``T' = WᵀTW`` from the Jacobi, ``R = (GQ − QT)W``, ``‖G‖_F``;
λ_min / λ_max of the diagonal blocks from their diagonals ∓ the Frobenius norm of their off-diagonal parts, Weyl),
or by the energy the kept directions miss, ``1 − tr(T'_rr)`` (rank-deficient states). A state whose bound is
≤ ``CERT_TOL`` (5e-6; criterion 1e-5) is written and flagged done on the device; a second launch runs the full
algorithm on the states left (a state with NaN or inf is never certified). No host synchronisation: the flags live
on the device, and a launch whose states are all done costs a few microseconds. Certified answers are exact to their bound, not to
``reference_fused``'s rounding; the uncertified ones are ``reference_fused``'s. The same source serves both block
widths (``@QB@``). Emulated tests: every battery meets the criterion, certified states' actual errors are under
their bounds, and every attempt with no filter step whose answer misses the criterion is refused and redone.

* ``G = S Sᵀ / ‖S‖²_F`` stays in shared memory (129 KiB for K = 128: rows padded to 129 doubles), with the
  32-column block ``Q`` and a work block (``[K, 33]`` each, padded against bank conflicts) and two 32×32 matrices
  (rows padded to 34, an even stride: eighteenth session): 215 KiB of the H200's 227 KiB per block. Only ``U`` (the
  kept directions, ``[K, 32]``) goes to a global scratch buffer.
* products ``G·Q``, the Gram matrix ``S Sᵀ``, the sketch ``S Ω`` and the deflation's ``UYᵀ + YUᵀ`` (lower tiles,
  mirrored; both since the seventeenth session) on the float64 tensor cores (``mma.sync``, 8-row tiles per warp;
  ``GDNVIZ_CUDA_TRUNCATE_DMMA=0``: register-tiled float64 FMAs, 4×4 and 8×8 per thread, the build before the
  ninth session); ``U (Uᵀ S)`` as FMAs over the r kept columns only. For K = 128 each warp's two 8-row tiles go
  through one ``m16n8k4`` (sm_90) instead of two ``m8n8k4`` (nineteenth session): on the H200 m8n8k4 reaches 23.6
  TFLOP/s and m16n8k4 52.5 (``bench/bench_mma_shapes.py``, 8 warps per SM), so the products ran on half the float64
  tensor cores; ``G·Q`` 199.4K → 117.4K cycles per state at r = 32, the Gram matrix 60.8K → 41.1K. The small block
  products ``U (Uᵀ Z)``, ``U (Uᵀ G U)`` and ``Q W_sel`` too (``gemm_xb``, nineteenth session; they were per-entry sums
  of fused multiply-adds from shared memory): 749.6K → 722.3K cycles per state at r = 32. G's rows are
  padded to an odd stride and the ``G·Q`` fragments read rows of k four apart, so that their shared-memory loads are
  free of bank conflicts (they were 4-way conflicted: ``G·Q`` took 45% fewer cycles without, tenth session); the
  Gram matrix and the deflation compute only the lower triangle (9 items of 16 × 8 per warp at K = 128); an attempt
  starts from ``G Ω`` (G in shared memory already) instead of reading S again for ``S Ω``;
* Cholesky-QR: ``QᵀQ`` (on the tensor cores too; the FMA build sums it in four interleaved parts at 16 columns),
  then warp 0 factorises it — lane i holds row i in registers, each column's entries pass through shared memory
  with one ``__syncwarp``, the pivot by a shuffle, one multiply-add per entry and column — and threads < K
  forward-substitute row t of ``Q`` (right-looking) from ``L`` stored transposed (16-byte loads): three block
  barriers per call instead of one per column; one copy of its code (``__noinline__``, eighteenth session: the six
  inlined copies made the kernel 478 KB of instructions, and its 18 calls per state at r = 32 missed the
  instruction cache). The pairs after the refill and of the final ``U`` are *checked* (nineteenth session,
  ``fused_truncate.checked_cholqr``): a block whose shifted Gram matrix is within ``ORTH_TOL`` (1e-12) of the
  identity is left as it is; on GDN-like states at r = 32 most of the six checked calls skip;
* the first pass's sketch ``S Ω₀`` is accumulated in the Gram matrix's loop (tensor-core build, eighteenth session;
  ``GDNVIZ_CUDA_TRUNCATE_FUSED_SKETCH=0`` keeps the separate pass, the same bits);
* more states than multiprocessors at ranks > 16 (two passes): the phased launch (``phased_on``, eighteenth session)
  runs each state as three thread blocks (the first pass; the second's filter steps; the rest), handed over through
  global memory, so that the last of the three waves that 288 one-SM states need on 132 SMs does not leave most SMs
  idle; the same bits;
* Rayleigh–Ritz: the cyclic parallel Jacobi of ``gdnviz.gpu.jacobi`` (round-robin pairs, ``a_pq`` the mean of both
  triangles, the skip test, Rutishauser's diagonal, the stop test once per sweep, ``MAX_SWEEPS`` / ``TOL``) with the
  whole block: 32 threads compute a round's 16 rotations, all 256 apply ``Jᵀ A J`` and ``V J`` (two barriers per
  round); for 32-column blocks, since the sixteenth session, the pair-block rounds of ``pair_jacobi_on`` (one
  barrier per round, the same bits, 6–10% faster at r = 4 / 12 / 32).

Why: the subspace path of ``gdnviz.truncate`` launches ~40 small kernels per call and the Triton fused kernel runs
~500 dependent cross-warp reductions with spills; both take ~0.6–1 ms for the 16 states of one layer-boundary on an
H200, where the truncated run needs ≤ ~0.1 ms (bench/RESULTS.md, sixth session).

Measured (H200, bench/RESULTS.md "sixth session — calls 2–5"; CUDA-graph replay, GDN-like float32 states): 16 states
0.49 / 0.56 / 0.59 / 1.22 ms for r = 1 / 4 / 12 / 32 — 2.0× faster than the Triton fused kernel in the same run and
1.03–1.19× faster than the subspace path with the CUDA Cholesky-QR; 288 states 1.29 / 1.34 / 1.46 / 3.11 ms (one
block per state for its whole life: three waves over 132 SMs; there the subspace path is faster). Where its time
goes (``bench/bench_truncate_phases.py``, thread 0's cycles per phase for r = 4): Jacobi 40% (4 sweeps × 31 rounds,
each a chain of divisions and square roots for the rotations and two barriers), Cholesky-QRs 25–30% (7 calls × 32
column steps), float64 products ~25%. A one-barrier Jacobi (every thread computing its own rotations) measured 1.5×
slower in its Jacobi and was reverted. ``ptxas`` reports 255 registers and ~300 bytes of spills for K = 128 with 32
columns, none with 16.

Status: used by ``gdnviz.gpu.fused_truncate.truncate_fused`` on CUDA (``DEFAULT_ON``; ``GDNVIZ_CUDA_TRUNCATE=0``
keeps the Triton kernel). With its attempts on, graph windows and the eager loop run it for every layer with ranks
≤ 32 (``gdnviz.intervene.fused_truncation_mode``: ``always``); ``GDNVIZ_FUSED_TRUNCATE=mixed`` keeps the subspace
path for layers of one rank.

Measured with the attempts (H200, eighth session, bench/RESULTS.md; CUDA-graph replay, GDN-like float32 states): 16
states at r = 4 in 0.166 ms against 0.515 ms for the full algorithm (3.1×); 288 states at r = 1 / 4 in 0.896 /
0.975 ms (issue #6's ≤ 1 ms per boundary); a 16K-token run with every head truncated at r = 4 in 3.25× the prefill
instead of 5.98× (subspace path).

Measured (H200, ninth session, bench/RESULTS.md): the tensor cores cut the attempt's cycles at r = 4 by 13% (Gram
17%, G·X 7%: those phases are latency-bound, not arithmetic-bound); with the attempts' looser Jacobi stop
(``ATTEMPT_JACOBI_TOL``) and the projection over r columns, 288 states take 0.406 / 0.875 / 1.305 / 2.848 ms at
r = 1 / 4 / 12 / 32 and 16 states 0.146 ms at r = 4; a 16K-token run at r = 4 is 2.81× the prefill.

Measured (H200, tenth session, bench/RESULTS.md): the Cholesky-QR's factorisation in one warp, conflict-free
``G·Q`` loads, the Gram matrix's lower triangle, the attempts' ``G Ω`` start and ``QᵀQ`` on the tensor cores cut the
r = 4 attempt from 277,718 to 208,672 cycles (−25%) and the r = 12 one from 705,042 to 552,935 (−22%); 288 states take
0.307 / 0.688 / 0.984 / 2.203 ms at r = 1 / 4 / 12 / 32 and 16 states 0.113 ms at r = 1 and 4. Running the Jacobi
rounds of 16 columns in one warp made them 2.6× slower (reverted).

Verified where: on CPU, the same source compiled with g++ against ``tests.support.cuda_emul`` (every thread of a block
as a user-level context, barriers and warp shuffles emulated, shared memory NaN-filled) equals ``reference_fused``
on tests/test_truncate.py's batteries (tests/test_cuda_truncate.py; the FMA build, and the tensor-core build with
``mma.sync`` emulated from warp collectives against it); NVRTC compiles both builds for sm_90 (spills only for 32
columns at K = 128, ≤ 320 bytes);
on CUDA, tests/test_fused_truncate.py's GPU tests run through it when it is on.

Contract (``truncate_cuda``): ``X [N, K, V]`` float32 or float64 CUDA, contiguous; ``ranks`` an int or an int32 CUDA
tensor ``[N]`` (or 0-d) read by the kernel; ``iters`` filter steps of every pass (None: ``iterations_for(r, p)``
per state and pass p).
Ranks ≥ min(K, V) copy the state bit for bit; a device-side rank < 1 or 33 … min(K, V) − 1 gives a NaN state. No
host sync; the constant buffers come from ``fused_truncate._constants`` (cached per device: first call outside a
graph capture); one float64 ``[N, K, 32]`` scratch buffer per call.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np
import torch

from gdnviz.gpu import jacobi as _jacobi
from gdnviz.gpu.nvrtc import Kernels, env_switch

DIMS = (64, 128)
MAX_RANK = 32  # = fused_truncate.MAX_RANK: ranks above take the copy path (≥ min(K, V)) or are invalid
Q = 32
BLOCKS = (16, 32)  # block widths: the 16-column attempt's, the full algorithm's (and the 32-column attempt's)
NT = 256
DEFAULT_ON = True  # measured on an H200 (module docstring)
_SRC_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_truncate_src.cu")
_CTYPES = {torch.float32: "float", torch.float64: "double"}
SIGNATURE = ["const {T}*", "{T}*", "const int*", "int", "int", "const double*", "const double*", "const int*", "int",
             "double*", "int", "double", "double", "int", "int*", "double*", "double", "const double*", "double*",
             "int*"]
GRAM_SIGNATURE = ["const {T}*", "double*"]
PROJECT_SIGNATURE = ["const {T}*", "{T}*", "const int*", "int", "int", "const double*"]
READ_DONE, ATTEMPT, GRAM_IN, NO_PROJ, PHASED, PHASED3 = 1, 2, 4, 8, 16, 32  # the kernel's mode bits (the source)
# Split launches for few states (``split_on``): S Sᵀ by ``gdnviz_gram`` (one 8 × 8 tile of G per warp, K = 128: 17
# thread blocks per state), the algorithm by ``gdnviz_truncate`` reading G (mode GRAM_IN) and leaving U in the scratch
# (NO_PROJ), then U (Uᵀ S) by ``gdnviz_project`` (8 thread blocks per state). The same bits as the fused kernel. Why:
# a truncated run truncates the 16 heads of one layer at a time, so the fused kernel runs 16 thread blocks on a GPU of
# 132 multiprocessors, and its Gram matrix (22% of its cycles at r = 4) and projection (10%) run on one multiprocessor
# per state while the rest idle. Measured on the H200 (bench/RESULTS.md, twelfth session): 16 states 1–5% faster
# (r = 4: 0.1056 vs 0.1117 ms), a 16K truncated run at r = 4 0.2918 → 0.2831 s; 288 states 10–30% slower, hence the
# limit.
SPLIT_MAX_STATES = 64  # split launches when a call has at most this many states (GDNVIZ_CUDA_TRUNCATE_SPLIT=0|1)
SPLIT_DEFAULT_ON = True
# Phased launches (``phased_on``): a full-algorithm launch whose states need two passes (a host-side rank > 16, or
# device-side ranks) and outnumber the multiprocessors runs each state as ``phase_items()`` thread blocks — item 0 up
# to the first pass's deflation, item 1 the second pass's sketch and filter steps, item 2 the rest (with two items,
# item 1 runs both) — handed over through a float64 [N, K·K + K·32 + 16] buffer and a per-state counter (the source's
# PHASED comment). The same bits. Why: one block per state is one block per SM (215 KiB of shared memory), so 288
# states ran in three waves on the H200's 132 SMs, the third with 24 states and 108 SMs idle; smaller items fill
# them. Measured (H200, eighteenth session, r = 32, 288 states, same runs): two items 1.593 → 1.414 ms; three
# 1.579 → 1.374 ms (two 1.397); bench/study_phase_schedule.py: the GPU ~92% busy with three.
PHASED_DEFAULT_ON = True
PHASED_ITEMS = 3  # items per state by default (GDNVIZ_CUDA_TRUNCATE_PHASED=2 or 3 picks)
PCOLS = 16  # columns of S per gdnviz_project thread block (the kernel's PCOLS)
NO_BOUND = 1e300  # the kernel's bound where none holds (not attempted, or no spectral gap)
CERT_TOL = 5e-6  # an attempt's result stands when its energy-error bound is at most this (criterion 1e-5)
# An attempt's Jacobi stops at off(T') ≤ ATTEMPT_JACOBI_TOL[block width]·‖T'‖_F instead of 1e-15: its certificate is
# a bound for any orthonormal basis (gdnviz.truncate.energy_error_bound), with the off-diagonal coupling ‖T'_rc‖² in
# its numerator and the blocks' off-diagonal norms in its Weyl bounds, so a looser stop is paid for by a larger bound,
# never by a wrong answer. How loose: 1e-6 (ninth session, calls 2–3) took the r = 4 attempt from 4 sweeps to 2 on
# the H200, but widened the bounds of states with small gaps — one of bench_cholqr's 16 GDN-like states at r = 12 got
# 1.7e-5 (> CERT_TOL) and the full algorithm's second launch ran for it (0.75 ms instead of ~0.25). At 1e-9 those 16
# states' bounds are those of a converged Jacobi (emulated). For the 16-column attempt (r ≤ 4) 1e-6 stays: on 288
# GDN-like states (emulated, tenth session, G Ω start) it certifies the same 286 of 288 at r = 4 (all 288 at r = 1)
# with the same largest bound as 1e-9, in 2.28 / 2.36 sweeps on average instead of 2.95 / 2.99 (bench/RESULTS.md).
ATTEMPT_JACOBI_TOL = {16: 1e-6, 32: 1e-9}
# The full algorithm's Jacobi stop (no certificate; 1e-15 before the twelfth session, 1e-10 before the seventeenth).
# Within the block the Jacobi only rotates: with A = W^T T W = D + E (E its off-diagonal part), the kept energy is
# the sum of A's top-16 diagonal entries, and the block's best, the sum of its top-16 eigenvalues, exceeds it by at
# most Σ_{i≤16} σ_i(E) ≤ 4‖E‖_F (Ky Fan) — so stopping at off(T') ≤ tol·‖T'‖_F costs at most 4·tol of the energy per
# pass (‖T'‖_F ≤ tr G = 1): 4e-8 at 1e-8, against the criterion's 1e-5 and the step counts' 1e-6 calibration.
# Emulated on 8 GDN-like states at r = 32 (seventeenth session): 47 sweeps instead of 52 at 1e-10, the same
# energies to 2e-16.
FULL_JACOBI_TOL = 1e-8
# The certified attempts: (block width, ((largest rank, filter steps), ...)); a rank has at most one. Chosen from
# bench/study_small_block.py on the demo model's trajectories (bench/RESULTS.md, eighth session): a 16-column block
# with 2 steps certifies every state at r = 1 and r = 4 (1 step would do at r = 1 there, but on GDN-like test states
# a 16-state launch at r = 1 took 0.56 ms instead of 0.17 — uncertified states ran the full algorithm after it);
# 32 columns with 2 steps 97% at r = 8, 95% at r = 12, 85% at r = 16. A state its attempt does not certify runs the
# full algorithm in a second launch.
ATTEMPTS = ((16, ((4, 2),)), (32, ((16, 2),)))
ATTEMPT_DEFAULT_ON = True
DMMA_DEFAULT_ON = True
PAIR_JACOBI_DEFAULT_ON = True  # measured on the H200, sixteenth session (pair_jacobi_on)

KERNELS = Kernels()  # KERNELS.available / KERNELS.reason: whether compilation worked, and why not


def source(K: int, V: int, ctype: str = "float", qb: int = Q, dmma: bool | None = None) -> str:
    """The kernel's CUDA source for ``[K, V]`` states of C type ``ctype`` ("float" or "double") with a block of ``qb``
    columns (32: the full algorithm; 16: the small block of the certified attempt). ``dmma``: the Gram matrix and the
    products G·X on the float64 tensor cores (``GDNVIZ_DMMA``; None = ``dmma_on()``)."""
    if K not in DIMS or V not in DIMS or ctype not in ("float", "double") or qb not in BLOCKS:
        raise ValueError(f"cuda_truncate takes K, V in {DIMS}, float/double and a block in {BLOCKS}; got {K}, {V}, "
                         f"{ctype}, {qb}")
    with open(source_path()) as f:
        text = f.read()
    for key, val in (("@K@", K), ("@V@", V), ("@T@", ctype), ("@QB@", qb), ("@LQB@", qb.bit_length() - 1)):
        text = text.replace(key, str(val))
    head = "#define GDNVIZ_DMMA\n" if (dmma_on() if dmma is None else dmma) else ""
    if pair_rounds(qb):
        head += "#define GDNVIZ_PAIR_JACOBI\n"
    if not fused_sketch_on():
        head += "#define GDNVIZ_SEPARATE_SKETCH\n"
    return head + text


def fused_sketch_on() -> bool:
    """Whether the tensor-core build accumulates the first pass's sketch S Ω₀ in the Gram matrix's loop
    (``GDNVIZ_CUDA_TRUNCATE_FUSED_SKETCH``, default on; ``=0``: a separate pass over S, as before the eighteenth
    session). The same bits either way (emulated, and on the H200)."""
    return env_switch("GDNVIZ_CUDA_TRUNCATE_FUSED_SKETCH", True)


def source_path() -> str:
    """The kernel source file: ``cuda_truncate_src.cu`` beside this module, or the file ``GDNVIZ_CUDA_TRUNCATE_SRC``
    names (an earlier revision, for same-run A/B timing on the GPU; revisions before 4aa323e take one argument fewer,
    the split launches' G, and cannot be launched by this module)."""
    return os.environ.get("GDNVIZ_CUDA_TRUNCATE_SRC", "").strip() or _SRC_PATH


def smem_bytes(K: int, qb: int = Q) -> int:
    """Dynamic shared memory per block: G [K, K + 1] (rows padded to an odd stride), two [K, qb + 1] blocks, two
    [qb, qb + 2] matrices (the Jacobi's, rows padded to an even stride: the source's JQP), 384 doubles of scalars."""
    return 8 * (K * (K + 1) + 2 * K * (qb + 1) + 2 * qb * (qb + 2) + 384)


def dmma_on() -> bool:
    """Whether the kernel runs its Gram matrix and its products G·X on the float64 tensor cores (``mma.sync``
    m8n8k4; ``GDNVIZ_CUDA_TRUNCATE_DMMA=0``: the same sums as fused multiply-adds, as before the ninth session)."""
    return env_switch("GDNVIZ_CUDA_TRUNCATE_DMMA", DMMA_DEFAULT_ON)


def pair_jacobi_on() -> bool:
    """Whether the Jacobi of 32-column blocks runs its pair-block rounds (``GDNVIZ_CUDA_TRUNCATE_PAIR_JACOBI``, default
    on; ``=0``: the per-entry rounds; see the source): every warp computes the round's rotations itself (parameters
    by warp shuffles, the diagonal in registers), each thread updates one 2 × 2 block of A and W, one barrier per
    round. The 16-column attempt (r ≤ 4) always runs the per-entry rounds: there only 64 threads would have a block,
    and the r = 1 attempt measured 7% slower. The same bits as the per-entry rounds (emulated, and on the H200).
    Measured (H200, sixteenth session, ``bench_cholqr.py``, where the pair form was then the variant
    ``cuda_truncate_pair_jacobi``; CUDA-graph replay, GDN-like float32 states; per-entry → pair-block): 288 states r = 4 / 12 / 32 0.668 → 0.628,
    0.891 → 0.799, 1.979 → 1.793 ms (r = 1 0.281 / 0.282); 16 states r = 12 / 32 0.275 → 0.239, 0.693 → 0.621 ms.
    Thread 0's Jacobi cycles at r = 32 (288 states): 500K → 370K, a round ~2,300 → ~1,700 cycles (rotations ~1,000
    of them: every warp now waits for the division, square root and reciprocal square root of its own rotations)."""
    return env_switch("GDNVIZ_CUDA_TRUNCATE_PAIR_JACOBI", PAIR_JACOBI_DEFAULT_ON)


def pair_rounds(qb: int) -> bool:
    """Whether a ``qb``-column build runs the pair-block rounds: the switch on and a 32-column block (the 16-column
    attempt keeps the per-entry rounds; the source's comment says why)."""
    return pair_jacobi_on() and qb == 32


def attempts_on() -> bool:
    """Whether ``truncate_cuda`` tries the certified small-block attempts first (``GDNVIZ_CUDA_TRUNCATE_ATTEMPT=0``
    off: the full algorithm for every state, as ``reference_fused``)."""
    return env_switch("GDNVIZ_CUDA_TRUNCATE_ATTEMPT", ATTEMPT_DEFAULT_ON)


def attempt_table(qb: int) -> list[int]:
    """Filter steps per rank 0 … 32 of the attempt with a ``qb``-column block (−1: not attempted at that rank: above
    its ranks, or taken by a narrower block's attempt), then 33 × −1: the layout of the full algorithm's table (pass
    p's steps at 33 p + r), whose second half an attempt (one pass) never reads."""
    out = []
    for r in range(MAX_RANK + 1):
        owner = next((w for w, steps in ATTEMPTS if any(1 <= r <= top for top, _ in steps)), None)
        k = next((n for top, n in dict(ATTEMPTS)[qb] if 1 <= r <= top), -1)
        out.append(k if owner == qb else -1)
    return out + [-1] * (MAX_RANK + 1)


def plan(rank: int | None, iters: int | None, attempts: bool, n: int = 0, sms: int = 0) -> list[tuple[int, int]]:
    """The launches of one call, in order: ``(block width, mode)``. Attempts run only for a host-side rank ``rank``
    (an int, every state the same) and default filter steps: per-state device ranks (None) run the full algorithm in
    one launch, because a chain of launches would serialise states that one launch runs side by side (a layer of
    mixed ranks 1/4/12/32 took 2.0 s instead of 1.5 s per 16K-token run: bench/RESULTS.md, eighth session). The
    32-column attempt only when the ``n`` states fit in one wave over ``sms`` multiprocessors (0: unknown, allowed):
    it is ~15% cheaper than the full algorithm, and a second wave for its few uncertified states costs more."""
    out: list[tuple[int, int]] = []
    if attempts and iters is None and rank is not None and 1 <= rank <= MAX_RANK:
        for qb, _ in ATTEMPTS:
            if attempt_table(qb)[rank] >= 0 and (qb == min(BLOCKS) or not sms or n <= sms):
                out.append((qb, ATTEMPT))
    out.append((Q, READ_DONE if out else 0))
    return out


def split_on(n: int) -> bool:
    """Whether a call on ``n`` states uses the split launches: ``GDNVIZ_CUDA_TRUNCATE_SPLIT=1`` always, ``=0`` never,
    unset: ``SPLIT_DEFAULT_ON`` and ``n ≤ SPLIT_MAX_STATES``."""
    return env_switch("GDNVIZ_CUDA_TRUNCATE_SPLIT", SPLIT_DEFAULT_ON and n <= SPLIT_MAX_STATES)


def phased_on(n: int, rank: int | None, sms: int, split: bool = False, profile: bool = False) -> bool:
    """Whether the full-algorithm launch of a call on ``n`` states runs phased (``PHASED``: ``phase_items()`` thread
    blocks per state, comment above): ``GDNVIZ_CUDA_TRUNCATE_PHASED=0`` never; otherwise (other values or unset,
    ``PHASED_DEFAULT_ON``) when some state may take a second pass (``rank`` None, i.e. device-side ranks, or > 16),
    the states outnumber the ``sms`` multiprocessors (one wave gains nothing), and neither the split launches nor the
    profile build run."""
    if split or profile or not env_switch("GDNVIZ_CUDA_TRUNCATE_PHASED", PHASED_DEFAULT_ON):
        return False
    return (rank is None or rank > MAX_RANK // 2) and sms > 0 and n > sms


def phase_items() -> int:
    """Thread blocks per state in a phased launch: ``GDNVIZ_CUDA_TRUNCATE_PHASED=2`` or ``3``, else ``PHASED_ITEMS``."""
    env = os.environ.get("GDNVIZ_CUDA_TRUNCATE_PHASED", "").strip()
    return int(env) if env in ("2", "3") else PHASED_ITEMS


def gsave_cols(K: int) -> int:
    """Doubles per state of a phased launch's hand-over buffer: G [K, K], Q [K, 32], zscale, the trace (3 × 4)."""
    return K * K + K * Q + 16


def phase_mode(items: int) -> int:
    """The mode bits of a phased launch with ``items`` thread blocks per state."""
    return PHASED | (PHASED3 if items == 3 else 0)


def gram_blocks(K: int) -> int:
    """Thread blocks of ``gdnviz_gram`` per state: one item of G's lower triangle per warp (the source's GITEMS: for
    K = 128, 72 items of 16 rows × 8 columns; for K = 64, the 36 lower 8 × 8 tiles)."""
    items = 72 if K == 128 else (K // 8) * (K // 8 + 1) // 2
    return -(-items // (NT // 32))


def enabled() -> bool:
    """Whether ``fused_truncate.truncate_fused`` runs this kernel on CUDA: ``GDNVIZ_CUDA_TRUNCATE=1`` (``0`` off;
    unset: ``DEFAULT_ON``), compiled, and an NVIDIA build (the kernel assumes 32-lane warps)."""
    env = os.environ.get("GDNVIZ_CUDA_TRUNCATE", "").strip()
    on = DEFAULT_ON if env == "" else env == "1"
    return on and KERNELS.usable()


def supports(X: torch.Tensor) -> bool:
    """CUDA ``[N, K, V]`` float32/float64 with K, V in DIMS."""
    return X.is_cuda and X.dim() == 3 and X.dtype in _CTYPES and X.shape[1] in DIMS and X.shape[2] in DIMS


def _kernel(K: int, V: int, dtype: torch.dtype, device: torch.device, qb: int = Q, profile: bool = False,
            name: str = "gdnviz_truncate", trace: bool = False):
    ctype = _CTYPES[dtype]
    dmma = dmma_on()
    src = (("#define GDNVIZ_PROFILE\n" if profile else "") + ("#define GDNVIZ_PHASE_TRACE\n" if trace else "")
           + source(K, V, ctype, qb, dmma))
    smem = {"gdnviz_truncate": smem_bytes(K, qb), "gdnviz_project": project_smem_bytes(K)}.get(name, 0)
    return KERNELS.get((K, V, ctype, device.index, qb, profile, dmma, pair_rounds(qb), source_path(), name, trace,
                        fused_sketch_on()), device, src, name, shared_mem=smem)


def phase_trace(X: torch.Tensor, rank: int, items: int = 3) -> torch.Tensor:
    """The schedule of one phased launch of the full algorithm on ``X [N, K, V]`` (CUDA) at a host-side ``rank``
    (17 … 32), from the ``GDNVIZ_PHASE_TRACE`` build (``bench/study_phase_schedule.py``): float64 ``[N, items, 4]``
    on the CPU — per state and item, the time its block took its ticket, the time its wait for the previous item
    ended, its end time (µs from the first ticket) and the SM it ran on. The outputs are ``truncate_cuda``'s."""
    from gdnviz.gpu.fused_truncate import _constants

    if not supports(X) or not MAX_RANK // 2 < int(rank) <= MAX_RANK or items not in (2, 3):
        raise ValueError("phase_trace takes CUDA [N, K, V] states, a rank 17 … 32 and 2 or 3 items")
    N, K, V = X.shape
    kern = _kernel(K, V, X.dtype, X.device, Q, trace=True)
    if kern is None:
        raise RuntimeError(f"the CUDA truncation kernel is unavailable: {KERNELS.reason}")
    X = X.contiguous()
    omega, fill, table = _constants(K, V, X.device)
    out = torch.empty_like(X)
    scratch = torch.empty(N, K, Q, dtype=torch.float64, device=X.device)
    gsave = torch.zeros(N, gsave_cols(K), dtype=torch.float64, device=X.device)
    sync = torch.zeros(N + 1, dtype=torch.int32, device=X.device)
    sweeps, skip = _jacobi_args()
    with torch.cuda.device(X.device):
        kern(grid=(items * N, 1, 1), block=(NT, 1, 1),
             args=[X, out, table, int(rank), -1, omega, fill, table, -1, scratch, sweeps, _tol2(0, Q), skip,
                   phase_mode(items), table, scratch, CERT_TOL, scratch, gsave, sync],
             shared_mem=smem_bytes(K, Q))
    tr = gsave[:, K * K + K * Q + 1: K * K + K * Q + 1 + 4 * items].reshape(N, items, 4).cpu().clone()
    t0 = tr[..., :3].min()
    tr[..., :3] = (tr[..., :3] - t0) / 1e3
    return tr


def project_smem_bytes(K: int) -> int:
    """Dynamic shared memory of ``gdnviz_project``: U [K, 32], its 16 columns of S [K, 16], M [32, 16] (float64)."""
    return 8 * (K * MAX_RANK + K * PCOLS + MAX_RANK * PCOLS)


# GDNVIZ_PROFILE build: clock64() cycles of thread 0 per phase (summed over passes and calls), index 15 = Jacobi sweeps,
# index 16 = the checked Cholesky-QRs that found their block orthonormal already, 17 ... 19 = the Cholesky-QRs' cycles
# by part (Q^T Q and its check; warp 0's factorisation; the substitution), already counted in "cholqr" (nineteenth
# session).
# The Jacobi's time is jacobi + jacobi_rotations (thread 0 computing its pair's rotation) + jacobi_barriers (waiting
# at the round's barriers: two, one in the pair-block rounds) + jacobi_apply (its share of J^T A J and W J); jacobi alone keeps the per-sweep stop
# test (fifteenth session: where a round's ~2,300 cycles at r = 32 go was not known)
PHASES = ("gram_G", "sketch_Z", "cholqr", "gemm_GQ", "refill", "ritz_T", "jacobi", "select_U", "deflate_G", "load_U",
          "project", "certify", "jacobi_rotations", "jacobi_barriers", "jacobi_apply", "jacobi_sweeps",
          "cholqr_skipped",  # index 16: checked Cholesky-QRs that left their block as it was (a count)
          "cholqr_gram_check", "cholqr_factor", "cholqr_subst")  # 17 ... 19: cholqr's cycles by part (in "cholqr")


def phase_cycles(X: torch.Tensor, ranks, attempts: bool = False):
    """Per state, the cycles thread 0 spent in each phase of ``PHASES`` (float64 ``[N, 20]``, CPU; entries 15 and 16
    are counts, 17 … 19 split "cholqr"), from the kernels
    built with ``GDNVIZ_PROFILE`` (``bench/bench_truncate_phases.py``); the outputs are those of ``truncate_cuda``.
    ``attempts=False``: the full algorithm only. ``attempts=True``: the launches ``truncate_cuda`` makes for this
    (host-side) rank; returns (cycles, done) — a state with done = 1 holds its attempt's counters, the others the
    full algorithm's (an uncertified attempt returns before writing its counters)."""
    res = _launch(X, int(ranks), None, profile=True, attempts=attempts)
    cyc = res.scratch[:, 0, :len(PHASES)].cpu()
    return (cyc, res.done.cpu()) if attempts else cyc


def _jacobi_args() -> tuple[int, float]:
    """The Jacobi's sweep cap and rotation skip threshold (gdnviz.gpu.jacobi's)."""
    return _jacobi.MAX_SWEEPS, _jacobi._SKIP


def _tol2(mode: int, qb: int) -> float:
    """The Jacobi stop (squared relative off-diagonal norm) for a launch of ``mode`` with a ``qb``-column block:
    ``ATTEMPT_JACOBI_TOL`` for attempts, ``FULL_JACOBI_TOL`` for the full algorithm."""
    return ATTEMPT_JACOBI_TOL[qb] ** 2 if mode & ATTEMPT else FULL_JACOBI_TOL**2


def truncate_cuda(X: torch.Tensor, ranks, iters: int | None = None) -> torch.Tensor:
    """``U_r U_rᵀ S`` for every state of ``X`` (module docstring); RuntimeError if the kernel is unavailable."""
    return _launch(X, ranks, iters).out


class Launched(NamedTuple):
    """What one call left on the device: the output ``[N, K, V]``; the float64 scratch ``[N, K, 32]`` (U, or the
    profile counters); per state whether a certified attempt wrote it (int32 ``[N]``, 1 = yes) and its attempt's
    energy-error bound (float64 ``[N]``; ``NO_BOUND`` where none holds; both zero-length when no attempt ran)."""
    out: torch.Tensor
    scratch: torch.Tensor
    done: torch.Tensor
    bound: torch.Tensor


def _launch(X: torch.Tensor, ranks, iters: int | None, profile: bool = False, attempts: bool | None = None):
    """One call on ``X [N, K, V]``: the launches of ``plan`` (a ``Launched``)."""
    from gdnviz.gpu.fused_truncate import _constants

    if not supports(X):
        raise ValueError(f"truncate_cuda takes float32/float64 CUDA [N, K, V] with K, V in {DIMS}; got {X.dtype} "
                         f"{tuple(X.shape)} on {X.device}")
    N, K, V = X.shape
    device_ranks = isinstance(ranks, torch.Tensor)
    steps = plan(None if device_ranks else int(ranks), iters, attempts_on() if attempts is None else attempts, N,
                 _sm_count(X.device))
    split = not profile and split_on(N)
    kernels = {qb: _kernel(K, V, X.dtype, X.device, qb, profile) for qb, _ in steps}
    if split:
        gram = _kernel(K, V, X.dtype, X.device, Q, False, "gdnviz_gram")
        project = _kernel(K, V, X.dtype, X.device, Q, False, "gdnviz_project")
    if any(k is None for k in kernels.values()) or (split and (gram is None or project is None)):
        raise RuntimeError(f"the CUDA truncation kernel is unavailable: {KERNELS.reason}")
    X = X.contiguous()
    omega, fill, table = _constants(K, V, X.device)
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
    phased = phased_on(N, None if device_ranks else int(ranks), _sm_count(X.device), split, profile)
    if N:
        sweeps, skip = _jacobi_args()
        tables = _attempt_tables(X.device)
        with torch.cuda.device(X.device):
            G = torch.empty(N, K, K, dtype=torch.float64, device=X.device) if split else scratch
            if split:
                gram(grid=(N * gram_blocks(K), 1, 1), block=(NT, 1, 1), args=[X, G])
            for qb, mode in steps:
                tab = tables[qb] if mode & ATTEMPT else table
                items = phase_items() if phased and not mode & ATTEMPT else 1
                gsave = (torch.empty(N, gsave_cols(K), dtype=torch.float64, device=X.device) if items > 1
                         else scratch)
                sync = torch.zeros(N + 1, dtype=torch.int32, device=X.device) if items > 1 else table
                kernels[qb](grid=(items * N, 1, 1), block=(NT, 1, 1),
                            args=[X, out, rt, rank_int, stride, omega, fill, tab,
                                  -1 if iters is None else int(iters), scratch, sweeps, _tol2(mode, qb), skip,
                                  mode | (GRAM_IN | NO_PROJ if split else 0) | (phase_mode(items) if items > 1 else 0),
                                  done if n_att else table, bound if n_att else scratch, CERT_TOL, G, gsave, sync],
                            shared_mem=smem_bytes(K, qb))
            if split:
                project(grid=(N * (V // PCOLS), 1, 1), block=(NT, 1, 1), args=[X, out, rt, rank_int, stride, scratch],
                        shared_mem=project_smem_bytes(K))
    return Launched(out, scratch, done, bound)


_SMS: dict[str, int] = {}


def _sm_count(device: torch.device) -> int:
    key = str(device)
    if key not in _SMS:
        _SMS[key] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[key]


_TABLES: dict[str, dict[int, torch.Tensor]] = {}


def _attempt_tables(device: torch.device) -> dict[int, torch.Tensor]:
    """The attempts' step tables, int32 ``[33]`` per block width, cached per device (first call outside a graph)."""
    key = str(device)
    if key not in _TABLES:
        _TABLES[key] = {qb: torch.tensor(attempt_table(qb), dtype=torch.int32, device=device) for qb, _ in ATTEMPTS}
    return _TABLES[key]


def emulate(X: torch.Tensor, ranks, iters: int | None = None, attempts: bool | None = None, info: bool = False,
            concurrent: int = 4, dmma: bool = False, split: bool = False, counters: bool = False,
            phased: int = 0):
    """The same launches of the same kernel source run on the CPU through ``tests.support.cuda_emul`` (tests; needs
    ``g++``): ``X [N, K, V]`` float32/float64, ``ranks`` an int or N ints (run as device-side ranks: no attempts).
    ``concurrent`` blocks run at once, in lockstep by barrier phases, so a block writing into another block's part of
    the scratch buffer changes the answers here as it did on the H200 (eighth session). Returns the
    output, or with ``info`` (output, done int32 ``[N]``, bound float64 ``[N]``) as in ``Launched``. ``dmma``: the
    tensor-core build (``GDNVIZ_DMMA``, the GPU's default), its instructions emulated by warp collectives — several
    times slower, so the other tests run the fused multiply-add build. ``split``: the split launches (``split_on``:
    ``gdnviz_gram``, the algorithm with modes GRAM_IN | NO_PROJ, ``gdnviz_project``). ``counters``: the
    ``GDNVIZ_PROFILE`` build (not with ``split``), returning ``(output, counters float64 [N, 20])`` — its clock
    readings are 0 here, index 15 counts Jacobi sweeps, 16 skipped Cholesky-QRs (summed over passes and launches).
    ``phased`` (2 or 3): the full algorithm's launch as ``PHASED`` with that many thread blocks per state (tickets, the hand-over buffer and
    counters), whatever the rank and the number of states (not with ``split`` or ``counters``). Slow (~0.1–1 s per
    state and launch)."""
    from tests.support.cuda_emul import Emulated
    from gdnviz.gpu.fused_truncate import _constants

    N, K, V = X.shape
    ctype = _CTYPES[X.dtype]
    omega, fill, table = (t.cpu().numpy() for t in _constants(K, V, torch.device("cpu")))
    x = np.ascontiguousarray(X.detach().cpu().numpy())
    out = np.full_like(x, np.nan)
    if isinstance(ranks, int):
        rk, rank_int, stride = table.astype(np.int32), ranks, -1
    else:
        rk = np.ascontiguousarray(np.asarray([int(v) for v in ranks], dtype=np.int32))
        rank_int, stride = 0, 1
    steps = plan(rank_int if stride < 0 else None, iters, attempts_on() if attempts is None else attempts)
    scratch = np.empty((N, K, Q), dtype=np.float64)
    done = np.zeros(N, dtype=np.int32)
    bound = np.full(N, NO_BOUND)
    sweeps, skip = _jacobi_args()
    G = np.full((N, K, K), np.nan) if split else np.zeros(1)
    if split:
        emu = Emulated(source(K, V, ctype, Q, dmma), "gdnviz_gram", [s.format(T=ctype) for s in GRAM_SIGNATURE])
        emu.launch(N * gram_blocks(K), NT, [x, G], 0, concurrent=concurrent)
    if counters and split:
        raise ValueError("counters come from the fused kernel's profile build: not with split")
    if phased not in (0, 2, 3):
        raise ValueError("phased takes 0 (one block per state), 2 or 3 thread blocks per state")
    if phased and (split or counters):
        raise ValueError("phased launches run without split launches and without the profile build")
    prof = "#define GDNVIZ_PROFILE\n" if counters else ""
    count = np.zeros((N, len(PHASES)))
    for qb, mode in steps:
        if counters:
            scratch[:] = 0.0
        emu = Emulated(prof + source(K, V, ctype, qb, dmma), "gdnviz_truncate",
                       [s.format(T=ctype) for s in SIGNATURE])
        tab = np.asarray(attempt_table(qb), dtype=np.int32) if mode & ATTEMPT else table.astype(np.int32)
        items = int(phased) if phased and not mode & ATTEMPT else 1
        gsave = np.full((N, gsave_cols(K)), np.nan) if items > 1 else np.zeros(1)
        sync = np.zeros(N + 1, dtype=np.int32)
        emu.launch(items * N, NT,
                   [x, out, rk, rank_int, stride, np.ascontiguousarray(omega), np.ascontiguousarray(fill),
                    np.ascontiguousarray(tab), -1 if iters is None else int(iters), scratch, sweeps, _tol2(mode, qb),
                    skip, mode | (GRAM_IN | NO_PROJ if split else 0) | (phase_mode(items) if items > 1 else 0), done,
                    bound, CERT_TOL, G, gsave, sync], smem_bytes(K, qb), concurrent=concurrent)
        if counters:
            count += scratch[:, 0, :len(PHASES)]
    if split:
        emu = Emulated(source(K, V, ctype, Q, dmma), "gdnviz_project", [s.format(T=ctype) for s in PROJECT_SIGNATURE])
        emu.launch(N * (V // PCOLS), NT, [x, out, rk, rank_int, stride, scratch], project_smem_bytes(K),
                   concurrent=concurrent)
    res = torch.from_numpy(out)
    if counters:
        return res, torch.from_numpy(count)
    return (res, torch.from_numpy(done), torch.from_numpy(bound)) if info else res
