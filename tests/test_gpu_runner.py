"""On CUDA with fla's kernels: the segmented runner against the plain model and the plain cache loop (H200)."""
import pytest
import torch

import tiny_models
from gdnviz import runner
from gdnviz.models import from_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def lm(request):
    dtype = getattr(torch, request.param)
    m = tiny_models.qwen3_5(dk=128, dv=128, k_heads=2, v_heads=4).to("cuda", dtype)
    return from_model(m, f"tiny-{request.param}")


def tol(lm):
    # bf16 activations: outputs differ at the bf16 rounding level between kernels / call splits.
    return dict(atol=3e-2, rtol=3e-2) if lm.info.dtype == "bfloat16" else dict(atol=2e-3, rtol=2e-3)


def ids(T, seed=0):
    return torch.randint(0, 97, (1, T), generator=torch.Generator().manual_seed(seed)).cuda()


def test_fla_path_runs(lm):
    assert lm.info.kernel_path == "fla"
    out = runner.forward(lm, ids(512), segment_len=128, logits_positions="last")
    assert out.backends == {"fla"}


def test_runner_matches_plain_forward_on_gpu(lm):
    x = ids(1024)
    with torch.no_grad():
        ref = lm.model(input_ids=x).logits.float()
    out = runner.forward(lm, x, segment_len=256, logits_positions="all")
    torch.testing.assert_close(out.logits, ref, **tol(lm))


def test_runner_matches_cache_loop_on_gpu(lm):
    x = ids(1024 + 64, seed=1)

    def cut(layer, pos, state):
        U, s, Vh = torch.linalg.svd(state.double())
        return (U[..., :4] @ (U[..., :4].transpose(-1, -2) @ state.double())).float()

    class Cut:
        def on_boundary(self, layer, pos, state, rows=None):
            return cut(layer, pos, state)

    for callbacks, hook in (([], None), ([Cut()], cut)):
        out = runner.forward(lm, x, segment_len=256, callbacks=callbacks, logits_positions="all")
        ref, _, _ = runner.cache_loop(lm, x, segment_len=256, on_boundary=hook)
        torch.testing.assert_close(out.logits, ref, **tol(lm))


def test_capture_on_gpu(lm):
    from gdnviz.capture import capture_document

    c = capture_document(lm, ids(1000, seed=2)[0].cpu(), 256)
    assert list(c.positions) == [256, 512, 768, 1000]
    assert c.meta["backends"] == ["fla"]
    assert c.sv.shape == (4, len(lm.info.gdn_layers), 4, 128)
    fs = torch.linalg.svdvals(torch.from_numpy(c.final_state).double()).numpy()
    import numpy as np

    np.testing.assert_allclose(c.sv[-1], fs, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("T,L", [(1000, 256), (1024, 128), (777, 64)])
def test_one_pass_capture_equals_segment_loop(lm, T, L):
    """The one-pass state read-out (fla h in fp32) gives the same states and outputs as the segment loop."""
    import numpy as np

    from gdnviz.capture import capture_document
    from gdnviz.gdn import kernels

    x = ids(T, seed=3)[0].cpu()
    fast = capture_document(lm, x, L)
    slow = capture_document(lm, x, L, fast_states=False)
    assert list(fast.positions) == list(slow.positions)
    assert fast.meta["readouts"] == ["one-pass"] and slow.meta["readouts"] == ["segment-loop"]
    # the same fp32 running state: only the float summation order inside the kernels may differ
    np.testing.assert_allclose(fast.final_state, slow.final_state, rtol=1e-3, atol=1e-4)
    scale = slow.sv[:, :, :, :1]
    np.testing.assert_allclose(fast.sv / scale, slow.sv / scale, atol=1e-4)
    # and outputs: the model's hidden states with the one-pass path vs the segment loop
    a = runner.forward(lm, x[None], segment_len=L, callbacks=[_ReadOnly()], keep_hidden=True)
    b = runner.forward(lm, x[None], segment_len=L, callbacks=[_ReadOnly()], keep_hidden=True, fast_states=False)
    torch.testing.assert_close(a.hidden.float(), b.hidden.float(), **tol(lm))
    assert kernels.states_fast_path(torch.device("cuda"), T, [c for c in range(L, T, L)] + [T])


class _ReadOnly:
    modifies_state = False

    def __init__(self):
        self.seen = []

    def on_boundary(self, layer, pos, state, rows=None):
        self.seen.append((layer, pos))


def test_one_pass_direct_states_match_scan():
    """kernels.core_with_states vs kernels.core segment by segment, fp32 inputs, nonzero initial state."""
    from gdnviz.gdn import kernels

    g0 = torch.Generator(device="cuda").manual_seed(0)
    B, T, H, K, V = 2, 640, 4, 128, 128
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda", generator=g0), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda", generator=g0), dim=-1)
    v = torch.randn(B, T, H, V, device="cuda", generator=g0)
    g = -0.05 * torch.rand(B, T, H, device="cuda", generator=g0)
    beta = torch.rand(B, T, H, device="cuda", generator=g0)
    s0 = 0.1 * torch.randn(B, H, K, V, device="cuda", generator=g0)
    cuts = [128, 256, 384, 512, 640]
    out, final, states = kernels.core_with_states(q, k, v, g, beta, s0, cuts)
    st, outs, prev = s0, [], 0
    for i, c in enumerate(cuts):
        o, st = kernels.core(q[:, prev:c], k[:, prev:c], v[:, prev:c], g[:, prev:c], beta[:, prev:c], st)
        outs.append(o)
        torch.testing.assert_close(states[i], st, rtol=1e-4, atol=1e-4)
        prev = c
    torch.testing.assert_close(final, st, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, torch.cat(outs, 1), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("fast_states", [True, False])
def test_pipelined_capture_equals_inline_on_gpu(lm, fast_states):
    """On CUDA the statistics run on a side stream (the default): the same numbers, bit for bit, as queueing them on
    the main stream, with the one-pass read-out and with the segment loop; and against the CPU path's key cone."""
    import numpy as np

    from gdnviz.capture import capture_document

    x = ids(2000, seed=5)[0].cpu()
    inline = capture_document(lm, x, 256, pipeline=False, fast_states=fast_states)
    piped = capture_document(lm, x, 256, fast_states=fast_states)
    assert piped.meta["pipelined"] is True and inline.meta["pipelined"] is False
    for f in ("sv", "final_state", "g", "beta", "key_mean", "key_sample"):
        np.testing.assert_array_equal(getattr(inline, f), getattr(piped, f), err_msg=f)
    for k in inline.keycone:
        np.testing.assert_array_equal(inline.keycone[k], piped.keycone[k], err_msg=k)
    assert set(piped.meta["statistics_seconds"]) == {"layer_input", "layer_end", "waiting", "results"}


def test_keycone_on_gpu_equals_cpu():
    """The key cone's sums on CUDA (masked windows, one 16K-token chunk) against the CPU path, heads with short,
    long and infinite horizons."""
    import numpy as np

    from gdnviz.analysis.keycone import keycone_summary

    gen = torch.Generator().manual_seed(7)
    T, H, K = 3000, 4, 128
    k = torch.randn(T, H, K, generator=gen)
    k[:, 1] += 3.0 * torch.randn(K, generator=gen)  # a narrow cone
    k = k / torch.linalg.vector_norm(k, dim=-1, keepdim=True)
    g = torch.log(torch.rand(T, H, generator=gen) * 0.1 + 0.9)
    g[:, 2] = -1e-4
    g[:, 3] = 0.0
    gpu = keycone_summary(k.cuda().bfloat16().float(), g.cuda())
    ref = keycone_summary(k.bfloat16().float(), g)
    assert np.isinf(gpu["horizon"][3])
    for name in ref:
        np.testing.assert_allclose(gpu[name], ref[name], rtol=1e-8, atol=1e-6 if "sqrt" in name else 0, err_msg=name)
