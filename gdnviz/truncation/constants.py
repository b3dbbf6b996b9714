"""The truncation algorithm's constants, fixed start matrices and iteration tables (a leaf: imports no gdnviz module).

One algorithm, two implementations that must agree: the float64 torch one (``gdnviz.truncation.reference``: the CPU
path and the CUDA fallback) and the CUDA kernel (``gdnviz.truncation.cuda``). Both read their numbers from here; the
kernel source (``cuda_truncate_src.cu``) repeats SHIFT / TINY / FILL / ORTH_TOL as ``#define``s, and a test checks
that they are these.
"""
from __future__ import annotations

import torch

MAX_RANK = 32  # largest rank the subspace algorithm truncates; above it (below min(K, V)) the exact eigh
DIMS = (64, 128)  # K and V the CUDA kernel takes
HALF = 16  # directions kept per pass: ranks > 16 take a second pass on the deflated state
BLOCK = 32  # block width q of a pass (oversampling ≥ 16)
MIN_K = 2 * BLOCK  # below this K the exact eigh of the K×K Gram matrix is as cheap as the subspace algorithm
CHOL_SHIFT = 1e-13  # relative diagonal shift of Cholesky-QR: C + s·diag(C)
TINY = 1e-300  # absolute diagonal floor: zero columns and zero states stay finite
FILL = 1e-6  # size of the refill of damped basis columns (relative to a unit column)
OMEGA_SEED = 12345  # pass p's Gaussian sketch Ω_p [V, 32]: seed OMEGA_SEED + p
FILL_SEED = 0x5EED  # pass p's refill directions [K, 32] (unit columns): seed FILL_SEED + p
# A checked Cholesky-QR (after the refill, and of the final U) leaves a block whose shifted Gram matrix is within
# ORTH_TOL of the identity in every entry as it is (factorising would move it by ~ORTH_TOL / 2): orthonormal to
# 32·ORTH_TOL in norm, an effect on a retained energy below 1e-10.
ORTH_TOL = 1e-12

# Filter steps (each: two powers of the trace-1 Gram matrix G, one Cholesky-QR) of the first pass, by the largest rank
# of the call: (largest rank, steps). Calibrated so that the worst energy error on the test batteries and toy-GDN
# states is ≤ 1e-6. The second pass (ranks 17 … 32) runs PASS2_ITERS: everything above the first 16 directions is
# gone from its Gram matrix, so its block spans directions 17 … 48 and needs fewer steps.
ITERS = ((2, 3), (8, 4), (12, 5), (16, 6))
PASS2_ITERS = 4

# The Jacobi eigensolver of the kernel's Rayleigh–Ritz step (cyclic parallel Jacobi): a sweep cap, the stop
# off(A) ≤ TOL·‖A‖_F, and the skip threshold |a_pq| ≤ SKIP·sqrt(|a_pp a_qq|) of a rotation.
JACOBI_MAX_SWEEPS = 24
JACOBI_TOL = 1e-15
JACOBI_SKIP = 2.0**-53
# The full algorithm's Jacobi stops at off(T') ≤ FULL_JACOBI_TOL·‖T'‖_F: it costs at most 4·tol of the energy per
# pass (Ky Fan: the block's best top-16 energy exceeds the top-16 diagonal by ≤ Σ σ_i(E) ≤ 4‖E‖_F, ‖T'‖_F ≤ 1).
FULL_JACOBI_TOL = 1e-8

# Certified attempts of the CUDA kernel (one host-side rank for every state): a narrower block and fewer steps first,
# the result certified on the device by the energy-error bound; uncertified states run the full algorithm in a
# second launch. (block width, ((largest rank, filter steps), ...)); a rank has at most one attempt.
ATTEMPTS = ((16, ((4, 2),)), (32, ((16, 2),)))
CONTRACT = 1e-5  # the contract: |retained energy − exact top-r energy| ≤ CONTRACT·‖S‖²_F for every state
CERT_TOL = 5e-6  # an attempt's answer stands when its energy-error bound is at most this (criterion 1e-5)
# An attempt's Jacobi stop, by block width: its certificate holds for any orthonormal basis, so a looser stop is
# paid for by a larger bound, never by a wrong answer (1e-6 at 32 columns left GDN-like states uncertified).
ATTEMPT_JACOBI_TOL = {16: 1e-6, 32: 1e-9}
NO_BOUND = 1e300  # the kernel's bound where none holds (not attempted, or no spectral gap)


def iterations_for(rank: int, pass_index: int = 0) -> int:
    """Filter steps of pass ``pass_index`` (0 or 1) for a largest rank ``rank`` ≤ 32 (pass 1: at most pass 0's)."""
    r = min(int(rank), HALF)
    k = next((k for upper, k in ITERS if r <= upper), ITERS[-1][1])
    return min(k, PASS2_ITERS) if pass_index else k


def pass_iterations(rank: int) -> tuple[int, int]:
    """``(pass 0, pass 1)`` filter steps for a largest rank ``rank`` ≤ 32 (the second unused for ranks ≤ 16)."""
    return iterations_for(rank, 0), iterations_for(rank, 1)


def attempt_table(qb: int) -> list[int]:
    """Filter steps per rank 0 … 32 of the attempt with a ``qb``-column block (−1: not attempted at that rank: above
    its ranks, or taken by a narrower block's attempt), then 33 × −1 (the layout of the full algorithm's table, pass
    p's steps at 33 p + r, whose second half an attempt never reads)."""
    out = []
    for r in range(MAX_RANK + 1):
        owner = next((w for w, steps in ATTEMPTS if any(1 <= r <= top for top, _ in steps)), None)
        k = next((n for top, n in dict(ATTEMPTS)[qb] if 1 <= r <= top), -1)
        out.append(k if owner == qb else -1)
    return out + [-1] * (MAX_RANK + 1)


_CACHE: dict[tuple, torch.Tensor] = {}


def gaussian(rows: int, cols: int, seed: int, device, unit_columns: bool = False) -> torch.Tensor:
    """A fixed float64 Gaussian ``[rows, cols]`` (seeded CPU generator), cached per device: the first call on a device
    copies it there, so make it outside a CUDA-graph capture."""
    key = (rows, cols, seed, unit_columns, str(device))
    t = _CACHE.get(key)
    if t is None:
        t = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        if unit_columns:
            t = t / t.norm(dim=0, keepdim=True)
        t = _CACHE[key] = t.to(device)
    return t


_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def start_matrices(K: int, V: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Ω ``[2, V, 32]``, refill directions ``[2, K, 32]`` (unit columns), int32 step table ``[66]``: pass p's steps
    for rank r at 33 p + r) on ``device``, contiguous, created once per (K, V, device) and cached."""
    key = (K, V, str(device))
    c = _TABLES.get(key)
    if c is None:
        cpu = torch.device("cpu")
        omega = torch.stack([gaussian(V, BLOCK, OMEGA_SEED + p, cpu) for p in range(2)])
        fill = torch.stack([gaussian(K, BLOCK, FILL_SEED + p, cpu, unit_columns=True) for p in range(2)])
        table = torch.tensor([iterations_for(max(r, 1), p) for p in range(2) for r in range(MAX_RANK + 1)],
                             dtype=torch.int32)
        c = _TABLES[key] = tuple(t.contiguous().to(device) for t in (omega, fill, table))
    return c
