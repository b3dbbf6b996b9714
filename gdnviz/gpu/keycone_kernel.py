"""The key cone's four sums over tokens in one Triton kernel: what ``gdnviz.analysis.keycone.keycone_sums`` needs,
read once from the keys as the model made them (bfloat16 / float16 / float32, any strides), in float64.

For unit keys ``k [T, H, K]``, amplitudes ``amp [H, T]`` float64 (``√w_t`` of the decayed covariance) and each
head's window start ``start [H]`` (token ``t`` is in head ``h``'s window iff ``t ≥ start[h]``), per head ``h``:

==========  ============  ==============================================
``s``       ``[H, K]``    ``Σ_t k_t``
``sw``      ``[H, K]``    ``Σ_{t ≥ start_h} k_t``
``Gw``      ``[H, K, K]`` ``Σ_{t ≥ start_h} k_t k_tᵀ``
``P``       ``[H, K, K]`` ``Σ_t (amp_{h,t} k_t)(amp_{h,t} k_t)ᵀ``
==========  ============  ==============================================

all float64. Every key is converted to float64 before it is multiplied (exact for bfloat16 / float16 / float32), so
the sums are the float64 reference's (``keycone_sums`` on the CPU) up to the order of summation; tests pin them to
it (1e-12 relative).

Why a kernel: the torch form on CUDA makes a float64 head-major copy of all keys (268 MB per layer at 16K tokens ×
16 heads × 128), a masked copy of it for the window, two reductions, an in-place scaling and two split-K GEMMs over
all ``T`` tokens — ~10 passes over 268 MB per layer — and the window's GEMM runs over every token although a
window is usually a few hundred tokens (its rows outside are exact zeros). Here each program reads its tokens' keys
once from the input, and the window's products are skipped for token blocks wholly before the window (a runtime
branch per block; a window of all ``T`` tokens costs one more GEMM, as before).

Layout: grid ``(H, SPLIT, NT·NT)``. The ``K × K`` outputs are cut into ``BK × BK`` tiles (``NT = ⌈K / BK⌉`` per
side); a program with tile ``(i, j)``, ``i ≤ j``, accumulates that tile of ``P`` and ``Gw`` over its token range
(``T`` cut into ``SPLIT`` contiguous ranges of whole ``BT``-token blocks, ~4 programs per SM) with float64 ``tl.dot``
(the H200's float64 tensor cores; ``input_precision="ieee"``), writes it and, for ``i < j``, its transpose (the
matrices are symmetric), so programs with ``i > j`` do nothing. Diagonal tiles also write their columns of ``s`` and
``sw``. Partial sums go to ``[H, SPLIT, ...]`` buffers that torch sums over ``SPLIT`` (deterministic: no atomics).
The window mask is ``tl.where`` (exact zeros: a NaN key before a head's window stays out of its window sums, as in
the torch form); a NaN key anywhere makes ``s`` and ``P`` NaN, as there. ``(BK, BT, warps)`` = (64, 32, 8) unless
``GDNVIZ_KEYCONE_KERNEL_CFG`` says otherwise (:func:`config`).

Inputs: a capture hands float32 keys (``on_layer_input``), read as they are. Triton 3.6 cannot feed a float64
``tl.dot`` from 16-bit loads (it gives the operand the 16-bit layout's wide K and fails to lower: "Currently fp64
don't support largeK MMA"; nor through ``tl.interleave``), so bfloat16 keys are read as int32 words of two keys and
widened by a shift or a mask (exact, :func:`_operand`); float16 keys are copied to float32 first.

Measured on the H200 (fourteenth session, ``bench/RESULTS.md``): 1.05 ms per layer of 16K float32 keys against the
torch form's 1.40 alone (the float64 MMA reaches only ~8 TFLOP/s here), but a pipelined 16K capture was 4–5%
slower with it (paired timings on two machines), so ``keycone.CUDA_KERNEL`` leaves it off; ``GDNVIZ_KEYCONE_KERNEL=1``
turns it on.

CPU: runs under the Triton interpreter only (``TRITON_INTERPRET=1``, tests); the library's CPU path is the torch form.
"""
from __future__ import annotations

import math
import os

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None

__all__ = ["keycone_sums_kernel", "available", "config", "BT", "BK"]

BT = 32  # tokens per block of the loop (the K of each float64 MMA chain)
BK = 64  # output tile side (K = 128: tiles (0, 0), (0, 1), (1, 1); the fourth program returns)
# 8 warps: 208 registers (bfloat16 keys) / 255 and 72 bytes of stack (float32 keys) per thread (ptxas, sm_90a);
# 4 warps spill 328 / 784 bytes
_NUM_WARPS = 8
# Read once at import, like Triton itself.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available(keys: torch.Tensor) -> bool:
    """Whether :func:`keycone_sums_kernel` can run on ``keys``' device: CUDA with Triton, or the CPU under
    ``TRITON_INTERPRET=1`` (tests)."""
    return triton is not None and (keys.is_cuda or (_INTERPRET and keys.device.type == "cpu"))


if triton is not None:

    @triton.jit
    def _widen_pairs(base, rows, c, mt, K: tl.constexpr):
        """bfloat16 keys of columns ``c`` and rows ``rows`` (word offsets) as float64 ``[BT, len(c)]``, read as the
        int32 words at ``base`` (an int32 pointer) that hold two keys each, the even column in the low half
        (little-endian). A bfloat16 is the upper half of a float32: each key is shifted into place (even columns)
        or masked (odd) and reinterpreted, which is exact. Each word is loaded for both of its columns (cached):
        ``tl.interleave`` of the two halves would not lower into a float64 ``tl.dot`` either (Triton 3.6)."""
        x = tl.load(base + rows + (c // 2)[None, :], mask=mt[:, None] & (c < K)[None, :], other=0)
        bits = tl.where((c % 2 == 0)[None, :], x << 16, x & -65536)  # -65536 = 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(tl.float64)

    @triton.jit
    def _keycone_kernel(KEYS, stride_t, stride_h, stride_k, AMP, amp_stride_h, amp_stride_t, START,
                        S_OUT, SW_OUT, GW_OUT, P_OUT, T, per_split, SPLIT,
                        K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, NT: tl.constexpr,
                        PAIRS: tl.constexpr):
        h = tl.program_id(0)
        sp = tl.program_id(1)
        tile = tl.program_id(2)
        ti = tile // NT
        tj = tile % NT
        if ti <= tj:
            ci = ti * BK + tl.arange(0, BK)
            cj = tj * BK + tl.arange(0, BK)
            mi = ci < K
            mj = cj < K
            start = tl.load(START + h)  # int64: first token of the window
            lo = sp * per_split  # whole BT blocks: only the last range reaches past T
            base = KEYS + h.to(tl.int64) * stride_h
            abase = AMP + h.to(tl.int64) * amp_stride_h
            accP = tl.zeros((BK, BK), dtype=tl.float64)
            accG = tl.zeros((BK, BK), dtype=tl.float64)
            s = tl.zeros((BK,), dtype=tl.float64)
            sw = tl.zeros((BK,), dtype=tl.float64)
            t0 = lo
            while t0 < lo + per_split:  # a while loop: runtime trip counts work the same compiled and interpreted
                t = t0 + tl.arange(0, BT)
                mt = t < T
                rows = t.to(tl.int64)[:, None] * stride_t
                if PAIRS:  # bfloat16 keys read as int32 words of two, widened by hand (module docstring)
                    ki = _widen_pairs(base, rows, ci, mt, K)
                    kj = _widen_pairs(base, rows, cj, mt, K)
                else:
                    ki = tl.load(base + rows + ci[None, :] * stride_k, mask=mt[:, None] & mi[None, :], other=0.0)
                    kj = tl.load(base + rows + cj[None, :] * stride_k, mask=mt[:, None] & mj[None, :], other=0.0)
                    ki = ki.to(tl.float64)
                    kj = kj.to(tl.float64)
                a = tl.load(abase + t.to(tl.int64) * amp_stride_t, mask=mt, other=0.0)
                yi = ki * a[:, None]
                yj = kj * a[:, None]
                accP += tl.dot(tl.trans(yi), yj, input_precision="ieee")
                s += tl.sum(ki, 0)
                if t0 + BT > start:  # the block reaches into the window
                    inw = mt & (t >= start)
                    kim = tl.where(inw[:, None], ki, 0.0)
                    kjm = tl.where(inw[:, None], kj, 0.0)
                    accG += tl.dot(tl.trans(kim), kjm, input_precision="ieee")
                    sw += tl.sum(kim, 0)
                t0 += BT
            out = (h.to(tl.int64) * SPLIT + sp) * K * K
            m2 = mi[:, None] & mj[None, :]
            here = ci[:, None] * K + cj[None, :]
            tl.store(P_OUT + out + here, accP, mask=m2)
            tl.store(GW_OUT + out + here, accG, mask=m2)
            if ti < tj:  # the mirror tile: element (a, b) of this tile is (b, a) there
                there = cj[None, :] * K + ci[:, None]
                tl.store(P_OUT + out + there, accP, mask=m2)
                tl.store(GW_OUT + out + there, accG, mask=m2)
            else:
                vec = (h.to(tl.int64) * SPLIT + sp) * K + ci
                tl.store(S_OUT + vec, s, mask=mi)
                tl.store(SW_OUT + vec, sw, mask=mi)


def config() -> tuple[int, int, int]:
    """``(BK, BT, num_warps)``: the module's, or ``GDNVIZ_KEYCONE_KERNEL_CFG="BK,BT,WARPS"`` (read at each call, so
    a benchmark can time several in one process; BK and BT powers of two ≥ 16)."""
    env = os.environ.get("GDNVIZ_KEYCONE_KERNEL_CFG", "").strip()
    if not env:
        return BK, BT, _NUM_WARPS
    bk, bt, nw = (int(x) for x in env.split(","))
    if any(v < 16 or v & (v - 1) for v in (bk, bt)):
        raise ValueError(f"GDNVIZ_KEYCONE_KERNEL_CFG: BK and BT must be powers of two >= 16; got {env!r}")
    return bk, bt, nw


def _split(T: int, H: int, NT: int, device: torch.device, BT: int) -> tuple[int, int]:
    """``(SPLIT, per_split)``: token ranges of whole ``BT`` blocks, enough programs for ~4 per SM (CUDA; 2 ranges
    on the CPU interpreter)."""
    tiles = NT * (NT + 1) // 2
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        want = max(1, math.ceil(4 * sms / (H * tiles)))
    else:
        want = 2
    blocks = math.ceil(T / BT)
    per_split = math.ceil(blocks / min(want, blocks)) * BT
    return math.ceil(T / per_split), per_split


def keycone_sums_kernel(keys: torch.Tensor, amp: torch.Tensor, start: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(s [H, K], sw [H, K], Gw [H, K, K], P [H, K, K])`` float64 (module docstring) for ``keys [T, H, K]``
    (float16 / bfloat16 / float32 / float64, any strides), ``amp [H, T]`` float64 (any strides) and ``start [H]``
    (integral values, any numeric dtype; ``≤ 0``: every token in the window, ``≥ T``: none). No host
    synchronisation: one launch, then torch's sums over the token ranges."""
    if keys.dim() != 3:
        raise ValueError(f"keys must be [T, H, K]; got {tuple(keys.shape)}")
    T, H, K = keys.shape
    if tuple(amp.shape) != (H, T):
        raise ValueError(f"amp must be [H={H}, T={T}]; got {tuple(amp.shape)}")
    if not available(keys):
        raise RuntimeError("the key-cone kernel needs CUDA (or TRITON_INTERPRET=1 on the CPU)")
    dev = keys.device
    amp = amp.to(dev, torch.float64)
    start = start.to(dev).to(torch.int64).contiguous()
    bk, bt, nw = config()
    NT = math.ceil(K / bk)
    SPLIT, per_split = _split(T, H, NT, dev, bt)
    f64 = dict(dtype=torch.float64, device=dev)
    Sp, SWp = torch.empty(H, SPLIT, K, **f64), torch.empty(H, SPLIT, K, **f64)
    Gp, Pp = torch.empty(H, SPLIT, K, K, **f64), torch.empty(H, SPLIT, K, K, **f64)
    src, pairs = _operand(keys)
    _keycone_kernel[(H, SPLIT, NT * NT)](
        src, src.stride(0), src.stride(1), src.stride(2), amp, amp.stride(0), amp.stride(1), start,
        Sp, SWp, Gp, Pp, T, per_split, SPLIT, K=K, BK=bk, BT=bt, NT=NT, PAIRS=pairs, num_warps=nw)
    return Sp.sum(1), SWp.sum(1), Gp.sum(1), Pp.sum(1)


def _operand(keys: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """What the kernel reads for ``keys``, and whether as int32 words of two bfloat16 keys (``PAIRS``).

    Triton 3.6 cannot feed a float64 ``tl.dot`` from 16-bit loads: it gives the operand the 16-bit layout's wide K
    and fails to lower (``Currently fp64 don't support largeK MMA``). bfloat16 keys with a contiguous last axis of
    even length and even strides are read as int32 words (a view, no copy) and widened by a shift or a mask
    (exact); other 16-bit keys (float16, odd strides) are copied to float32 first (exact), one pass over the keys.
    float32 and float64 keys are read as they are."""
    if keys.dtype not in (torch.float16, torch.bfloat16):
        return keys, False
    K = keys.shape[-1]
    if (keys.dtype == torch.bfloat16 and keys.stride(-1) == 1 and K % 2 == 0 and keys.stride(0) % 2 == 0
            and keys.stride(1) % 2 == 0 and keys.storage_offset() % 2 == 0):
        return keys.view(torch.int32), True
    return keys.float(), False
