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
        def on_boundary(self, layer, pos, state):
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
