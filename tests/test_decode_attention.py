"""gdnviz.gpu.decode_attention: the split-key attention of one decoded token against its float64 reference, on
nasty inputs (a whole block of keys masked, key counts that are not a multiple of the block, fewer keys than one
block, 1/2/4 query heads per key/value head), the transformers wrapper (taken only inside ``active()``, equal to
SDPA there, SDPA itself outside), and what it refuses. CPU: Triton's interpreter, in a subprocess (the interpreter
is chosen when Triton first imports). CUDA: the same against the reference at 16K keys, bfloat16 and float32."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from gdnviz.gpu import decode_attention as da

CASES = [  # (B, Hq, Hkv, S, D, dtype)
    (2, 4, 2, 150, 16, "float32"), (1, 8, 2, 64, 32, "float32"), (3, 2, 2, 7, 16, "float32"),
    (2, 4, 1, 200, 16, "float16"), (1, 2, 2, 129, 64, "float32")]


def inputs(B, Hq, Hkv, S, D, dtype, device="cpu", seed=0):
    """Random q, k, v and a mask hiding row 0's first S/2 + 1 keys (for S > 2·BLOCK a whole block) and row 1's
    last key."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=g) for shape in ((B, Hq, 1, D), (B, Hkv, S, D), (B, Hkv, S, D)))
    m = torch.zeros(B, 1, 1, S)
    dt = getattr(torch, dtype)
    m[0, ..., :S // 2 + 1] = torch.finfo(dt).min
    if B > 1:
        m[1, ..., -1] = torch.finfo(dt).min
    return [x.to(device=device, dtype=dt) for x in (q, k, v, m)]


SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path[:0] = [{tests!r}]
    from test_decode_attention import CASES, inputs
    from gdnviz.gpu import decode_attention as da
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    out = []
    for case in CASES:
        q, k, v, m = inputs(*case)
        assert da.supported(q, k, v, m), case
        got = da.decode_attention(q, k, v, m, case[4] ** -0.5)
        ref = da.reference(q, k, v, m, case[4] ** -0.5)
        out.append(dict(case=case, shape=list(got.shape), err=float((got.double() - ref).abs().max()),
                        scale=float(ref.abs().max())))
    # the wrapper: the kernel inside active(), transformers' SDPA outside (same layout [B, 1, Hq, D])
    class Attn(torch.nn.Module):
        num_key_value_groups = 2
        is_causal = True
    q, k, v, m = inputs(2, 4, 2, 150, 16, "float32")
    fn = da.attention_function(sdpa_attention_forward)
    plain = sdpa_attention_forward(Attn(), q, k, v, m, scaling=0.25)[0]
    outside = fn(Attn(), q, k, v, m, scaling=0.25)[0]
    with da.active():
        inside = fn(Attn(), q, k, v, m, scaling=0.25)[0]
    out.append(dict(wrapper=True, outside_equal=bool(torch.equal(outside, plain)),
                    inside_err=float((inside - plain).abs().max()), shape=list(inside.shape)))
    print(json.dumps(out))
""")


def test_kernel_and_wrapper_in_triton_interpreter():
    tests = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(tests)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (root, os.environ.get("PYTHONPATH")) if x))
    res = subprocess.run([sys.executable, "-c", SCRIPT.format(tests=tests)], capture_output=True, text=True,
                         env=env, timeout=600, cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    import json

    rows = json.loads(res.stdout.strip().splitlines()[-1])
    for row in rows[:-1]:
        B, Hq, Hkv, S, D, dtype = row["case"]
        assert row["shape"] == [B, 1, Hq, D]
        tol = 1e-6 if dtype == "float32" else 2e-3  # float16: the probabilities are rounded to float16
        assert row["err"] <= tol * max(1.0, row["scale"]), row
    wrap = rows[-1]
    assert wrap["outside_equal"] and wrap["inside_err"] < 1e-5 and wrap["shape"] == [2, 1, 4, 16], wrap


def test_what_it_refuses():
    q, k, v, m = inputs(2, 4, 2, 150, 16, "float32")
    assert not da.supported(q, k, v, m)  # CPU without the interpreter
    assert not da.supported(q, k, v, None)
    assert not da.supported(q.expand(2, 4, 2, 16), k, v, m)  # two query tokens
    assert not da.supported(q, k, v, m.bool())  # a boolean mask
    assert not da.supported(q[:, :3], k, v, m)  # 3 query heads over 2 key/value heads
    assert not da.supported(q[..., :12], k[..., :12], v[..., :12], m)  # D not a power of two


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_kernel_on_cuda_against_the_reference(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (run on the H200 through the device tool)")
    q, k, v, m = inputs(16, 8, 2, 16385, 256, dtype, device="cuda")
    assert da.supported(q, k, v, m)
    got = da.decode_attention(q, k, v, m, 256 ** -0.5)
    ref = da.reference(q, k, v, m, 256 ** -0.5)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(4, 1), v.double().repeat_interleave(4, 1), attn_mask=m.double(),
        scale=256 ** -0.5).transpose(1, 2)
    assert (sdpa - ref).abs().max() < 1e-10  # the reference is attention as SDPA defines it
    err = float((got.double() - ref).abs().max())
    print(f"{dtype}: max error {err:.3g}")
    assert err <= (1e-5 if dtype == "float32" else 2e-2) * float(ref.abs().max())


def test_install_wraps_sdpa_once():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    try:
        da.install()
        da.install()
        fn = ALL_ATTENTION_FUNCTIONS["sdpa"]
        inner = getattr(before, "__gdnviz_original__", before)
        assert fn.__gdnviz_original__ is inner and not hasattr(inner, "__gdnviz_original__")
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = before
