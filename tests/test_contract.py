"""The 1e-5 contract on the CUDA kernel's answers (gdnviz.truncation.contract).

CPU: the exact error against the float64 SVD reference, the immediate mending, the deferred slots and counters, and a
real run (demo model, windows run without a graph) whose "kernel" misses the contract answered again. The kernel is
stood in for by deliberately wrong answers (the exact answer at rank r − 1), since it does not run on the CPU; its
``done`` flags (states certified by its attempts: not checked) by chosen flags, and once by the kernel's own flags
from its source run through the CPU emulation (tests.support.emulated_truncate).
GPU (``-m gpu``): the real kernel on slowly decaying and GDN-like spectra, at once and in a captured graph window,
certified states skipped and uncertified ones checked.
"""
import logging

import pytest
import torch

from gdnviz import runner
from gdnviz.truncation import TruncateCallback, TruncationSpec, contract, dispatch
from gdnviz.truncation import constants as C
from gdnviz.truncation.cuda import Launched
from gdnviz.truncation.reference import energy_error, exact_truncate, subspace_truncate
from tests.support.states import gdn_like_states, hard_states, slow_states
from cuda_kernel_checks import needs_gxx


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


def _nonzero_slow(r):
    """``slow_states(r)`` without its zero states (float32): the rank-(r − 1) answer misses the bound on each."""
    X, _ = slow_states(r)
    return X[X.flatten(1).abs().amax(1) > 0].float()


def test_exact_errors_are_zero_for_skipped_states():
    r = 12
    X = _nonzero_slow(r)
    Y = _short(X, r)  # every state over the bound
    rt = torch.full((X.shape[0],), r, dtype=torch.long)
    skip = torch.arange(X.shape[0]) % 3 == 0
    full = contract.exact_errors(X, contract.kept_energy(Y), rt)
    part = contract.exact_errors(X, contract.kept_energy(Y), rt, skip=skip)
    assert contract.over(full).all()
    assert (part[skip] == 0).all() and torch.equal(part[~skip], full[~skip])


def test_only_a_done_flag_of_one_certifies():
    done = torch.tensor([1, 0, 2, -1, 1, 3], dtype=torch.int32)
    assert contract.certified(done, 6).tolist() == [True, False, False, False, True, False]
    assert contract.certified(torch.empty(0, dtype=torch.int32), 6) is None  # no attempts ran
    assert contract.certified(torch.empty(0, dtype=torch.int32), 0) is None


@pytest.mark.parametrize("r", [4, 12])
def test_enforce_skips_certified_states_and_mends_the_others(r):
    """``_enforce`` with ``done`` flags: states flagged exactly 1 are kept unchecked (here deliberately wrong answers,
    so that a check would have mended them), every other flag is checked and the breaches mended."""
    X = _nonzero_slow(r)
    Y = _short(X, r)
    assert (energy_error(X, Y, r) > C.CONTRACT).all()
    done = torch.tensor([(1, 0, 2, -1)[i % 4] for i in range(X.shape[0])], dtype=torch.int32)
    cert = done == 1
    out = dispatch._enforce(X, Y, r, done)
    assert torch.equal(out[cert], Y[cert])
    assert energy_error(X[~cert], out[~cert], r).max() <= C.CONTRACT
    none = dispatch._enforce(X, Y, r, torch.empty(0, dtype=torch.int32))  # no attempts ran: every state checked
    assert energy_error(X, none, r).max() <= C.CONTRACT


def test_window_checks_only_uncertified_states_and_catches_their_breaches():
    """Deferred: certified states (flag 1) are counted as certified, not checked; a breach among the others is still
    caught; a slot recorded without flags (no attempts) after one with flags checks every state again."""
    r = 12
    X, _ = slow_states(r)
    X = X.float()
    N = X.shape[0]
    good, bad = exact_truncate(X, r), _short(X, r)
    done = torch.tensor([(1, 0, 2)[i % 3] for i in range(N)], dtype=torch.int32)
    cert = done == 1
    n_cert = int(cert.sum())
    assert 0 < n_cert < N
    slots = contract.Slots()
    start, since = contract.counts("cpu"), contract.mark()
    with contract.window(slots):
        slots.record(X, bad, r, done)  # the certified ones wrong on purpose: trusted, not checked
        slots.record(X, good, r, torch.ones(N, dtype=torch.int32))
    contract.check_window(slots)
    now = contract.counts("cpu")
    assert now["certified"] - start["certified"] == n_cert + N
    assert now["checked"] - start["checked"] == N - n_cert
    assert now["breaches"] - start["breaches"] == int((energy_error(X, bad, r)[~cert] > C.CONTRACT).sum()) > 0
    assert contract.breached(since)
    start, since = contract.counts("cpu"), contract.mark()
    with contract.window(slots):  # the same slots, now without flags: nothing certified
        slots.record(X, good, r)
        slots.record(X, bad, r, torch.empty(0, dtype=torch.int32))
    contract.check_window(slots)
    now = contract.counts("cpu")
    assert now["certified"] == start["certified"] and now["checked"] - start["checked"] == 2 * N
    assert now["breaches"] - start["breaches"] == int((energy_error(X, bad, r) > C.CONTRACT).sum())


@needs_gxx
def test_states_the_emulated_kernel_certifies_are_within_the_bound_and_skipped():
    """The kernel's own ``done`` flags (its source run on the CPU): GDN-like states are certified at r = 4 and their
    actual energy errors are within the contract; slowly decaying ones are not and get checked — at once
    (``_enforce`` keeps the certified answers bit for bit) and deferred (counted as certified / checked)."""
    from tests.support import emulated_truncate

    r = 4
    X = torch.cat([gdn_like_states(2, 128, 128, seed=3), slow_states(r)[0][:2]]).float()
    out, done, bound = emulated_truncate.emulate(X, r, info=True)
    assert done.tolist() == [1, 1, 0, 0], (done, bound)
    cert = done == 1
    err = energy_error(X, out, r)
    assert (err[cert] <= C.CONTRACT).all() and (bound[cert] <= C.CERT_TOL).all()
    e = contract.exact_errors(X, contract.kept_energy(out), torch.full((4,), r), skip=contract.certified(done, 4))
    assert (e[cert] == 0).all() and (e[~cert] != 0).all()
    fixed = dispatch._enforce(X, out, r, done)
    assert torch.equal(fixed[cert], out[cert]) and energy_error(X, fixed, r).max() <= C.CONTRACT
    slots = contract.Slots()
    start = contract.counts("cpu")
    with contract.window(slots):
        slots.record(X, out, r, done)
    contract.check_window(slots)
    now = contract.counts("cpu")
    assert (now["certified"] - start["certified"], now["checked"] - start["checked"]) == (2, 2)


@pytest.fixture(scope="module")
def demo():
    from gdnviz.models import load

    torch.manual_seed(0)
    return load("demo", device="cpu", dtype="float32")


def _fake_kernel(monkeypatch, answer, calls, flags=None):
    """Let the CUDA-kernel branch run on the CPU with ``answer(X, r)`` as the kernel (``cuda.launch``) and
    ``flags(X, r)`` as its ``done`` flags (None: no attempts ran); ``calls`` gets (states, inside a window) per
    call."""

    def launch(X, ranks, iters=None):
        calls.append((X.shape[0], contract.active() is not None))
        r = ranks if isinstance(ranks, int) else ranks.tolist()
        done = torch.empty(0, dtype=torch.int32) if flags is None else flags(X, r)
        return Launched(answer(X, r), torch.empty(0), done, torch.empty(0, dtype=torch.float64))

    monkeypatch.setattr(dispatch.cuda, "launch", launch)
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

    def spy(X, Y, ranks, done=None):
        out = enforce(X, Y, ranks, done)
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


def test_a_run_skips_certified_states_and_still_catches_an_uncertified_breach(demo, monkeypatch):
    """A real run in windows whose "kernel" flags every even state certified but answers it with the state itself
    (over the bound: a check would count it) and answers every odd state with zeros, unflagged (over the bound where
    the state is not zero): the even states are counted as certified, not checked; the odd ones are checked and
    their breaches counted, which makes ``run_checked`` answer the run again (every boundary then checked at once)."""
    L, r = 4, 4
    x = torch.randint(10, 8000, (1, 64 + 9), generator=torch.Generator().manual_seed(7))  # one window, then eager
    spec = TruncationSpec.all_heads(demo.info, r)
    even = lambda X: torch.arange(X.shape[0]) % 2 == 0  # noqa: E731
    breaching: list = []  # per windowed call: its odd nonzero states

    def answer(X, rr):
        if contract.active() is not None:
            breaching.append(int(((X.flatten(1).abs().amax(1) > 0) & ~even(X)).sum()))
        return torch.where(even(X)[:, None, None], X, torch.zeros_like(X))

    calls: list = []
    _fake_kernel(monkeypatch, answer, calls, flags=lambda X, rr: even(X).to(torch.int32))
    start = contract.counts("cpu")
    runs = []

    def run():
        out, c = _forward(demo, x, spec, L)
        runs.append(c.readouts)
        return out

    contract.run_checked(run, spec)
    assert len(runs) == 2 and "segment-graph" in runs[0] and "segment-graph" not in runs[1]
    now = contract.counts("cpu")
    windowed = [n for n, w in calls if w]
    assert windowed and now["certified"] - start["certified"] == sum((n + 1) // 2 for n in windowed)
    assert now["checked"] - start["checked"] == sum(n // 2 for n in windowed)
    assert now["breaches"] - start["breaches"] == sum(breaching) > 0


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
    """Slowly decaying and nearly flat spectra, where the kernel's full algorithm alone misses 1e-5, and GDN-like ones:
    every answer of ``truncate_states`` (kernel + exact check of the uncertified states + mending) is within the
    bound; kernel answers within it are kept; the states the kernel certified (``done`` = 1, ranks ≤ 16) are within
    the bound on their own (their check is skipped)."""
    _cuda_ready()
    X = torch.cat([slow_states(r)[0], hard_states(r)[0], gdn_like_states(32, 128, 128, seed=5)]).float().cuda()
    res = dispatch.cuda.launch(X, r)
    raw = res.out
    got = dispatch.truncate_states(X, r)
    err = energy_error(X.cpu(), got.cpu(), r)
    assert err.max() <= C.CONTRACT, err.max()
    raw_err = energy_error(X.cpu(), raw.cpu(), r)
    ok = raw_err <= C.CONTRACT
    assert torch.equal(got.cpu()[ok], raw.cpu()[ok])
    cert = contract.certified(res.done, X.shape[0])
    if r <= 4:  # the 16-column attempt runs for any number of states
        assert cert is not None and bool(cert.any())
    if cert is not None:
        cert = cert.cpu()
        assert (raw_err[cert] <= C.CONTRACT).all(), raw_err[cert].max()
        assert torch.equal(got.cpu()[cert], raw.cpu()[cert])


@pytest.mark.gpu
@pytest.mark.parametrize("r", [4, 12, 32])
def test_deferred_check_in_a_captured_graph_counts_the_kernels_breaches(r):
    """A graph captured inside ``contract.window``: replays copy the states and ``done`` flags into the slots,
    ``check_window`` checks the uncertified states and counts exactly those whose kernel answer is over the bound
    (the float64 SVD's count); the certified ones (counted apart) are within the bound; none on GDN-like states."""
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
        cert = slots.done[0].cpu() == 1  # the replay's flags (the next replay overwrites them)
        err = energy_error(X.cpu(), out.cpu(), r)
        assert (err[cert] <= C.CONTRACT).all()
        assert after["certified"] - before["certified"] == int(cert.sum())
        assert after["checked"] - before["checked"] == X.shape[0] - int(cert.sum())
        assert after["breaches"] - before["breaches"] == int((err > C.CONTRACT).sum())
        if X is gdn:
            assert int((err > C.CONTRACT).sum()) == 0
            if r <= C.HALF:  # the 32-column attempt runs (a layer's heads fit in one wave)
                assert cert.any()


@pytest.mark.gpu
def test_a_truncated_run_on_cuda_checks_every_state_in_its_windows():
    """A real truncated run in CUDA-graph windows: the deferred check saw every truncated state (checked it, or
    counted it as certified by the kernel: at r = 4 the 16-column attempt runs on every state), and the run through
    ``run_checked`` ran once when nothing breached."""
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
    seen = got["checked"] - start["checked"] + got["certified"] - start["certified"]
    assert seen == cbs[0].n_calls * lm.info.num_heads
