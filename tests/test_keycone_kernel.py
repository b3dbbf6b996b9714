"""The key cone's Triton kernel (gdnviz.gpu.keycone_kernel) against the float64 torch sums of
gdnviz.analysis.keycone (its CPU path, itself pinned to the reference functions in tests/test_analysis.py).

* CPU, Triton interpreter (``TRITON_INTERPRET=1`` in a subprocess: read before triton is imported): the four sums for
  float64 / float32 / bfloat16 (read as int32 pairs, a view) / float16 (copied) keys, strided views, K = 8, 100 and
  128, windows before, inside and past the keys, a block size that does not divide T, another tile configuration,
  NaN keys outside (exact zeros) and inside a window; ``keycone_sums(kernel=True)`` = ``kernel=False``.
* CPU, offline compile for sm_90a (Triton needs no GPU to compile): both input forms lower, with float64 MMA, no TF32.
* CUDA (``@pytest.mark.gpu``): ``keycone_sums`` on the GPU through the kernel and through the torch form (the
  default) = the CPU's float64 sums, float32 and bfloat16 keys.

The switch ``GDNVIZ_KEYCONE_KERNEL`` is tested with the other key-cone switch in tests/test_analysis.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = textwrap.dedent('''
    import json, os, sys
    sys.path.insert(0, os.environ["ROOT"])
    import torch
    torch.set_num_threads(1)
    from gdnviz.analysis import keycone
    from gdnviz.gpu import keycone_kernel as kk
    assert kk.available(torch.zeros(1, 1, 16)), "the interpreter is not on"
    F64 = torch.float64

    def reference(x, amp, start):
        """The four sums in float64 by einsum (window = t >= start[h], rows outside replaced by exact zeros)."""
        T = x.shape[0]
        xf = x.to(F64)
        inw = torch.arange(T)[:, None] >= start[None, :].to(F64)  # [T, H]
        xm = torch.where(inw[..., None], xf, torch.zeros((), dtype=F64))
        y = xf * amp.T[..., None]
        return (xf.sum(0), xm.sum(0), torch.einsum("thi,thj->hij", xm, xm), torch.einsum("thi,thj->hij", y, y))

    def rel(a, b):
        """max |a - b| / max |b| (NaN where the NaN patterns differ)."""
        if not torch.equal(torch.isnan(a), torch.isnan(b)):
            return float("nan")
        ok = ~torch.isnan(b)
        return float((a[ok] - b[ok]).abs().max() / b[ok].abs().max().clamp_min(1e-300)) if ok.any() else 0.0
''')


def _interpret(code: str, **env) -> dict:
    """Run ``code`` (after PRELUDE) under TRITON_INTERPRET=1; it prints one JSON line last."""
    env = dict(os.environ, TRITON_INTERPRET="1", ROOT=ROOT, OMP_NUM_THREADS="1", **env)
    out = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


CASES = '''
    torch.manual_seed(0)
    cases = {}

    def unit(*shape):
        x = torch.randn(*shape, dtype=F64)
        return x / x.norm(dim=-1, keepdim=True)

    def run(name, x, g, start):
        amp = torch.exp(keycone._suffix_log_decay(g.to(F64))).T
        got = kk.keycone_sums_kernel(x, amp, start)
        ref = reference(x, amp, start)
        cases[name] = dict(err=[rel(a, b) for a, b in zip(got, ref)], pairs=kk._operand(x)[1],
                           shapes_ok=all(a.shape == b.shape and a.dtype == F64 for a, b in zip(got, ref)))

    g = lambda T, H: torch.log(torch.rand(T, H, dtype=F64) * 0.2 + 0.8)
    # windows: one token short of T, mid-block (not a multiple of BT), all tokens (start < 0), none (start >= T)
    run("f64_K8", unit(300, 4, 8), g(300, 4), torch.tensor([299.0, 137.0, -5.0, 300.0]))
    run("f32_K128", unit(130, 3, 128).float(), g(130, 3), torch.tensor([100.0, 0.0, 65.0]))
    big = unit(77, 6, 102)
    run("bf16_strided_pairs", big.to(torch.bfloat16)[:, ::2, :100], g(77, 3), torch.tensor([10.0, 76.0, 33.0]))
    run("bf16_odd_stride_copy", unit(77, 3, 101).to(torch.bfloat16)[:, :, :100], g(77, 3),
        torch.tensor([10.0, 76.0, 33.0]))
    run("f16", unit(50, 2, 16).half(), g(50, 2), torch.tensor([3.0, 40.0]))
    # NaN keys: before head 0's window (in the block the window starts in, and in an earlier block): out of the
    # window sums (s and P are NaN, as in the torch form); inside head 1's window: NaN window sums
    x = unit(100, 2, 16)
    x[5, 0], x[60, 0], x[90, 1] = float("nan"), float("nan"), float("nan")
    run("nan_keys", x, g(100, 2), torch.tensor([70.0, 80.0]))
    amp = torch.exp(keycone._suffix_log_decay(g(100, 2))).T
    s, sw, Gw, P = kk.keycone_sums_kernel(x, amp, torch.tensor([70.0, 80.0]))
    cases["nan_pattern"] = dict(window0_finite=bool(torch.isfinite(Gw[0]).all() and torch.isfinite(sw[0]).all()),
                                window1_nan=bool(torch.isnan(Gw[1]).any()), s_nan=bool(torch.isnan(s).any(-1).all()),
                                P_nan=bool(torch.isnan(P).any()))
    # keycone_sums with the kernel = without it (horizons, windows, C, P, mean key norm)
    k, gg = unit(400, 4, 32), g(400, 4)
    gg[:, 2] = 0.0  # horizon inf: the window is every token
    a, b = keycone.keycone_sums(k, gg, kernel=True), keycone.keycone_sums(k, gg, kernel=False)
    cases["keycone_sums"] = dict(err=[rel(a[n], b[n]) for n in ("C", "P", "mean_key_norm", "horizon")])
    print(json.dumps(cases))
'''


@pytest.fixture(scope="module")
def interpreted():
    return _interpret(CASES)


@pytest.mark.parametrize("name", ["f64_K8", "f32_K128", "bf16_strided_pairs", "bf16_odd_stride_copy", "f16",
                                  "nan_keys"])
def test_interpreted_sums_equal_float64(interpreted, name):
    case = interpreted[name]
    assert case["shapes_ok"]
    assert max(case["err"]) <= 1e-12, case  # NaN (mismatched NaN patterns) fails too
    assert case["pairs"] == (name == "bf16_strided_pairs")


def test_interpreted_nan_keys_stay_out_of_windows(interpreted):
    assert interpreted["nan_pattern"] == dict(window0_finite=True, window1_nan=True, s_nan=True, P_nan=True)


def test_interpreted_keycone_sums_kernel_equals_torch(interpreted):
    assert max(interpreted["keycone_sums"]["err"]) <= 1e-12


def test_interpreted_other_tile_configuration():
    """BK = 32 (ten tiles of a 128 × 128 output, four of them mirrored), BT = 16, four warps."""
    res = _interpret('''
        torch.manual_seed(1)
        x = torch.randn(90, 2, 128, dtype=F64)
        x = (x / x.norm(dim=-1, keepdim=True)).float()
        amp = torch.rand(2, 90, dtype=F64)
        start = torch.tensor([17.0, 64.0])
        assert kk.config() == (32, 16, 4)
        print(json.dumps([rel(a, b) for a, b in zip(kk.keycone_sums_kernel(x, amp, start), reference(x, amp, start))]))
    ''', GDNVIZ_KEYCONE_KERNEL_CFG="32,16,4")
    assert max(res) <= 1e-12


def test_config_validation(monkeypatch):
    from gdnviz.gpu import keycone_kernel as kk

    monkeypatch.setenv("GDNVIZ_KEYCONE_KERNEL_CFG", "48,16,4")
    with pytest.raises(ValueError, match="powers of two"):
        kk.config()
    monkeypatch.delenv("GDNVIZ_KEYCONE_KERNEL_CFG")
    assert kk.config() == (kk.BK, kk.BT, kk._NUM_WARPS)


def test_validation_and_cpu_without_interpreter():
    from gdnviz.analysis.keycone import keycone_sums
    from gdnviz.gpu import keycone_kernel as kk

    if kk._INTERPRET:  # pragma: no cover
        pytest.skip("TRITON_INTERPRET is set for this process")
    k = torch.nn.functional.normalize(torch.randn(20, 2, 16, dtype=torch.float64), dim=-1)
    with pytest.raises(ValueError, match=r"amp must be \[H=2, T=20\]"):
        kk.keycone_sums_kernel(k, torch.ones(20, 2, dtype=torch.float64), torch.zeros(2))
    with pytest.raises(RuntimeError, match="needs CUDA"):
        kk.keycone_sums_kernel(k, torch.ones(2, 20, dtype=torch.float64), torch.zeros(2))
    assert not kk.available(k)
    with pytest.raises(RuntimeError, match="needs CUDA"):  # forced on where it cannot run: loud
        keycone_sums(k, torch.full((20, 2), -0.1), kernel=True)
    out = keycone_sums(k, torch.full((20, 2), -0.1))  # the default on the CPU: the torch form
    assert out["P"].shape == (2, 16, 16)


@pytest.mark.slow
@pytest.mark.parametrize("keys", ["*fp32", "*i32"])
def test_kernel_compiles_for_the_h200(keys):
    """Both input forms (float32 keys; bfloat16 keys as int32 pairs) lower to sm_90a cubins whose products are
    float64 tensor-core MMA, nothing TF32."""
    import re

    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gdnviz.gpu import keycone_kernel as kk

    if kk._INTERPRET:  # pragma: no cover
        pytest.skip("TRITON_INTERPRET is set for this process")
    sig = {"KEYS": keys, "stride_t": "i64", "stride_h": "i64", "stride_k": "i64", "AMP": "*fp64",
           "amp_stride_h": "i64", "amp_stride_t": "i64", "START": "*i64", "S_OUT": "*fp64", "SW_OUT": "*fp64",
           "GW_OUT": "*fp64", "P_OUT": "*fp64", "T": "i32", "per_split": "i32", "SPLIT": "i32"}
    consts = dict(K=128, BK=kk.BK, BT=kk.BT, NT=128 // kk.BK, PAIRS=keys == "*i32")
    sig.update({k: "constexpr" for k in consts})
    kernel = triton.compile(ASTSource(fn=kk._keycone_kernel, signature=sig, constexprs=consts),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": kk._NUM_WARPS})
    ptx = kernel.asm["ptx"]
    assert kernel.asm["cubin"]
    assert re.search(r"mma\.sync\.aligned\.m\d+n\d+k\d+\.row\.col\.f64\.f64\.f64\.f64", ptx)
    assert "tf32" not in ptx


# ------------------------------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_on_gpu_equals_cpu(dtype):
    """keycone_sums on CUDA through the kernel (``kernel=True``; the GPU's default is the torch form, also checked)
    equals the CPU's float64 sums of the same keys, for windows of a few tokens, ~T/2 and all T."""
    from gdnviz.analysis import keycone
    from gdnviz.gpu import keycone_kernel as kk

    rng = np.random.default_rng(5)
    T, H, K = 5000, 4, 128
    k = rng.standard_normal((T, H, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = np.log(rng.uniform(0.5, 0.999, (T, H)))
    g[:, 1], g[:, 2] = np.log(1 - 2.0 / T), 0.0
    kt = torch.from_numpy(k).to(dtype)
    gt = torch.from_numpy(g)
    assert kk.available(kt.cuda())
    cpu = keycone.keycone_sums(kt.double(), gt)  # the same (rounded) keys in float64 on the CPU
    gpu = keycone.keycone_sums(kt.cuda(), gt.cuda(), kernel=True)
    torch_form = keycone.keycone_sums(kt.cuda(), gt.cuda(), kernel=False)
    for name in ("C", "P", "mean_key_norm", "horizon"):
        np.testing.assert_allclose(gpu[name].cpu().numpy(), cpu[name].numpy(), rtol=1e-10, atol=1e-13)
        np.testing.assert_allclose(torch_form[name].cpu().numpy(), cpu[name].numpy(), rtol=1e-10, atol=1e-13)
