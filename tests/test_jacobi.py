"""The Triton batched Jacobi eigensolver (gdnviz.gpu.jacobi) pinned to float64 torch.linalg.eigh.

On CPU the kernel runs under TRITON_INTERPRET=1 in a subprocess (the variable must be set before triton is
imported), a few small matrices per case: the interpreter needs ~1 s per sweep of a 32×32 matrix. On CUDA
(``@pytest.mark.gpu``) it runs compiled on full batches, and the truncation that uses it is checked for host syncs
and CUDA-graph capture.

Criteria (relative to ‖A‖_F): eigenvalues within 1e-13; ‖VᵀV − I‖_F ≤ 1e-12; ‖AV − VΛ‖_F ≤ 1e-12; eigenvectors by
Davis–Kahan: for every cluster of eigenvalues (consecutive gaps < 1e-10·‖A‖) at a distance g from the rest of the
spectrum, the column (up to sign) or the cluster's projector differs from eigh's by ≤ 1e-13·‖A‖/g.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HELPERS = textwrap.dedent('''
    import math
    import torch
    F64 = torch.float64

    def spectral(lam, seed):
        """U diag(lam) Uᵀ with Haar-random U, for lam [B, n]."""
        g = torch.Generator().manual_seed(seed)
        B, n = lam.shape
        q, r = torch.linalg.qr(torch.randn(B, n, n, generator=g, dtype=F64))
        U = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]
        return (U * lam[:, None, :]) @ U.mT

    def random_symmetric(B, n, seed):
        g = torch.Generator().manual_seed(seed)
        X = torch.randn(B, n, n, generator=g, dtype=F64)
        return (X + X.mT) / 2

    def gram_like(B, n, seed, decades=8.0):
        """PSD X Xᵀ, X = U diag(σ) Wᵀ [n, 2n], σ log-uniform over `decades` decades: eigenvalues 1..10^(−2·decades)."""
        g = torch.Generator().manual_seed(seed)
        U = torch.linalg.qr(torch.randn(B, n, n, generator=g, dtype=F64))[0]
        W = torch.linalg.qr(torch.randn(B, 2 * n, n, generator=g, dtype=F64))[0]
        s = 10.0 ** (-decades * torch.rand(B, n, generator=g, dtype=F64))
        s[:, 0] = 1.0
        s[:, -1] = 10.0 ** -decades
        X = (U * s[:, None, :]) @ W.mT
        return X @ X.mT

    def check(A, w, V):
        """Worst errors of (w, V) against torch.linalg.eigh(A) over a batch [B, n, n] (see the module docstring)."""
        A, w, V = A.double().cpu(), w.double().cpu(), V.double().cpu()
        wr, Vr = torch.linalg.eigh(A)
        B, n = A.shape[0], A.shape[-1]
        nrm = A.norm(dim=(-2, -1)).clamp_min(1e-300)
        eye = torch.eye(n, dtype=F64)
        vec = 0.0
        for b in range(B):
            lam, s = wr[b].tolist(), nrm[b].item()
            cuts = [0] + [i + 1 for i in range(n - 1) if lam[i + 1] - lam[i] >= 1e-10 * s] + [n]
            for lo, hi in zip(cuts[:-1], cuts[1:]):
                gap = min(lam[lo] - lam[lo - 1] if lo > 0 else math.inf, lam[hi] - lam[hi - 1] if hi < n else math.inf)
                if gap == math.inf:  # one cluster holds the whole spectrum: any basis is right
                    continue
                if hi - lo == 1:
                    v, vr = V[b, :, lo], Vr[b, :, lo]
                    dist = min((v - vr).norm().item(), (v + vr).norm().item())
                else:
                    P, Pr = V[b, :, lo:hi] @ V[b, :, lo:hi].mT, Vr[b, :, lo:hi] @ Vr[b, :, lo:hi].mT
                    dist = (P - Pr).norm().item()
                vec = max(vec, dist * gap / s)
        return dict(
            eig=((w - wr).abs().amax(-1) / nrm).max().item(),
            orth=(V.mT @ V - eye).norm(dim=(-2, -1)).max().item(),
            res=((A @ V - V * w[:, None, :]).norm(dim=(-2, -1)) / nrm).max().item(),
            vec=vec,
            ascending=bool((w.diff(dim=-1) >= 0).all()),
            finite=bool(torch.isfinite(w).all() and torch.isfinite(V).all()),
        )
''')

PRELUDE = textwrap.dedent('''
    import json, os, sys, time
    sys.path.insert(0, os.environ["ROOT"])
    import torch
    torch.set_num_threads(1)
    from gdnviz.gpu import jacobi
    assert jacobi.uses_kernel(torch.zeros(1, 2, 2, dtype=torch.float64)), "the interpreter is not on"
''') + HELPERS


def _interpret(*parts: str) -> dict:
    """Run the code ``parts`` (after PRELUDE) under TRITON_INTERPRET=1; the last one prints one JSON line last."""
    code = PRELUDE + "".join(textwrap.dedent(p) for p in parts)
    env = dict(os.environ, TRITON_INTERPRET="1", ROOT=ROOT, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _assert_accurate(res: dict):
    from gdnviz.gpu.jacobi import MAX_SWEEPS

    for case, m in res.items():
        assert m["finite"] and m["ascending"], (case, m)
        assert m["eig"] <= 1e-13, (case, m)
        assert m["orth"] <= 1e-12, (case, m)
        assert m["res"] <= 1e-12, (case, m)
        assert m["vec"] <= 1e-13, (case, m)
        assert m["shape_ok"], (case, m)
        assert 0 <= min(m["sweeps"]) and max(m["sweeps"]) <= MAX_SWEEPS, (case, m)


RUN_CASES = '''
    res = {}
    for name, A in cases.items():
        t = time.time()
        w, V, sw = jacobi.eigh_jacobi(A, return_sweeps=True)
        res[name] = dict(check(A, w, V), sweeps=sw.tolist(), seconds=round(time.time() - t, 2),
                         shape_ok=(w.shape == A.shape[:-1] and V.shape == A.shape and w.dtype == A.dtype))
    print(json.dumps(res))
'''


def test_interpreted_random_small_sizes():
    """n = 1, 2, 3, 17 (padded to 32) and 32: random symmetric, two matrices each."""
    res = _interpret('''
        cases = {f"random n={n}": random_symmetric(2, n, seed=n) for n in (1, 2, 3, 17, 32)}
    ''', RUN_CASES)
    _assert_accurate(res)
    assert res["random n=1"]["sweeps"] == [0, 0]


@pytest.mark.slow
def test_interpreted_random_large_sizes():
    """n = 48 (padded to 64) and 64, two matrices each (~5 s a matrix in the interpreter)."""
    res = _interpret('''
        cases = {f"random n={n}": random_symmetric(2, n, seed=n) for n in (48, 64)}
    ''', RUN_CASES)
    _assert_accurate(res)


def test_interpreted_hard_spectra():
    """PSD with eigenvalues over 1e0..1e-16 (condition number 1e16), Gram-like X Xᵀ, repeated and clustered."""
    res = _interpret('''
        r32 = torch.arange(32, dtype=F64)
        r16 = torch.arange(16, dtype=F64)
        cases = {
            # geometric 1 .. 1e-16 in a random basis: Jacobi's slowest case here (~14 sweeps)
            "psd cond 1e16 n=32": spectral((10.0 ** (-16 * r32 / 31))[None], seed=1),
            "gram-like cond 1e16 n=16": gram_like(2, 16, seed=2),
            "repeated n=16": spectral(torch.tensor([[1.0] * 6 + [0.5] * 6 + [0.0] * 4,
                                                    [2.0] * 15 + [-1.0]], dtype=F64), seed=3),
            "clustered n=16": spectral(torch.stack([torch.where(r16 < 8, 1.0 + 1e-12 * r16, 1e-3 * (r16 - 7)),
                                                    1.0 + 1e-9 * r16]), seed=4),
        }
    ''', RUN_CASES)
    _assert_accurate(res)


def test_interpreted_special_inputs():
    """Zero, diagonal (sorted, unsorted, with ties), identity, lower triangle only, batch dims, float32, empty batch;
    and the NumPy replica (bench/jacobi_replica.py) equals the interpreted kernel bit for bit."""
    res = _interpret('''
        from bench.jacobi_replica import jacobi as replica
        g = torch.Generator().manual_seed(0)
        out = {}
        # zero matrix: eigenvalues 0, V = I, no sweep
        w, V, sw = jacobi.eigh_jacobi(torch.zeros(2, 32, 32, dtype=F64), return_sweeps=True)
        out["zero"] = bool((w == 0).all() and (V == torch.eye(32, dtype=F64)).all() and (sw == 0).all())
        # diagonal, unsorted, with ties, n = 17 and 32: exact sorted diagonal, V an exact permutation, no sweep
        ok = True
        for n in (17, 32):
            d = torch.randint(-4, 5, (2, n), generator=g).to(F64) * 0.25  # many ties
            w, V, sw = jacobi.eigh_jacobi(torch.diag_embed(d), return_sweeps=True)
            srt, perm = torch.sort(d, dim=-1, stable=True)
            ok &= bool((w == srt).all() and (sw == 0).all())
            ok &= bool((V == torch.eye(n, dtype=F64)[:, perm].permute(1, 0, 2)).all())  # V[:, :, j] = e_perm[j]
        out["diagonal"] = ok
        w, V, sw = jacobi.eigh_jacobi(torch.eye(5, dtype=F64).expand(3, 5, 5), return_sweeps=True)
        out["identity"] = bool((w == 1).all() and (V == torch.eye(5, dtype=F64)).all() and (sw == 0).all())
        # only the lower triangle is read, like torch.linalg.eigh (UPLO="L")
        A = random_symmetric(2, 12, seed=5)
        junk = A + torch.triu(torch.randn(2, 12, 12, generator=g, dtype=F64), diagonal=1)
        w, V = jacobi.eigh_jacobi(junk)
        out["lower"] = check(A, w, V)
        # leading batch dims and float32 in -> float32 out
        A = random_symmetric(6, 5, seed=6).reshape(2, 3, 5, 5)
        w, V = jacobi.eigh_jacobi(A.float())
        m = check(A.reshape(6, 5, 5), w.reshape(6, 5).double(), V.reshape(6, 5, 5).double())
        out["batch_float32"] = dict(m, shape_ok=(w.shape == (2, 3, 5) and V.shape == (2, 3, 5, 5)
                                                 and w.dtype == V.dtype == torch.float32))
        w, V = jacobi.eigh_jacobi(torch.zeros(0, 7, 7, dtype=F64))
        out["empty"] = w.shape == (0, 7) and V.shape == (0, 7, 7)
        # sweeps: a cap is obeyed, and 0 sweeps returns the sorted diagonal
        A = random_symmetric(1, 8, seed=7)
        _, _, sw = jacobi.eigh_jacobi(A, sweeps=2, return_sweeps=True)
        w0, _, sw0 = jacobi.eigh_jacobi(A, sweeps=0, return_sweeps=True)
        diag_sorted = A.diagonal(dim1=-2, dim2=-1).sort().values
        out["sweeps"] = bool(sw.item() == 2 and sw0.item() == 0 and (w0 == diag_sorted).all())
        # the replica reproduces the kernel bit for bit (eigenvalues, vectors, sweep counts)
        same = True
        for A in (random_symmetric(1, 12, seed=8), gram_like(1, 5, seed=9)):
            w, V, sw = jacobi.eigh_jacobi(A, return_sweeps=True)
            rw, rV, rsw, _ = replica(A[0].numpy())
            same &= bool((w[0].numpy() == rw).all() and (V[0].numpy() == rV).all() and sw.item() == rsw)
        out["replica"] = same
        print(json.dumps(out))
    ''')
    for key in ("zero", "diagonal", "identity", "empty", "sweeps", "replica"):
        assert res[key] is True, key
    for key in ("lower", "batch_float32"):
        m = res[key]
        tol = 1e-5 if key == "batch_float32" else 1e-13  # float32 output: rounding of the results
        assert m["finite"] and m["ascending"] and m["eig"] <= tol and m["res"] <= 100 * tol, (key, m)
    assert res["batch_float32"]["shape_ok"]


def test_interpreted_truncation_matches_eigh():
    """truncate_states(method="subspace") with the Jacobi Ritz step (interpreted) equals the torch.linalg.eigh one."""
    res = _interpret('''
        sys.path.insert(0, os.path.join(os.environ["ROOT"], "tests"))
        import gdnviz.truncate as tr
        from bench.bench_truncate import gdn_like_spectra
        from test_truncate import _from_spectra
        K = 64
        sig = gdn_like_spectra(2, K, torch.Generator().manual_seed(3))
        sig = torch.cat([sig, torch.where(torch.arange(K) < 3, 1.0, 0.0).to(F64)[None]])  # rank 3
        S = torch.cat([_from_spectra(sig, K, K, 7), torch.zeros(1, K, K, dtype=F64)])
        calls = []
        kernel = jacobi.eigh_jacobi
        def counting(T, sweeps=None):
            assert jacobi.uses_kernel(T)
            w, V, sw = kernel(T, sweeps, return_sweeps=True)
            calls.append(sw.tolist())
            return w, V
        jacobi.eigh_jacobi = counting
        out = {}
        for r in (4, 20):
            calls.clear()
            ours = tr.truncate_states(S, r, method="subspace")
            n_calls = len(calls)
            eigh = tr._eigh_small
            tr._eigh_small = torch.linalg.eigh
            try:
                ref = tr.truncate_states(S, r, method="subspace")
            finally:
                tr._eigh_small = eigh
            e = (tr.retained_energy(S, ours) - tr.retained_energy(S, ref)).abs().max().item()
            s2 = torch.linalg.svdvals(S).square()
            sep = (s2[:, r - 1] - s2[:, r]) > 1e-3 * s2.sum(-1)  # a gap at r: the truncation is unique
            nS = S.norm(dim=(-2, -1)).clamp_min(1e-300)
            dist = ((ours - ref).norm(dim=(-2, -1)) / nS)[sep].max().item()
            err = tr.energy_error(S, ours, r).max().item()
            out[r] = dict(calls=n_calls, sweeps=list(calls), energy_diff=e, dist=dist, n_sep=int(sep.sum()),
                          energy_error=err)
        print(json.dumps(out))
    ''')
    for r, m in res.items():
        assert m["calls"] == (1 if int(r) <= 16 else 2), (r, m)  # one Rayleigh–Ritz step per pass, all in the kernel
        assert m["energy_diff"] <= 1e-12, (r, m)
        assert m["n_sep"] >= 1 and m["dist"] <= 1e-9, (r, m)
        assert m["energy_error"] <= 1e-5, (r, m)


def test_cpu_does_not_use_the_kernel():
    """Without the interpreter, CPU tensors go to torch.linalg.eigh (the library never interprets Triton)."""
    from gdnviz.gpu import jacobi

    if jacobi._INTERPRET:  # pragma: no cover - the whole run is under TRITON_INTERPRET=1
        pytest.skip("TRITON_INTERPRET is set for this process")
    A = torch.randn(3, 6, 6, dtype=torch.float64)
    A = A + A.mT
    assert not jacobi.uses_kernel(A)
    w, V, sw = jacobi.eigh_jacobi(A, return_sweeps=True)
    wr, Vr = torch.linalg.eigh(A)
    assert torch.equal(w, wr) and torch.equal(V, Vr) and (sw == -1).all()
    with pytest.raises(ValueError):
        jacobi.eigh_jacobi(torch.zeros(2, 3, 4))


# ------------------------------------------------------------------------------------------------- CUDA
def _helpers() -> dict:
    ns: dict = {}
    exec(HELPERS, ns)
    return ns


@pytest.mark.gpu
def test_cuda_matches_eigh():
    """Compiled kernel vs torch.linalg.eigh: 288 random 32×32 PSD matrices (the truncation's batch), a graded
    batch, and every padded size P = 2 … 64 (each P is its own compiled kernel with its own num_warps)."""
    from gdnviz.gpu.jacobi import MAX_SWEEPS, eigh_jacobi

    h = _helpers()
    g = torch.Generator().manual_seed(0)
    X = torch.randn(288, 32, 48, generator=g, dtype=torch.float64)
    cases = {
        "psd 288×32": X @ X.mT,
        "gram-like 288×32": h["gram_like"](288, 32, seed=1),
        "psd cond 1e16": h["spectral"]((10.0 ** (-16 * torch.arange(32.0, dtype=torch.float64) / 31)).expand(64, 32),
                                       seed=2),
        "zero": torch.zeros(8, 32, 32, dtype=torch.float64),
    }
    for n in (1, 2, 3, 5, 16, 17, 48, 64):
        cases[f"random n={n}"] = h["random_symmetric"](64, n, seed=n)
    for name, A in cases.items():
        w, V, sw = eigh_jacobi(A.cuda(), return_sweeps=True)
        assert w.is_cuda and V.is_cuda and w.shape == A.shape[:-1] and V.shape == A.shape, name
        m = h["check"](A, w, V)
        assert m["finite"] and m["ascending"], (name, m)
        assert m["eig"] <= 1e-13 and m["orth"] <= 1e-12 and m["res"] <= 1e-12 and m["vec"] <= 1e-13, (name, m)
        assert 0 <= sw.min().item() and sw.max().item() <= MAX_SWEEPS, name


def _cuda_states(n: int = 288, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    sys.path.insert(0, ROOT)
    from bench.bench_truncate import gdn_like_spectra

    g = torch.Generator().manual_seed(seed)
    K = 128
    s = gdn_like_spectra(n, K, g)
    U = torch.linalg.qr(torch.randn(n, K, K, generator=g, dtype=torch.float64))[0]
    W = torch.linalg.qr(torch.randn(n, K, K, generator=g, dtype=torch.float64))[0]
    return ((U * s[:, None, :]) @ W.mT).to(device="cuda", dtype=dtype)


@pytest.mark.gpu
def test_cuda_truncation_has_no_host_sync_and_matches_eigh():
    import gdnviz.truncate as tr

    for dtype in (torch.float32, torch.float64):
        S = _cuda_states(dtype=dtype)
        for r in (4, 20):  # one and two subspace passes
            tr.truncate_states(S, r)  # warm-up: compiles the kernel, caches the start matrices on the device
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                out = tr.truncate_states(S, r)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
            assert tr.energy_error(S, out, r).max().item() <= 2e-5  # float32 states: rounding of the output
            if dtype == torch.float64:  # the same as with torch.linalg.eigh, to rounding
                eigh = tr._eigh_small
                tr._eigh_small = torch.linalg.eigh
                try:
                    ref = tr.truncate_states(S, r)
                finally:
                    tr._eigh_small = eigh
                diff = (tr.retained_energy(S, out) - tr.retained_energy(S, ref)).abs().max().item()
                assert diff <= 1e-12, (r, diff)


@pytest.mark.gpu
def test_cuda_truncation_can_be_captured_in_a_graph():
    from tests.support.cuda_graph import capture
    from gdnviz.truncate import retained_energy, truncate_states

    r = 4
    S1 = _cuda_states(seed=1, dtype=torch.float64)
    S2 = _cuda_states(seed=2, dtype=torch.float64)
    static_in = S1.clone()
    graph, static_out = capture(truncate_states, static_in, r)  # warm-up on a side stream, then record
    for S in (S1, S2):  # replay on the captured input, then on new data copied into it
        static_in.copy_(S)
        graph.replay()
        torch.cuda.synchronize()
        eager = truncate_states(S, r)
        scale = S.abs().max().item()
        assert (static_out - eager).abs().max().item() <= 1e-10 * scale
        assert (retained_energy(S, static_out) - retained_energy(S, eager)).abs().max().item() <= 1e-12
    # the two inputs give different outputs, so the second replay matching eager(S2) shows it really recomputed
    assert not torch.equal(truncate_states(S1, r), truncate_states(S2, r))


@pytest.mark.parametrize("n", [1, 3, 5, 16, 32, 48])  # padded sizes P = 2, 4, 8, 16, 32, 64
def test_kernel_compiles_for_the_h200(n):
    """The compiled path lowers to an sm_90a cubin for every padded size with its num_warps — Triton compiles
    without a GPU, so lowering failures (e.g. of ``tl.gather`` layouts) show up here — and its float64 divisions and
    square roots are the IEEE-rounded ones (``.rn``), not approximations."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gdnviz.gpu import jacobi

    if jacobi._INTERPRET:  # pragma: no cover
        pytest.skip("TRITON_INTERPRET is set for this process")
    P = jacobi._next_pow2(n)
    sig = {"T": "*fp64", "W": "*fp64", "V": "*fp64", "SW": "*i32", "n": "i32", "max_sweeps": "i32",
           "P": "constexpr", "TOL2": "constexpr", "SKIP": "constexpr"}
    src = ASTSource(fn=jacobi._jacobi_kernel, signature=sig,
                    constexprs={"P": P, "TOL2": jacobi.TOL**2, "SKIP": jacobi._SKIP})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": jacobi._WARPS[P]})
    ptx = kernel.asm["ptx"]
    assert kernel.asm["cubin"]
    assert "div.rn.f64" in ptx and "sqrt.rn.f64" in ptx
    assert not any(op in ptx for op in ("div.approx.f64", "rcp.approx.ftz.f64", "rsqrt.approx.f64", "sqrt.approx"))
