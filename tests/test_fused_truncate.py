"""The fused truncation kernel (gdnviz.gpu.fused_truncate) against the exact float64 SVD truncation.

Criterion (as for gdnviz.truncate): the retained energy ‖S_r‖²_F is within 1e-5 of the exact top-r energy, relative to
‖S‖²_F, for every state checked. Where it runs:

* CPU, Triton interpreter (``TRITON_INTERPRET=1`` in a subprocess: the variable must be set before triton is
  imported): a few states of each battery of tests/test_truncate.py per rank r ∈ {1, 4, 12, 32}, one launch with
  mixed per-state ranks (float32, a zero state, a kept state), and the projection properties of the output. The
  interpreter needs ~3 s per state and pass, so these are small.
* CPU, float64 torch: ``reference_fused`` — the same algorithm, step for step — on the full batteries (every state),
  which the interpreted kernel is pinned to state by state.
* CPU, offline compile for the H200 (sm_90a): the kernel lowers, fits in shared memory, uses float64 MMA.
* CUDA (``@pytest.mark.gpu``): full 288-state batches, no host sync, CUDA-graph capture and replay.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from gdnviz.truncation import energy_error, exact_truncate, retained_energy, truncate_states
from test_truncate import hard_states

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-5
F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")

# States of hard_states(r, seed=r) the interpreted kernel runs, by (battery name, occurrence): two per rank, chosen
# to cover every battery — clustered / repeated singular values at the cut, rank-deficient, condition number 1e16,
# GDN-like spectra, toy gated-delta-rule states (effective rank up to ~95), states scaled by 1e±30, low rank + noise.
PICKS = {
    1: [("clustered", 2), ("illcond", 0)],  # σ_1 = σ_2 exactly; singular values 1 … 1e-16
    4: [("rankdef", 1), ("scaled", 1)],  # rank 1 (flat); a GDN-like state × 1e30
    12: [("toy_gdn", 3), ("lowrank_noise", 0)],
    32: [("toy_gdn", 5), ("gdn_like", 4)],  # two passes (16 + 16 directions)
}

PRELUDE = textwrap.dedent('''
    import json, os, sys, time
    sys.path.insert(0, os.environ["ROOT"])
    sys.path.insert(0, os.path.join(os.environ["ROOT"], "tests"))
    import torch
    torch.set_num_threads(1)
    from gdnviz.gpu import fused_truncate as ft
    from gdnviz.truncation import energy_error, retained_energy
    from test_truncate import hard_states
    assert ft.uses_kernel(torch.zeros(1, 64, 64)), "the interpreter is not on"
    F64 = torch.float64

    def projection(S, out, r):
        """Worst relative violations of S_r = P S (P an orthogonal projector of rank ≤ r), for float64 [N, K, V]."""
        n2 = S.square().sum((-1, -2)).clamp_min(1e-300)
        # S_rᵀ(S − S_r) = 0 and rank(S_r) ≤ r  <=>  S_r = Π S with Π the orthogonal projector onto range(S_r)
        orth = (out.mT @ (S - out)).square().sum((-1, -2)).sqrt() / n2
        sv = torch.linalg.svdvals(out)
        tail = sv[:, r] / n2.sqrt() if r < sv.shape[-1] else torch.zeros(S.shape[0], dtype=F64)
        grow = out.square().sum((-1, -2)) / n2 - 1.0
        return dict(orth=orth.max().item(), tail=tail.max().item(), grow=grow.max().item())
''')


def _interpret(code: str) -> dict:
    """Run ``code`` (after PRELUDE) under TRITON_INTERPRET=1; it prints one JSON line last."""
    env = dict(os.environ, TRITON_INTERPRET="1", ROOT=ROOT, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], capture_output=True, text=True,
                         env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _pick(r: int):
    """(states [n, K, V] float64, names) of PICKS[r] from hard_states(r, seed=r)."""
    S, names = hard_states(r, seed=r)
    idx = [[i for i, nm in enumerate(names) if nm == name][k] for name, k in PICKS[r]]
    return S[idx], [f"{names[i]}#{k}" for i, (_, k) in zip(idx, PICKS[r])]


# ------------------------------------------------------------------------------------- interpreted kernel
@pytest.fixture(scope="module")
def interpreted_batteries():
    """The interpreted kernel on PICKS (float64 states, one launch per rank, the rank as a host int)."""
    return _interpret(f'''
        picks = {PICKS!r}
        res = {{}}
        for r, wanted in picks.items():
            S, names = hard_states(r, seed=r)
            idx = [[i for i, nm in enumerate(names) if nm == name][k] for name, k in wanted]
            S = S[idx]
            t = time.time()
            out = ft.truncate_fused(S, r)
            secs = time.time() - t
            ref = ft.reference_fused(S, torch.full((len(idx),), r))
            res[r] = dict(
                err=energy_error(S, out, r).tolist(),
                wrong_rank_err=energy_error(S, out, r + 1).tolist(),  # the same output judged at rank r + 1
                vs_reference=(retained_energy(S, out) - retained_energy(S, ref)).abs().max().item(),
                finite=bool(torch.isfinite(out).all()),
                dtype_ok=out.dtype == S.dtype and out.shape == S.shape,
                seconds=round(secs, 1),
                **projection(S, out, r),
            )
        print(json.dumps(res))
    ''')


def test_interpreted_energy_within_tolerance(interpreted_batteries):
    for r, m in interpreted_batteries.items():
        assert m["finite"] and m["dtype_ok"], (r, m)
        assert max(m["err"]) <= TOL, (r, m)
        # the kernel computes what its float64 torch mirror computes (which meets 1e-5 on every battery state)
        assert m["vs_reference"] <= 1e-12, (r, m)


def test_interpreted_output_is_a_projection(interpreted_batteries):
    for r, m in interpreted_batteries.items():
        assert m["orth"] <= 1e-10, (r, m)  # S_rᵀ (S − S_r) = 0
        assert m["tail"] <= 1e-10, (r, m)  # rank(S_r) ≤ r
        assert m["grow"] <= 1e-12, (r, m)  # ‖S_r‖ ≤ ‖S‖


def test_the_energy_check_has_teeth(interpreted_batteries):
    """Judged at the wrong rank (r + 1), the same outputs miss the tolerance by far: the check can fail."""
    worst = {r: max(m["wrong_rank_err"]) for r, m in interpreted_batteries.items()}
    assert all(w > 100 * TOL for w in worst.values()), worst


def test_interpreted_mixed_ranks_in_one_launch():
    """float32 states with per-state ranks (a CPU tensor: the kernel reads each rank from memory), among them a zero
    state (r = 20: two passes), a state kept unchanged (r = 128) and r = 1 / 4 / 12."""
    res = _interpret('''
        S4, n4 = hard_states(4, seed=4)
        S12, n12 = hard_states(12, seed=12)
        S = torch.stack([S12[n12.index("toy_gdn")], S4[n4.index("gdn_like")], torch.zeros(128, 128, dtype=F64),
                         S12[n12.index("clustered")], S4[n4.index("lowrank_noise")]]).float()
        ranks = torch.tensor([1, 12, 20, 128, 4])
        out = ft.truncate_fused(S, ranks)
        R, nr = hard_states(12, K=64, V=128, seed=30)
        R = R[[nr.index("toy_gdn")]]  # K = 64: the kernel's other tile size
        ref = ft.reference_fused(S, ranks).float()
        S64, o64 = S.double(), out.double()
        print(json.dumps(dict(
            dtype_ok=out.dtype == torch.float32 and out.shape == S.shape,
            err=energy_error(S64, o64, ranks.tolist()).tolist(),
            zero=bool((out[2] == 0).all()),
            kept=bool(torch.equal(out[3], S[3])),
            vs_reference=(retained_energy(S64, o64) - retained_energy(S64, ref.double())).abs().max().item(),
            finite=bool(torch.isfinite(out).all()),
            same_as_single=bool(torch.equal(ft.truncate_fused(S[4:5], 4), out[4:5])),
            rect_err=energy_error(R, ft.truncate_fused(R, 12), 12).max().item(),
        )))
    ''')
    assert res["dtype_ok"] and res["finite"], res
    assert max(res["err"]) <= TOL, res
    assert res["zero"] and res["kept"], res
    assert res["vs_reference"] <= 1e-6, res  # float32 output: rounding
    assert res["same_as_single"], res  # a state's answer does not depend on its neighbours or on the rank path
    assert res["rect_err"] <= TOL, res


@pytest.mark.parametrize("K,V,r", [(128, 64, 4), (128, 64, 32), (64, 128, 1), (64, 128, 20), (64, 64, 12)])
def test_reference_rectangular_states(K, V, r):
    from gdnviz.gpu.fused_truncate import reference_fused

    S, names = hard_states(r, K=K, V=V, seed=10 + r)
    err = energy_error(S, reference_fused(S, torch.full((S.shape[0],), r)), r)
    assert err.max() <= TOL, [(names[i], err[i].item()) for i in range(len(names)) if err[i] > TOL]


# --------------------------------------------------------------------------- float64 mirror, every state
@pytest.mark.parametrize("r", [1, 2, 4, 12, 16, 17, 20, 32])
def test_reference_meets_the_tolerance_on_every_battery_state(r):
    """reference_fused — the kernel's algorithm in torch (pinned to the kernel above) — on all of hard_states."""
    from gdnviz.gpu.fused_truncate import reference_fused

    S, names = hard_states(r, seed=r)
    out = reference_fused(S, torch.full((S.shape[0],), r))
    err = energy_error(S, out, r)
    bad = [(names[i], f"{err[i].item():.1e}") for i in range(len(names)) if not err[i] <= TOL]
    assert not bad, bad
    assert torch.equal(out[names.index("zero")], torch.zeros_like(S[0]))
    # and as good as truncate_states (same start matrices and iteration counts; one Cholesky-QR at the start
    # instead of two, so not the same rounding): both far below the tolerance, within 1e-7 of each other
    ref_err = energy_error(S, truncate_states(S, r), r)
    assert (err - ref_err).abs().max() <= 1e-7


def test_checked_cholqr_leaves_only_orthonormal_blocks_as_they_are():
    """The pairs' checked Cholesky-QR (``checked_cholqr``; the CUDA kernel's ``cholqr(..., check)``, the Triton
    kernel's ``_checked_cholqr``): a block whose shifted Gram matrix is within ORTH_TOL of the identity comes back
    bit for bit, any other is factorised (``gdnviz.truncate._cholqr``) bit for bit; only the leading ``check``
    columns are tested, per state; ``check = 0`` always factorises. Teeth: the factorisation moves an orthonormal
    block (so a skip is visible), by less than ORTH_TOL."""
    from gdnviz import truncate as tr
    from gdnviz.gpu import fused_truncate as ft

    g = torch.Generator().manual_seed(3)
    Z = torch.randn(3, 128, 32, generator=g, dtype=F64)
    Q = tr._cholqr(tr._cholqr(Z))  # orthonormal to ~1e-13 (the shift)
    assert not torch.equal(tr._cholqr(Q), Q) and (tr._cholqr(Q) - Q).abs().max().item() < ft.ORTH_TOL
    assert torch.equal(ft.checked_cholqr(Q, 32), Q)
    assert torch.equal(ft.checked_cholqr(Q, 0), tr._cholqr(Q))
    assert torch.equal(ft.checked_cholqr(Z, 32), tr._cholqr(Z))
    X = torch.cat([Q[:1], Z[:1], Q[2:]])  # per state: kept, factorised, kept
    got = ft.checked_cholqr(X, 32)
    assert torch.equal(got[0], Q[0]) and torch.equal(got[1], tr._cholqr(Z[:1])[0]) and torch.equal(got[2], Q[2])
    # only the leading columns count: U of a rank-20 state (columns 20 … 31 zero) is orthonormal where it matters
    U = Q.clone()
    U[..., 20:] = 0.0
    assert torch.equal(ft.checked_cholqr(U, 20), U)
    assert torch.equal(ft.checked_cholqr(U, torch.tensor([20, 32, 20])), torch.stack([U[0], tr._cholqr(U)[1], U[2]]))
    # just outside the tolerance: factorised
    W = Q.clone()
    W[:, :, 0] *= 1.0 + 2 * ft.ORTH_TOL
    assert torch.equal(ft.checked_cholqr(W, 32), tr._cholqr(W))
    Wn = Q.clone()
    Wn[0, 5, 3] = float("nan")
    assert torch.isnan(ft.checked_cholqr(Wn, 32)[0]).all()  # a NaN is never orthonormal: factorised (all NaN)


def test_checked_cholqr_tolerance_is_the_kernels():
    """The CUDA source's ORTH_TOL is the one reference_fused and the Triton kernel use."""
    import re

    from gdnviz.gpu import cuda_truncate
    from gdnviz.gpu import fused_truncate as ft

    src = cuda_truncate.source(128, 128)
    assert float(re.search(r"#define ORTH_TOL (\S+)", src).group(1)) == ft.ORTH_TOL
    assert ft._launch_constexprs(128, 128, False)["ORTH"] == ft.ORTH_TOL


def test_reference_unconverged_fails():
    """With 0 filter steps the same algorithm misses the tolerance: the iteration counts are load-bearing."""
    from gdnviz.gpu.fused_truncate import reference_fused

    S, _ = hard_states(12, seed=12)
    err = energy_error(S, reference_fused(S, torch.full((S.shape[0],), 12), iters=0), 12)
    assert err.max() > 10 * TOL


def test_cpu_without_interpreter_uses_the_reference():
    from gdnviz.gpu import fused_truncate as ft

    if ft._INTERPRET:  # pragma: no cover
        pytest.skip("TRITON_INTERPRET is set for this process")
    S, _ = hard_states(4, seed=21)
    S = S[:6].float().reshape(2, 3, 128, 128)
    assert not ft.uses_kernel(S)
    ranks = [1, 4, 32, 128, 12, 2]
    out = ft.truncate_fused(S, ranks)
    assert out.shape == S.shape and out.dtype == S.dtype
    ref = ft.reference_fused(S.reshape(6, 128, 128), torch.tensor(ranks)).float().reshape(S.shape)
    assert torch.equal(out, ref)
    assert torch.equal(out[1, 0], S[1, 0])  # r = 128 ≥ min(K, V): unchanged
    assert torch.equal(ft.truncate_fused(S, 128), S)


def test_validation():
    from gdnviz.gpu.fused_truncate import truncate_fused

    S = torch.randn(3, 128, 128)
    for bad in (0, 33, 127, -1, 2.5, True, "3"):
        with pytest.raises(ValueError):
            truncate_fused(S, bad)
    with pytest.raises(ValueError, match="state 1"):
        truncate_fused(S, [4, 40, 4])
    with pytest.raises(ValueError, match="one entry per state"):
        truncate_fused(S, [4, 4])
    with pytest.raises(ValueError, match="K, V"):
        truncate_fused(torch.randn(2, 96, 128), 4)
    with pytest.raises(ValueError, match="K, V"):
        truncate_fused(torch.randn(2, 128, 32), 4)
    with pytest.raises(ValueError, match="float"):
        truncate_fused(torch.ones(2, 64, 64, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="iters"):
        truncate_fused(S, 4, iters=-1)
    with pytest.raises(ValueError):
        truncate_fused(torch.randn(128, 128), 4)
    assert truncate_fused(torch.zeros(0, 64, 64), 4).shape == (0, 64, 64)


@pytest.mark.slow
def test_kernel_compiles_for_the_h200():
    """The kernel lowers to an sm_90a cubin (Triton compiles without a GPU), fits the H200's 227 KiB of shared memory
    per block, does its matrix products as float64 tensor-core MMA (no TF32 anywhere), and uses IEEE-rounded float64
    divisions and square roots."""
    import re

    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gdnviz.gpu import fused_truncate as ft

    if ft._INTERPRET:  # pragma: no cover
        pytest.skip("TRITON_INTERPRET is set for this process")
    sig = {"S": "*fp32", "OUT": "*fp32", "RANKS": "*i64", "rank": "i32", "rank_stride": "i32", "OMEGA": "*fp64",
           "FILLDIR": "*fp64", "ITER_TAB": "*i32", "iters": "i32"}
    consts = ft._launch_constexprs(128, 128, rank_ptr=True)
    sig.update({k: "constexpr" for k in consts})
    kernel = triton.compile(ASTSource(fn=ft._fused_kernel, signature=sig, constexprs=consts),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": ft._NUM_WARPS})
    ptx = kernel.asm["ptx"]
    assert kernel.asm["cubin"]
    assert kernel.metadata.shared <= 227 * 1024
    assert re.search(r"mma\.sync\.aligned\.m\d+n\d+k\d+\.row\.col\.f64\.f64\.f64\.f64", ptx)
    assert "tf32" not in ptx
    assert "div.rn.f64" in ptx and "sqrt.rn.f64" in ptx and ".approx" not in ptx


# ------------------------------------------------------------------------------------------------- CUDA
def _gdn_batch(n: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    from bench.bench_truncate import gdn_like_states

    return gdn_like_states(n, 128, 128, seed=seed).to(device="cuda", dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("r", [1, 4, 12, 16, 17, 32])
def test_cuda_full_batches_match_exact(r):
    """288 GDN-like float32 states (one boundary) and the float64 hard battery: energy within 1e-5 of the exact
    truncation, and as good as truncate_states."""
    from gdnviz.gpu.fused_truncate import truncate_fused

    S = _gdn_batch(288, seed=r)
    out = truncate_fused(S, r)
    assert out.dtype == S.dtype and out.shape == S.shape and out.is_cuda
    err = energy_error(S.double().cpu(), out.double().cpu(), r)
    assert err.max().item() <= TOL, err.max().item()
    exact = exact_truncate(S.double(), r)
    assert (retained_energy(S, out) - retained_energy(S, exact)).abs().max().item() <= TOL
    H, names = hard_states(r, seed=r)
    Hc = H.cuda()
    outh = truncate_fused(Hc, r).cpu()
    errh = energy_error(H, outh, r)
    assert errh.max().item() <= TOL, [(names[i], errh[i].item()) for i in range(len(names)) if errh[i] > TOL]
    ref = energy_error(H, truncate_states(Hc, r).cpu(), r)
    # as good as truncate_states to 1e-7, except where a certified attempt's answer stands (its bound ≤ 5e-6)
    from gdnviz.gpu import cuda_truncate

    cert = (cuda_truncate._launch(Hc, r, None).done.cpu().bool() if cuda_truncate.enabled()
            else torch.zeros(len(names), dtype=torch.bool))
    if cert.numel() == 0:
        cert = torch.zeros(len(names), dtype=torch.bool)
    d = (errh - ref).abs()[~cert]
    assert d.numel() == 0 or d.max().item() <= 1e-7
    assert (errh[cert] <= cuda_truncate.CERT_TOL + 1e-12).all()
    assert torch.equal(outh[names.index("zero")], torch.zeros_like(H[0]))


@pytest.mark.gpu
def test_cuda_mixed_ranks_from_a_device_tensor():
    from gdnviz.gpu.fused_truncate import truncate_fused

    S = _gdn_batch(288, seed=40, dtype=torch.float64)
    choices = [1, 2, 4, 12, 16, 17, 32, 128, 500]
    ranks = [choices[i % len(choices)] for i in range(288)]
    out = truncate_fused(S, torch.tensor(ranks, device="cuda"))
    assert (energy_error(S.cpu(), out.cpu(), ranks) <= TOL).all()
    keep = torch.tensor([r >= 128 for r in ranks], device="cuda")
    assert torch.equal(out[keep], S[keep])
    assert torch.equal(out, truncate_fused(S, ranks))  # the host list and the device tensor: same kernel, same bits
    # a device-side rank the host cannot validate (0, 40) gives NaN for that state only
    bad = torch.tensor([4, 0, 40, 4], device="cuda")
    o = truncate_fused(S[:4], bad)
    assert torch.isnan(o[1]).all() and torch.isnan(o[2]).all() and torch.isfinite(o[[0, 3]]).all()


@pytest.mark.gpu
def test_cuda_no_host_sync():
    from gdnviz.gpu.fused_truncate import truncate_fused

    S = _gdn_batch(16, seed=41)
    ranks = torch.tensor([1, 4, 12, 32] * 4, device="cuda", dtype=torch.int32)
    for rk in (ranks, 4, 20):
        truncate_fused(S, rk)  # warm-up: compiles, caches the constants on the device
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = truncate_fused(S, rk)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        r = rk.tolist() if isinstance(rk, torch.Tensor) else rk
        assert energy_error(S.double().cpu(), out.double().cpu(), r).max().item() <= TOL


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    """One layer boundary (16 states, per-state ranks on the device) captured in a CUDA graph; replays on new data
    copied into the static input equal eager calls."""
    from tests.support.cuda_graph import capture
    from gdnviz.gpu.fused_truncate import truncate_fused

    S1, S2 = _gdn_batch(16, seed=42), _gdn_batch(16, seed=43)
    ranks = torch.tensor([1, 4, 12, 32] * 4, device="cuda")
    static_in = S1.clone()
    graph, static_out = capture(truncate_fused, static_in, ranks)
    for S in (S1, S2):
        static_in.copy_(S)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, truncate_fused(S, ranks))  # same kernel, same inputs: same bits
    assert not torch.equal(truncate_fused(S1, ranks), truncate_fused(S2, ranks))


@pytest.mark.parametrize("fused", [True, False])
def test_graph_boundary_function_every_head_equals_the_gather_path(fused):
    """``intervene._graph_truncation``: with every head of every row cut it skips the gather / scatter; the result
    equals the gathered path (``rows`` given) bit for bit, equals each head truncated alone, and a subset of heads
    leaves the other heads' bits untouched."""
    from gdnviz.gpu.fused_truncate import truncate_fused
    from gdnviz.truncation import _graph_truncation

    S, _ = hard_states(4, seed=23)
    S = S[:8].float().reshape(2, 4, 128, 128)
    one = (lambda x, r: truncate_fused(x, r)) if fused else (lambda x, r: truncate_states(x, r, method="subspace"))
    fn = _graph_truncation(torch.arange(4), 4, fused=fused)
    fast = fn(S)
    assert torch.equal(fast, fn(S, rows=torch.arange(2)))  # rows given: the gather / scatter path
    assert torch.equal(fast, one(S.reshape(8, 128, 128), 4).reshape(S.shape))
    assert energy_error(S.double().reshape(8, 128, 128), fast.double().reshape(8, 128, 128), 4).max() <= 1e-5
    part = _graph_truncation(torch.tensor([1, 3]), 4, fused=fused)(S)
    assert torch.equal(part[:, 0], S[:, 0]) and torch.equal(part[:, 2], S[:, 2])
    assert not torch.equal(part[:, 1], S[:, 1])
    if fused:  # per-head ranks as a tensor, repeated over the batch rows
        rk = torch.tensor([1, 4, 12, 32])
        out = _graph_truncation(torch.arange(4), rk, fused=True)(S)
        assert torch.equal(out, truncate_fused(S.reshape(8, 128, 128), rk.repeat(2)).reshape(S.shape))
