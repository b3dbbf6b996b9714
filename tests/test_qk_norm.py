"""The GDN core's q̂/k̂ normalisation written straight into the value dtype (``kernels.unit_rows``), the path
``runner.prepare_core_inputs`` takes where ``runner.fast_qk_norm`` allows it (fla on CUDA, no callback reading keys).

CPU: ``unit_rows`` against ``kernels.l2norm`` (float32 to a few ulps; bfloat16 the same as ``l2norm(x).to(bf16)``
to one bf16 ulp, and for nearly every entry exactly), including zero rows (eps); when the fast path runs; a CPU run
with it forced on gives the same logits as without.
CUDA: a bf16 truncated run with it, against the float32 model's run, no further from it than the bf16 run with the
float32 normalisation (the fallback path, forced).
"""
import pytest
import torch

from gdnviz import runner
from gdnviz.gdn import kernels
from gdnviz.truncation import TruncateCallback, TruncationSpec
from gdnviz.models import load


def _rows(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 300, 4, 128, generator=g) * torch.logspace(-3, 3, 300)[None, :, None, None]
    x[0, 7] = 0.0  # zero rows: eps keeps them at 0
    return x


def test_unit_rows_float32_equals_l2norm_to_a_few_ulps():
    x = _rows()
    want = kernels.l2norm(x)
    got = kernels.unit_rows(x, torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=4 * torch.finfo(torch.float32).eps, atol=1e-30)
    assert not got[0, 7].any()


def test_unit_rows_bfloat16_is_l2norm_rounded():
    x = _rows(1).to(torch.bfloat16)
    want = kernels.l2norm(x).to(torch.bfloat16)
    got = kernels.unit_rows(x, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    diff = (got.float() - want.float()).abs()
    assert (diff <= 2.0 ** -8 * want.float().abs()).all()  # one bf16 ulp at most
    assert (diff == 0).float().mean() > 0.99


def test_fast_qk_norm_only_for_fla_runs_that_read_no_keys(monkeypatch):
    ctx = runner.RunContext(segment_len=4)
    assert not runner.fast_qk_norm(ctx, torch.device("cpu"))  # CPU runs the torch bodies
    monkeypatch.setattr(kernels, "backend_for", lambda device: "fla")
    assert runner.fast_qk_norm(ctx, torch.device("cpu"))
    assert not runner.fast_qk_norm(None, torch.device("cpu"))  # outside a run

    class ReadsKeys:
        def on_layer_input(self, layer, offset, keys, g, beta):
            pass

    assert not runner.fast_qk_norm(runner.RunContext(segment_len=4, callbacks=[ReadsKeys()]), torch.device("cpu"))


def truncated_logits(lm, x, rank: int, L: int):
    """Logits at every position of a run with every head of ``lm`` truncated to ``rank`` at every L tokens."""
    cb = TruncateCallback(lm.info, TruncationSpec.all_heads(lm.info, rank))
    ctx = runner.RunContext(segment_len=L, callbacks=[cb])
    return runner.forward(lm, x, logits_positions="all", ctx=ctx).logits


def test_forced_fast_qk_norm_keeps_a_cpu_run(monkeypatch):
    """The demo model in float32 on the CPU, every head truncated to rank 4: the same logits with q̂, k̂ from
    unit_rows (forced on) as from l2norm, to float32 rounding."""
    lm = load("demo", device="cpu", dtype="float32")
    x = torch.randint(10, 8000, (1, 96), generator=torch.Generator().manual_seed(2))
    ref = truncated_logits(lm, x, 4, 16)
    used = []
    monkeypatch.setattr(runner, "fast_qk_norm", lambda ctx, device: used.append(1) or True)
    got = truncated_logits(lm, x, 4, 16)
    assert used  # the forced path ran
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def bf16_deviation(fallback, monkeypatch, rank: int = 4, L: int = 64, T: int = 5000) -> dict:
    """How far the bf16 demo model's truncated run (``T`` random tokens, every head at ``rank`` every ``L`` tokens) is
    from the float32 model's: as the library runs it (``switched``: the fast path) and with ``fallback(m)`` applied
    to a ``monkeypatch`` context ``m`` (``default``: the fallback path forced, the yardstick of bf16 noise). Mean
    and largest |Δ log p| over every position and token, and the share of positions whose top token differs."""
    x = torch.randint(10, 8000, (1, T), generator=torch.Generator().manual_seed(5)).cuda()
    lm32 = load("demo", device="cuda", dtype="float32")
    ref = truncated_logits(lm32, x, rank, L).float().log_softmax(-1)
    del lm32
    lm = load("demo", device="cuda", dtype="bfloat16")
    out = {}
    for name in ("default", "switched"):
        with monkeypatch.context() as m:
            if name == "default":
                fallback(m)
            lp = truncated_logits(lm, x, rank, L).float().log_softmax(-1)
        d = (lp - ref).abs()
        out[name] = {"mean": d.mean().item(), "max": d.max().item(),
                     "top1_changed": (lp.argmax(-1) != ref.argmax(-1)).float().mean().item()}
    return out


def assert_within_bf16_noise(dev: dict) -> None:
    """The fast path's bf16 run (``switched``) is no further from float32 than the fallback's bf16 run (``default``),
    up to a quarter of its deviation (both are bf16 roundings of the same computation)."""
    d, s = dev["default"], dev["switched"]
    assert s["mean"] <= 1.25 * d["mean"] + 1e-4, dev
    assert s["top1_changed"] <= 1.25 * d["top1_changed"] + 2e-3, dev


@pytest.mark.gpu
@pytest.mark.timeout(300)  # 99 s on a warm H200, > 100 s on a fresh one: fla autotunes
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fast_qk_norm_on_gpu(monkeypatch):
    """bf16 demo model, every head at rank 4 every 64 tokens, 5,000 tokens (graph windows): with q̂, k̂ from
    unit_rows the run is as close to the float32 model's as with the float32 normalisation (its deviation printed)."""
    if kernels.fla_ops() is None:
        pytest.skip("fla not importable")
    dev = bf16_deviation(lambda m: m.setattr(runner, "fast_qk_norm", lambda ctx, device: False), monkeypatch)
    print("bf16 deviation from float32, fast q/k norm:", dev)
    assert_within_bf16_noise(dev)
