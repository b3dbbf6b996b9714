"""The 1e-5 contract on the CUDA kernel's answers (gdnviz.truncation.contract).

CPU: the exact error against the float64 SVD reference, the immediate mending, the deferred slots and counters, and a
real run (demo model, windows run without a graph) whose "kernel" misses the contract answered again. The kernel is
stood in for by deliberately wrong answers (the exact answer at rank r − 1), since it does not run on the CPU.
GPU (``-m gpu``): the real kernel on slowly decaying spectra, at once and in a captured graph window.
"""
import logging

import pytest
import torch

from gdnviz import runner
from gdnviz.truncation import TruncateCallback, TruncationSpec, contract, dispatch
from gdnviz.truncation import constants as C
from gdnviz.truncation.reference import energy_error, exact_truncate, subspace_truncate
from tests.support.states import gdn_like_states, hard_states, slow_states


def _short(X, r):
    """The exact answer at rank r − 1 (r ≥ 2): off by σ_r² / ‖S‖² of the energy."""
    return exact_truncate(X, r - 1)


@pytest.mark.parametrize("r", [2, 4, 12, 17, 32])
def test_exact_errors_equal_the_float64_svd(r):
    X, _ = slow_states(r)
    H, _ = hard_states(r)
    nan = torch.full((1, 128, 128), float("nan"), dtype=torch.float64)
    X = torch.cat([X, H])
    rt = torch.full((X.shape[0] + 1,), r, dtype=torch.long)
    for Y in (exact_truncate(X, r), _short(X, r)):
        e = contract.exact_errors(torch.cat([X, nan]), contract.kept_energy(torch.cat([Y, nan])), rt)
        ref = energy_error(X, Y, r)
        assert torch.allclose(e[:-1].abs(), ref, rtol=0, atol=1e-12), (e[:-1].abs() - ref).abs().max()
        assert e[-1] == 0  # a NaN state has no top-r energy: not a breach
    assert contract.over(contract.exact_errors(X, contract.kept_energy(_short(X, r)), rt[:-1])).any()
    full = torch.full_like(rt[:-1], 128)  # every direction: the state itself is exact
    assert not contract.over(contract.exact_errors(X, contract.kept_energy(X), full)).any()


@pytest.mark.parametrize("r", [4, 12, 32])
def test_enforce_mends_only_the_states_over_the_bound(r):
    X = torch.cat([slow_states(r)[0], gdn_like_states(8, 128, 128, seed=3).double()]).float()
    Y = subspace_truncate(X.double(), torch.full((X.shape[0],), r), iters=1).out.float()  # one filter step: sloppy
    before = energy_error(X, Y, r)
    bad = before > C.CONTRACT
    assert bad.any() and (~bad).any(), "the battery must hold states on both sides of the bound"
    out = dispatch._enforce(X, Y, r)
    assert energy_error(X, out, r).max() <= C.CONTRACT
    assert torch.equal(out[~bad], Y[~bad])  # answers within the bound are kept bit for bit
    # per-state ranks (the kernel's int32 tensor)
    rk = torch.tensor([r if i % 2 else max(r - 1, 1) for i in range(X.shape[0])], dtype=torch.int32)
    Y2 = subspace_truncate(X.double(), rk.long(), iters=1).out.float()
    assert energy_error(X, dispatch._enforce(X, Y2, rk), rk.tolist()).max() <= C.CONTRACT


def test_window_slots_count_every_state_and_every_breach():
    r = 12
    X, _ = slow_states(r)
    X = X.float()
    good, bad = exact_truncate(X, r), _short(X, r)
    n_bad = int((energy_error(X, bad, r) > C.CONTRACT).sum())
    assert n_bad > 0
    start = contract.counts("cpu")
    since = contract.mark()
    slots = contract.Slots()
    with contract.window(slots):
        assert contract.active() is slots
        slots.record(X, good, r)
        slots.record(X, bad, torch.full((X.shape[0],), r, dtype=torch.int32))
    assert contract.active() is None and slots.used == 2
    contract.check_window(slots)
    now = contract.counts("cpu")
    assert now["checked"] - start["checked"] == 2 * X.shape[0]
    assert now["breaches"] - start["breaches"] == n_bad
    assert now["worst"] >= float(energy_error(X, bad, r).max()) - 1e-12
    assert contract.breached(since)
    since = contract.mark()
    with contract.window(slots):  # a second run of the body restarts at slot 0 and reuses the buffers
        slots.record(X, good, r)
    assert slots.used == 1
    contract.check_window(slots)
    assert not contract.breached(since)


@pytest.fixture(scope="module")
def demo():
    from gdnviz.models import load

    torch.manual_seed(0)
    return load("demo", device="cpu", dtype="float32")


def _fake_kernel(monkeypatch, answer, calls):
    """Let the CUDA-kernel branch run on the CPU with ``answer(X, r)`` as the kernel; ``calls`` gets (states,
    inside a window) per call."""

    def truncate_cuda(X, ranks, iters=None):
        calls.append((X.shape[0], contract.active() is not None))
        r = ranks if isinstance(ranks, int) else ranks.tolist()
        return answer(X, r)

    monkeypatch.setattr(dispatch.cuda, "truncate_cuda", truncate_cuda)
    monkeypatch.setattr(TruncateCallback, "_kernel", lambda self, layer, dev: True)


def _forward(lm, x, spec, L):
    ctx = runner.RunContext(segment_len=L, callbacks=[TruncateCallback(lm.info, spec)], graphs="eager")
    return runner.forward(lm, x, logits_positions="all", ctx=ctx), ctx


def test_a_run_whose_windows_break_the_contract_is_answered_again(demo, monkeypatch, caplog):
    """Windows (run without a graph on the CPU) defer the check; the run's breach makes ``run_checked`` answer it
    again without windows, where every boundary is checked and mended at once: every state then within 1e-5."""
    L, r = 4, 4
    x = torch.randint(10, 8000, (1, 2 * 64 + 9), generator=torch.Generator().manual_seed(4))
    spec = TruncationSpec.all_heads(demo.info, r)
    calls: list = []
    _fake_kernel(monkeypatch, _short, calls)
    mended: list = []
    enforce = dispatch._enforce

    def spy(X, Y, ranks):
        out = enforce(X, Y, ranks)
        mended.append(float(energy_error(X, out, ranks).max()))
        return out

    monkeypatch.setattr(dispatch, "_enforce", spy)
    sloppy, ctx = _forward(demo, x, spec, L)
    assert "segment-graph" in ctx.readouts
    runs = []

    def run():
        out, c = _forward(demo, x, spec, L)
        runs.append(c.readouts)
        return out

    with caplog.at_level(logging.WARNING, logger="gdnviz.truncation.contract"):
        got = contract.run_checked(run, spec)
    assert len(runs) == 2 and "segment-graph" in runs[0] and "segment-graph" not in runs[1]
    assert "answering the run again" in caplog.text
    assert mended and max(mended) <= C.CONTRACT  # the second run: every boundary checked and mended at once
    with contract.immediate():
        again, _ = _forward(demo, x, spec, L)
    assert torch.equal(got.logits, again.logits)
    assert (got.logits - sloppy.logits).abs().max() > 0


def test_a_run_within_the_contract_runs_once(demo, monkeypatch):
    L, r = 4, 4
    x = torch.randint(10, 8000, (1, 2 * 64 + 9), generator=torch.Generator().manual_seed(5))
    spec = TruncationSpec.all_heads(demo.info, r)
    calls: list = []
    _fake_kernel(monkeypatch, lambda X, rr: exact_truncate(X, rr), calls)
    start = contract.counts("cpu")["checked"]
    runs = []
    contract.run_checked(lambda: runs.append(_forward(demo, x, spec, L)), spec)
    assert len(runs) == 1 and "segment-graph" in runs[0][1].readouts
    windowed = sum(n for n, w in calls if w)
    assert windowed > 0 and all(w for _, w in calls)  # every boundary of this run lies in a window
    assert contract.counts("cpu")["checked"] - start == windowed  # every state truncated in a window was checked


def test_a_failing_deferred_check_falls_back_to_checking_at_once(demo, monkeypatch, caplog):
    """If the deferred check cannot run, the window counts as breached (the run is answered again, every boundary
    checked at once) and later runs use no windows."""
    L = 4
    x = torch.randint(10, 8000, (1, 2 * 64), generator=torch.Generator().manual_seed(6))
    spec = TruncationSpec.all_heads(demo.info, 4)
    _fake_kernel(monkeypatch, lambda X, rr: exact_truncate(X, rr), [])
    monkeypatch.setattr(contract, "_BROKEN", [])

    def broken(slots):
        raise RuntimeError("stand-in for a driver failure")

    monkeypatch.setattr(contract, "_check_window", broken)
    runs = []
    with caplog.at_level(logging.WARNING, logger="gdnviz.truncation.contract"):
        contract.run_checked(lambda: runs.append(_forward(demo, x, spec, L)[1].readouts), spec)
    assert len(runs) == 2 and "segment-graph" in runs[0] and "segment-graph" not in runs[1]
    assert "deferred check of truncated states failed" in caplog.text
    assert not contract.deferring()
    _, ctx = _forward(demo, x, spec, L)
    assert "segment-graph" not in ctx.readouts


def test_run_checked_passes_through_without_a_spec_or_nested():
    assert contract.run_checked(lambda: 7, None) == 7
    assert contract.run_checked(lambda: 8, TruncationSpec({})) == 8
    with contract.immediate():
        assert not contract.deferring()
        assert contract.run_checked(lambda: 9, TruncationSpec({(0, 0): 1})) == 9
    assert contract.deferring()


# ------------------------------------------------------------------------------------------------ GPU
def _cuda_ready():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from gdnviz.truncation import cuda

    if not cuda.available():
        pytest.skip("the CUDA kernel does not compile here")


@pytest.mark.gpu
@pytest.mark.parametrize("r", [1, 4, 12, 16, 17, 24, 32])
def test_truncate_states_on_cuda_meets_the_contract_on_slow_spectra(r):
    """Slowly decaying and nearly flat spectra, where the kernel's full algorithm alone misses 1e-5: every answer of
    ``truncate_states`` (kernel + exact check + mending) is within the bound; kernel answers within it are kept."""
    _cuda_ready()
    X = torch.cat([slow_states(r)[0], hard_states(r)[0]]).float().cuda()
    raw = dispatch.cuda.truncate_cuda(X, r)
    got = dispatch.truncate_states(X, r)
    err = energy_error(X.cpu(), got.cpu(), r)
    assert err.max() <= C.CONTRACT, err.max()
    ok = energy_error(X.cpu(), raw.cpu(), r) <= C.CONTRACT
    assert torch.equal(got.cpu()[ok], raw.cpu()[ok])


@pytest.mark.gpu
@pytest.mark.parametrize("r", [12, 32])
def test_deferred_check_in_a_captured_graph_counts_the_kernels_breaches(r):
    """A graph captured inside ``contract.window``: replays copy the states into the slots, ``check_window`` counts
    exactly the states whose kernel answer is over the bound (the float64 SVD's count), and none on GDN-like states."""
    _cuda_ready()
    dev = torch.device("cuda")
    slow = slow_states(r)[0].float().cuda()
    gdn = gdn_like_states(slow.shape[0], 128, 128, seed=11).float().cuda()
    static = slow.clone()
    slots = contract.Slots()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), contract.window(slots):
        dispatch.kernel_truncate(static, r)  # the eager run that allocates the slots (as scan_graph's capture)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), contract.window(slots):
        out = dispatch.kernel_truncate(static, r)
    for X in (slow, gdn):
        static.copy_(X)
        before = contract.counts(dev)
        g.replay()
        contract.check_window(slots)
        after = contract.counts(dev)
        want = int((energy_error(X.cpu(), out.cpu(), r) > C.CONTRACT).sum())
        assert after["checked"] - before["checked"] == X.shape[0]
        assert after["breaches"] - before["breaches"] == want
        if X is gdn:
            assert want == 0


@pytest.mark.gpu
def test_a_truncated_run_on_cuda_checks_every_state_in_its_windows():
    """A real truncated run in CUDA-graph windows: the deferred check saw every truncated state, and the run through
    ``run_checked`` gives the same logits as without it when nothing breached."""
    _cuda_ready()
    from gdnviz.gdn import kernels
    from gdnviz.gpu import scan_graph
    from gdnviz.models import load

    if kernels.fla_ops() is None:
        pytest.skip("fla not importable")
    scan_graph.clear()
    lm = load("demo", device="cuda", dtype="float32")
    x = torch.randint(10, 8000, (1, 4096), generator=torch.Generator().manual_seed(9)).cuda()
    spec = TruncationSpec.all_heads(lm.info, 4)
    dev = torch.device("cuda")
    start = contract.counts(dev)
    cbs = []

    def run():
        cb = TruncateCallback(lm.info, spec)
        cbs.append(cb)
        ctx = runner.RunContext(segment_len=256, callbacks=[cb])
        return runner.forward(lm, x, logits_positions="all", ctx=ctx), ctx

    (out, ctx) = contract.run_checked(run, spec)
    assert "segment-graph" in ctx.readouts
    got = contract.counts(dev)
    assert len(cbs) == 1 and got["breaches"] == start["breaches"]
    # every boundary the callback truncated (in every GDN layer), every head
    assert got["checked"] - start["checked"] == cbs[0].n_calls * lm.info.num_heads
