"""Shifted Cholesky-QR of many tall blocks in one Triton launch (one program per block), for ``gdnviz.truncate``.

``cholqr(Z)`` for float64 ``Z [N, R, Q]`` (R ∈ {64, 128}, Q ∈ {16, 32, 64}) returns ``Z L⁻ᵀ`` with
``L Lᵀ = ZᵀZ + s·diag(ZᵀZ) + tiny·I`` (s = 1e-13, tiny = 1e-300) — exactly ``gdnviz.truncate._cholqr``'s
definition, computed by the in-program routine ``gdnviz.gpu.fused_truncate._cholqr`` (Gram by ``tl.dot`` in float64,
one loop over the Q columns forming column j of L and row j of L⁻¹, then ``Z L⁻ᵀ`` by ``tl.dot``).

Why: ``truncate._cholqr`` in torch is ~7 kernels (GEMM, two diagonal updates, ``cholesky_ex``, ``solve_triangular``,
GEMM) and a truncation of one boundary calls it ~8–10 times; on an H200 every kernel of that path costs ~10 µs even
replayed from a CUDA graph, so the Cholesky-QRs are about half of a truncation's ~0.8 ms (16 states) / ~1.3 ms
(288 states) (bench/RESULTS.md, fourth session). One launch per Cholesky-QR removes ~6 kernels each.

Status: **off by default** until measured on the GPU (``GDNVIZ_TRITON_CHOLQR=1`` turns it on for
``truncate._cholqr`` on CUDA; ``bench/bench_truncate.py --triton-cholqr`` times it). The in-program routine is
latency-bound by its Q sequential steps, and the fused kernel built from the same routines turned out slower than
the torch path (RESULTS.md), so only a measurement can say whether this one wins. Accuracy: pinned to the torch
definition in the Triton interpreter (tests/test_cholqr.py).
"""
from __future__ import annotations

import os
from contextlib import nullcontext

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None

SHAPES_R = (64, 128)
SHAPES_Q = (16, 32, 64)

if triton is not None:
    from gdnviz.gpu.fused_truncate import _cholqr as _cholqr_block

    @triton.jit
    def _cholqr_kernel(Z, OUT, R: tl.constexpr, Q: tl.constexpr, SHIFT: tl.constexpr, TINY: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        rr = tl.arange(0, R)
        qq = tl.arange(0, Q)
        offs = pid * R * Q + rr[:, None] * Q + qq[None, :]
        z = tl.load(Z + offs)
        tl.store(OUT + offs, _cholqr_block(z, Q, SHIFT, TINY))


def enabled() -> bool:
    """Whether ``gdnviz.truncate._cholqr`` uses this kernel on CUDA (``GDNVIZ_TRITON_CHOLQR=1``; off by default)."""
    return triton is not None and os.environ.get("GDNVIZ_TRITON_CHOLQR", "0") == "1"


def supports(Z: torch.Tensor) -> bool:
    """Shapes and dtype the kernel takes: float64 ``[N, R, Q]`` with R in SHAPES_R and Q in SHAPES_Q."""
    return (triton is not None and Z.dim() == 3 and Z.dtype == torch.float64 and Z.shape[1] in SHAPES_R
            and Z.shape[2] in SHAPES_Q)


def cholqr(Z: torch.Tensor, shift: float = 1e-13, tiny: float = 1e-300) -> torch.Tensor:
    """``Z L⁻ᵀ`` (see the module docstring) for float64 ``Z [N, R, Q]``; CUDA, or CPU under ``TRITON_INTERPRET=1``."""
    if not supports(Z):
        raise ValueError(f"cholqr takes float64 [N, R, Q] with R in {SHAPES_R}, Q in {SHAPES_Q}; got "
                         f"{Z.dtype} {tuple(Z.shape)}")
    N, R, Q = Z.shape
    Z = Z.contiguous()
    out = torch.empty_like(Z)
    if N:
        with torch.cuda.device(Z.device) if Z.is_cuda else nullcontext():
            _cholqr_kernel[(N,)](Z, out, R=R, Q=Q, SHIFT=shift, TINY=tiny, num_warps=4)
    return out
