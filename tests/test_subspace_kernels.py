"""The split Cholesky-QR kernels of the subspace pass (gdnviz.gpu.subspace_kernels) pinned to the torch path.

On CPU the kernels run in the Triton interpreter in a subprocess (TRITON_INTERPRET must be set before triton is
imported): ``GDNVIZ_TEST_TRITON_CHOLQR=subspace`` (split: step + 1-warp Cholesky kernels) or ``subspace-fused``
makes ``truncate._subspace_pass`` use them. Criteria: ``orthonormal_iterations`` equals the torch sequence of
Cholesky-QRs to 1e-10 on GDN-like states where the result is determined (first column, top-16 Ritz values, energy
kept by the top-4 Ritz vectors; the unconverged trailing columns carry amplified rounding); ``truncate_states`` with the kernels keeps the 1e-5 energy criterion
against the float64 SVD on GDN-like, rank-deficient, clustered and zero states for r = 1, 4, 12, 17 and 32, and its
result equals the torch path's to 1e-8 (relative, GDN-like states: same algorithm, other summation order).
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_STATES = '''
    from bench.bench_truncate import gdn_like_spectra
    g = torch.Generator().manual_seed(5)
    sig = gdn_like_spectra(3, 128, g)
    U = torch.linalg.qr(torch.randn(4, 128, 128, generator=g, dtype=F64))[0]
    W = torch.linalg.qr(torch.randn(4, 128, 128, generator=g, dtype=F64))[0]
    S = (U[:3] * sig[:, None, :]) @ W[:3].mT
    lowrank = (U[3, :, :6] * torch.tensor([1.0, 1.0, 1.0, 0.5, 0.5, 1e-3], dtype=F64)) @ W[3, :, :6].mT  # rank 6, ties
    S = torch.cat([S, lowrank[None], torch.zeros(1, 128, 128, dtype=F64)])
'''


def _interpret(code: str, which: str) -> dict:
    prelude = textwrap.dedent('''
        import json, os, sys
        sys.path.insert(0, os.environ["ROOT"])
        import torch
        torch.set_num_threads(1)
        F64 = torch.float64
    ''')
    env = dict(os.environ, TRITON_INTERPRET="1", ROOT=ROOT, OMP_NUM_THREADS="1", GDNVIZ_TEST_TRITON_CHOLQR=which)
    out = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(_STATES) + textwrap.dedent(code)],
                         capture_output=True, text=True, env=env, timeout=1200)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_orthonormal_iterations_equal_the_torch_sequence():
    res = _interpret('''
        from gdnviz import truncate as tr
        from gdnviz.gpu.subspace_kernels import orthonormal_iterations
        X = S[:3]
        G, inv = tr._normalised_gram(X)
        Z = (X @ tr._gaussian(128, 32, X.device, seed=12345)) * inv
        fill = tr._gaussian(128, 32, X.device, seed=0x5EED, unit_columns=True)
        P = G @ G
        Q = tr._cholqr(tr._cholqr(Z))
        for _ in range(4):
            Q = tr._cholqr(P @ Q)
        w = (1.0 - Q.square().sum(-2, keepdim=True)).clamp_min(0.0).sqrt()
        Q = tr._cholqr(tr._cholqr(Q + (tr._FILL * w) * fill))
        T = Q.mT @ (G @ Q)
        def top(Q, T, r):  # Ritz values (descending) and the energy of X kept by the top-r Ritz vectors
            theta, Wr = torch.linalg.eigh(T)
            Ur = Q @ Wr.flip(-1)[..., :r]
            return theta.flip(-1)[..., :16], (Ur.mT @ X).square().sum((-1, -2)) / X.square().sum((-1, -2))
        out = {}
        th_ref, e_ref = top(Q, T, 4)
        for fuse in (False, True):
            Qk, Tk = orthonormal_iterations(Z, P, G, 4, fill, fuse=fuse)
            th, e = top(Qk, Tk, 4)
            # the first column is the normalised first column of the filtered sketch: no rounding amplification
            out[f"col0_{fuse}"] = (Qk[..., 0] - Q[..., 0]).abs().max().item()
            out[f"ritz_{fuse}"] = (th - th_ref).abs().max().item()  # G has trace 1
            out[f"energy_{fuse}"] = (e - e_ref).abs().max().item()
            out[f"orth_{fuse}"] = (Qk.mT @ Qk - torch.eye(32, dtype=F64)).abs().max().item()
        print(json.dumps(out))
    ''', "subspace")
    # The block's trailing columns are not converged after 4 steps and carry amplified rounding, so Q is compared
    # only where it is determined: its first column, the converged Ritz values and the energy kept.
    assert all(v < 1e-10 for v in res.values()), res


@pytest.mark.parametrize("which", ["subspace", "subspace-fused"])
def test_truncation_with_the_kernels_keeps_the_energy_criterion(which):
    res = _interpret('''
        from gdnviz import truncate as tr
        assert tr._TRITON_INTERPRET.startswith("subspace")
        out = {}
        for r in (1, 4, 12, 17, 32):
            y = tr.truncate_states(S, r)
            out[f"err{r}"] = tr.energy_error(S, y, r).max().item()
            env = tr._TRITON_INTERPRET
            tr._TRITON_INTERPRET = ""  # the torch path on the same states
            ref = tr.truncate_states(S, r)
            tr._TRITON_INTERPRET = env
            out[f"rel{r}"] = ((y[:3] - ref[:3]).norm() / ref[:3].norm()).item()
            out[f"zero{r}"] = y[-1].abs().max().item()
        print(json.dumps(out))
    ''', which)
    for r in (1, 4, 12, 17, 32):
        assert res[f"err{r}"] <= 1e-5, res
        assert res[f"rel{r}"] < 1e-8, res
        assert res[f"zero{r}"] == 0.0, res


def test_mode_and_shape_checks(monkeypatch):
    from gdnviz.gpu import subspace_kernels as sk

    monkeypatch.setenv("GDNVIZ_TRITON_SUBSPACE", "0")
    assert sk.mode() == "off"
    monkeypatch.setenv("GDNVIZ_TRITON_SUBSPACE", "1")
    assert sk.mode() == "split"
    monkeypatch.setenv("GDNVIZ_TRITON_SUBSPACE", "fused")
    assert sk.mode() == "fused"
    P = torch.zeros(1, 128, 128, dtype=torch.float64)
    assert sk.supports(torch.zeros(1, 128, 32, dtype=torch.float64), P)
    assert not sk.supports(torch.zeros(1, 128, 16, dtype=torch.float64), P)
    with pytest.raises(ValueError):
        sk.orthonormal_iterations(torch.zeros(1, 96, 32, dtype=torch.float64), P, P, 1, torch.zeros(96, 32))
    # CPU tensors never take the kernel path outside the interpreter tests
    from gdnviz import truncate as tr

    assert tr._subspace_kernel_mode(torch.zeros(1, 128, 32, dtype=torch.float64)) == "off"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["split", "fused"])
def test_cuda_kernels_match_torch_and_keep_the_energy(monkeypatch, mode):
    from bench.bench_truncate import gdn_like_spectra
    from gdnviz import truncate as tr
    from gdnviz.gpu.cuda_graph import capture

    g = torch.Generator().manual_seed(1)
    sig = gdn_like_spectra(288, 128, g)
    U = torch.linalg.qr(torch.randn(288, 128, 128, generator=g, dtype=torch.float64))[0]
    W = torch.linalg.qr(torch.randn(288, 128, 128, generator=g, dtype=torch.float64))[0]
    S = ((U * sig[:, None, :]) @ W.mT).float().cuda()
    S[-1] = 0
    for r in (1, 4, 12, 32):
        monkeypatch.setenv("GDNVIZ_TRITON_SUBSPACE", "0")
        ref = tr.truncate_states(S, r)
        monkeypatch.setenv("GDNVIZ_TRITON_SUBSPACE", mode)
        y = tr.truncate_states(S, r)
        err = tr.energy_error(S, y, r)
        assert err.max().item() <= 1e-5, (r, err.max().item())
        # per state the same energy as the torch path (states may differ where σ_r ≈ σ_r+1: both are truncations)
        gap = (tr.retained_energy(S, y) - tr.retained_energy(S, ref)).abs().max().item()
        assert gap <= 1e-5, (r, gap)
        assert y[-1].abs().max().item() == 0.0
        graph, out = capture(lambda x: tr.truncate_states(x, r), S.clone())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, y)
