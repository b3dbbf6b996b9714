"""gdnviz.warmup: the worker's kernel warm-up after loading a model on CUDA (CPU: skipped, nothing to compile)."""
import torch
import pytest

from gdnviz.models import load
from gdnviz.warmup import needs_warm_up, warm_up


@pytest.fixture(scope="module")
def demo():
    return load("demo", device="cpu", dtype="float32")


def test_cpu_models_need_no_warm_up(demo):
    assert demo.info.kernel_path == "torch"
    assert not needs_warm_up(demo)


def test_warm_up_can_be_turned_off(demo, monkeypatch):
    class FakeInfo:
        kernel_path = "fla"

    class FakeLM:  # only what needs_warm_up reads: a CUDA model on fla's kernels
        info, device = FakeInfo(), "cuda:0"

    assert needs_warm_up(FakeLM())
    monkeypatch.setenv("GDNVIZ_WARMUP", "0")
    assert not needs_warm_up(FakeLM())


def test_warm_up_runs_every_step_and_reports_seconds(demo):
    out = warm_up(demo, tokens=64, segment_len=16)
    assert "error" not in out, out
    assert set(out) == {"kernel_builds", "capture", "truncated_run", "fused_truncation"} and all(v >= 0 for v in out.values())


def test_warm_up_reports_a_failing_step_instead_of_raising(demo, monkeypatch):
    import gdnviz.capture as capture

    def boom(*a, **k):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(capture, "capture_document", boom)
    out = warm_up(demo, tokens=32, segment_len=16)
    assert out["error"].startswith("capture: RuntimeError('kernel exploded'")
    assert "truncated_run" not in out


def test_worker_does_not_warm_up_on_cpu(tmp_path):
    from gdnviz.jobs import Store
    from gdnviz.worker import Worker

    w = Worker(Store(tmp_path / "cache"))
    lm = w.model("demo", "cpu", "float32")
    assert lm.info.kernel_path == "torch" and w.warm_up_seconds is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_worker_warms_up_on_cuda(tmp_path):
    from gdnviz.gdn import kernels
    from gdnviz.jobs import Store
    from gdnviz.worker import Worker

    if kernels.fla_ops() is None:
        pytest.skip("fla not importable")
    w = Worker(Store(tmp_path / "cache"))
    w.model("demo", "cuda", "bfloat16")
    assert w.warm_up_seconds and "error" not in w.warm_up_seconds, w.warm_up_seconds
