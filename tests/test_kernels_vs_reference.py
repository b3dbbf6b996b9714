"""Production GDN kernels against the float64 reference (gdnviz.gdn.reference).

* CPU: transformers' pure-torch kernels (``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``
  of ``modeling_qwen3_5``), called through ``__wrapped__``: with fla importable the decorated functions dispatch
  to fla's Triton kernels, which cannot run on CPU tensors.
* GPU (``-m gpu``, skipped without CUDA): fla's ``chunk_gated_delta_rule`` and ``fused_recurrent_gated_delta_rule``.

Both take batch-first raw inputs ``q, k [B, T, Hk, K]``, ``v [B, T, Hv, V]``, ``g, beta [B, T, Hv]``, a state
``[B, Hv, K, V]`` (fla: ``[B, Hv, V, K]`` with ``state_v_first=True``), L2-normalise q and k themselves with
``use_qk_l2norm_in_kernel=True`` (``x * rsqrt(sum(x²) + 1e-6)``) and scale q by ``K**-0.5``; the reference gets
``l2_normalise(q) * K**-0.5`` and ``l2_normalise(k)`` computed in float64 from the very same input values, key
heads repeated to value heads with ``repeat_interleave`` (key head j serves value heads j·r … (j+1)·r − 1).

Errors are relative, per (sequence, value head): ``‖x − ref‖ / ‖ref‖`` over tokens × V for outputs and over
K × V for final states; the test takes the worst head.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from gdnviz.gdn import reference as ref


pytestmark = pytest.mark.usefixtures("one_thread")


def make_inputs(B, T, Hk, Hv, K, V, seed, device="cpu", dtype=torch.float32):
    """Raw (un-normalised) kernel inputs with Qwen3.5-style gates and a nonzero initial state.

    ``g = -A · softplus(a + 1)`` with per-head ``A`` spread log-uniformly over [1e-3, 16] (as ``A_log``'s init
    range, extended down): from long memory (α ≈ 0.999, ~10³ tokens) to near-reset heads (α ≈ e⁻²⁰).
    ``beta = sigmoid(b)``. q, k, v, beta in ``dtype``; g and the state in fp32, as transformers passes them.
    """
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hk, K, generator=gen)
    k = torch.randn(B, T, Hk, K, generator=gen)
    v = torch.randn(B, T, Hv, V, generator=gen)
    A = torch.logspace(-3, torch.log10(torch.tensor(16.0)).item(), Hv)
    g = -A * F.softplus(torch.randn(B, T, Hv, generator=gen) + 1.0)
    beta = torch.sigmoid(torch.randn(B, T, Hv, generator=gen))
    S0 = torch.randn(B, Hv, K, V, generator=gen)
    q, k, v, beta = (x.to(device=device, dtype=dtype) for x in (q, k, v, beta))
    return q, k, v, g.to(device), beta, S0.to(device)


def reference(q, k, v, g, beta, S0, gva_repeat="interleave"):
    """Float64 reference on the same input values: returns ``(out [B, T, Hv, V], final [B, Hv, K, V])``."""
    B, T, Hk, K = q.shape
    Hv = v.shape[2]
    qh = ref.l2_normalise(q.double()) * K**-0.5
    kh = ref.l2_normalise(k.double())
    if Hv != Hk:
        r = Hv // Hk
        if gva_repeat == "interleave":       # what the kernels do
            qh, kh = qh.repeat_interleave(r, dim=2), kh.repeat_interleave(r, dim=2)
        else:                                # the wrong grouping, for the negative check
            qh, kh = qh.repeat(1, 1, r, 1), kh.repeat(1, 1, r, 1)
    outs, finals = zip(*(ref.recurrent(qh[b], kh[b], v[b], g[b], beta[b], S0[b]) for b in range(B)))
    return torch.stack(outs), torch.stack(finals)


def rel_err_out(x, r):
    """Worst (sequence, head) relative error of outputs ``[B, T, H, V]``."""
    return ((x.double() - r).norm(dim=(1, 3)) / r.norm(dim=(1, 3))).max().item()


def rel_err_state(x, r):
    """Worst (sequence, head) relative error of states ``[B, H, K, V]``."""
    return ((x.double() - r).norm(dim=(2, 3)) / r.norm(dim=(2, 3))).max().item()


# ================================================================================================
# CPU: transformers' torch kernels (fp32)
# ================================================================================================
# Tolerance. Both torch kernels compute in fp32 (unit roundoff u = 6e-8). Measured worst-head relative errors
# at T = 1000, K = V = 32 (this file's inputs, three seeds each, torch 2.13 CPU, transformers 5.23): recurrent
# 1.4–3.3e-7 on outputs and states; chunk 2.4e-7–1.6e-6 on outputs and up to 2.6e-6 on the final state (the
# chunk form solves a 64×64 triangular system and sums 64-term products per chunk, and its state error grows
# with the chunk count; up to 3.6e-6 seen with other gates). 2e-5 is ~5–8× the worst seen and still 5× below
# the 1e-4 budget; any real mistake (gate order, decay, mask, head grouping) is O(1e-1–1).
TORCH_FP32_RTOL = 2e-5

_CASES = {
    # name: (B, T, Hk, Hv, K, V)
    "T1000": (2, 1000, 4, 4, 32, 32),      # 15 full chunks of 64 + a tail of 40
    "T1024": (1, 1024, 4, 4, 32, 32),      # whole chunks only
    "T77": (2, 77, 4, 4, 32, 32),          # one chunk + a tail of 13
    "T1": (2, 1, 4, 4, 32, 32),            # a single token (decode step)
    "gva_T1000": (2, 1000, 2, 4, 32, 32),  # 2 key heads serve 4 value heads
}


@functools.lru_cache(maxsize=None)
def _cpu_case(name):
    B, T, Hk, Hv, K, V = _CASES[name]
    x = make_inputs(B, T, Hk, Hv, K, V, seed=sum(map(ord, name)))
    return x, reference(*x)


def _torch_kernels():
    import inspect

    mod = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    # inspect.unwrap follows __wrapped__ to the torch body, through gdnviz's dispatcher too (other tests load
    # models, which installs gdnviz's dispatcher over these module globals).
    return {
        "chunk": inspect.unwrap(mod.torch_chunk_gated_delta_rule),
        "recurrent": inspect.unwrap(mod.torch_recurrent_gated_delta_rule),
    }


def _transformers_repeats_keys_in_kernel():
    import transformers
    from packaging.version import Version

    # 5.23 moved the key-head → value-head repeat from the layer into the kernel functions
    return Version(transformers.__version__).release >= (5, 23)


@pytest.mark.parametrize("kernel", ["chunk", "recurrent"])
@pytest.mark.parametrize("case", list(_CASES))
def test_transformers_torch_kernel_matches_reference(case, kernel):
    if case.startswith("gva") and not _transformers_repeats_keys_in_kernel():
        pytest.skip("transformers < 5.23 repeats key heads in the layer, not in the kernel")
    fn = _torch_kernels()[kernel]
    (q, k, v, g, beta, S0), (ref_out, ref_fin) = _cpu_case(case)
    S0_before = S0.clone()
    out, fin = fn(q, k, v, g, beta, initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert torch.equal(S0, S0_before), "the kernel wrote into initial_state"
    assert out.shape == ref_out.shape and out.dtype == torch.float32
    assert fin.shape == ref_fin.shape and fin.dtype == torch.float32
    e_out, e_fin = rel_err_out(out, ref_out), rel_err_state(fin, ref_fin)
    assert e_out <= TORCH_FP32_RTOL, f"{kernel} {case}: output rel err {e_out:.2e}"
    assert e_fin <= TORCH_FP32_RTOL, f"{kernel} {case}: state rel err {e_fin:.2e}"


def test_gva_grouping_is_observable():
    """The GVA comparison can fail: grouping key heads by ``repeat`` (tiling) instead of ``repeat_interleave``
    is far off the kernel."""
    if not _transformers_repeats_keys_in_kernel():
        pytest.skip("transformers < 5.23 repeats key heads in the layer, not in the kernel")
    fn = _torch_kernels()["recurrent"]
    B, T, Hk, Hv, K, V = 1, 50, 2, 4, 8, 8
    x = make_inputs(B, T, Hk, Hv, K, V, seed=5)
    out, _ = fn(*x[:5], initial_state=x[5], output_final_state=True, use_qk_l2norm_in_kernel=True)
    good, _ = reference(*x)
    bad, _ = reference(*x, gva_repeat="tile")
    assert rel_err_out(out, good) <= TORCH_FP32_RTOL
    assert rel_err_out(out, bad) > 1e-1


# ================================================================================================
# GPU: fla's Triton kernels (fp32 and bf16 inputs, both state layouts)
# ================================================================================================
# Tolerances (output, final state): worst (sequence, head) relative error at T = 4096, K = V = 128, this file's
# inputs, measured on an H200 (fla 0.6.0, triton 3.6.0, torch 2.11+cu130), identical for both state layouts:
#   recurrent fp32  out 1.2e-6  state 1.1e-6   fp32 arithmetic, no matrix units, q/k normalised in fp32
#   recurrent bf16  out 1.7e-3  state 1.1e-6   the same, plus bf16 rounding of the output (2⁻⁹ relative)
#   chunk     fp32  out 1.5e-3  state 1.1e-3   tl.dot runs in TF32 on Hopper (10-bit mantissa)
#   chunk     bf16  out 5.0e-3  state 4.2e-3   normalised q/k and the w/u/A intermediates stored in bf16
# bf16 runs are compared with a reference on the same bf16 input values, so input quantisation is not counted.
# Each tolerance is ~3–10× the measurement; a real mistake (gate order, decay, mask, layout) is O(1e-1–1).
FLA_RTOL = {
    ("recurrent", torch.float32): (1e-5, 1e-5),
    ("recurrent", torch.bfloat16): (5e-3, 1e-5),
    ("chunk", torch.float32): (5e-3, 5e-3),
    ("chunk", torch.bfloat16): (1.5e-2, 1.5e-2),
}
_FLA_SHAPE = (2, 4096, 4, 4, 128, 128)  # B, T, Hk, Hv, K, V


@functools.lru_cache(maxsize=None)
def _gpu_case(dtype):
    x = make_inputs(*_FLA_SHAPE, seed=4096, device="cuda", dtype=dtype)
    return x, reference(*x)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("state_v_first", [False, True], ids=["state_KV", "state_VK"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kernel", ["chunk", "recurrent"])
def test_fla_kernel_matches_reference(kernel, dtype, state_v_first):
    gdr = pytest.importorskip("fla.ops.gated_delta_rule")
    fn = {"chunk": gdr.chunk_gated_delta_rule, "recurrent": gdr.fused_recurrent_gated_delta_rule}[kernel]
    (q, k, v, g, beta, S0), (ref_out, ref_fin) = _gpu_case(dtype)
    h0 = S0.transpose(-1, -2).contiguous() if state_v_first else S0            # [B, H, V, K] when v-first
    h0_before = h0.clone()
    out, fin = fn(
        q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
        use_qk_l2norm_in_kernel=True, state_v_first=state_v_first,
    )
    torch.cuda.synchronize()
    assert torch.equal(h0, h0_before), "the kernel wrote into initial_state"
    assert out.shape == ref_out.shape and out.dtype == dtype
    if state_v_first:
        assert fin.shape == (ref_fin.shape[0], ref_fin.shape[1], ref_fin.shape[3], ref_fin.shape[2])
        fin = fin.transpose(-1, -2)
    assert fin.shape == ref_fin.shape and fin.dtype == torch.float32
    e_out, e_fin = rel_err_out(out, ref_out), rel_err_state(fin, ref_fin)
    print(f"fla {kernel} {dtype} state_v_first={state_v_first}: out {e_out:.2e} state {e_fin:.2e}")
    tol_out, tol_fin = FLA_RTOL[(kernel, dtype)]
    assert e_out <= tol_out, f"fla {kernel} {dtype}: output rel err {e_out:.2e} > {tol_out:.0e}"
    assert e_fin <= tol_fin, f"fla {kernel} {dtype}: state rel err {e_fin:.2e} > {tol_fin:.0e}"
