"""The Triton batched Cholesky-QR (gdnviz.gpu.cholqr) pinned to gdnviz.truncate._cholqr's torch definition.

On CPU the kernel runs in the Triton interpreter in a subprocess (TRITON_INTERPRET must be set before triton is
imported). Criteria: on well-conditioned blocks the result equals the torch path's to 1e-12 (relative); on graded,
rank-deficient and zero blocks — where shifted Cholesky-QR damps directions and rounding differences are
amplified — both give the same kind of answer: ‖QᵀQ − I‖ small on the columns the shift keeps, ``Q = Z L⁻ᵀ`` with
the same L to 1e-8, zero in → zero out. And ``truncate_states`` with the kernel inside keeps the 1e-5 energy
criterion.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _interpret(code: str, extra_env: dict | None = None) -> dict:
    prelude = textwrap.dedent('''
        import json, os, sys
        sys.path.insert(0, os.environ["ROOT"])
        import torch
        torch.set_num_threads(1)
        F64 = torch.float64
    ''')
    env = dict(os.environ, TRITON_INTERPRET="1", ROOT=ROOT, OMP_NUM_THREADS="1", **(extra_env or {}))
    out = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                         env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_kernel_equals_the_torch_definition():
    res = _interpret('''
        from gdnviz.gpu.cholqr import cholqr
        from gdnviz import truncate
        g = torch.Generator().manual_seed(0)
        out = {}
        Z = torch.randn(3, 128, 32, generator=g, dtype=F64)              # well conditioned
        a, b = cholqr(Z, truncate._CHOL_SHIFT, truncate._TINY), truncate._cholqr(Z)
        out["rel"] = ((a - b).norm() / b.norm()).item()
        out["orth"] = (a.mT @ a - torch.eye(32, dtype=F64)).abs().max().item()
        Zg = Z * torch.logspace(0, -9, 32, dtype=F64)                     # graded columns
        a, b = cholqr(Zg), truncate._cholqr(Zg)
        out["graded_rel"] = ((a - b).norm() / b.norm()).item()
        Zd = Z.clone(); Zd[:, :, 16:] = Zd[:, :, :16]                      # rank-deficient: repeated columns
        a, b = cholqr(Zd), truncate._cholqr(Zd)
        out["deficient_rel"] = ((a - b).norm() / b.norm()).item()
        out["deficient_finite"] = bool(torch.isfinite(a).all())
        z0 = cholqr(torch.zeros(2, 64, 16, dtype=F64))                    # zero in, zero out; other shapes
        out["zero"] = z0.abs().max().item()
        Z64 = torch.randn(2, 64, 64, generator=g, dtype=F64)
        out["rel64"] = ((cholqr(Z64) - truncate._cholqr(Z64)).norm() / truncate._cholqr(Z64).norm()).item()
        print(json.dumps(out))
    ''')
    assert res["rel"] < 1e-12 and res["orth"] < 1e-12 and res["rel64"] < 1e-12, res
    assert res["graded_rel"] < 1e-8, res
    assert res["deficient_finite"] and res["deficient_rel"] < 1e-6, res
    assert res["zero"] == 0.0


def test_truncation_with_the_kernel_keeps_the_energy_criterion():
    """truncate_states with every Cholesky-QR in the kernel (GDNVIZ_TEST_TRITON_CHOLQR=cholqr, interpreter)."""
    res = _interpret('''
        from gdnviz import truncate
        assert truncate._TRITON_INTERPRET == "cholqr"
        from bench.bench_truncate import gdn_like_spectra
        g = torch.Generator().manual_seed(3)
        sig = gdn_like_spectra(3, 128, g)
        U = torch.linalg.qr(torch.randn(3, 128, 128, generator=g, dtype=F64))[0]
        W = torch.linalg.qr(torch.randn(3, 128, 128, generator=g, dtype=F64))[0]
        S = torch.cat([(U * sig[:, None, :]) @ W.mT, torch.zeros(1, 128, 128, dtype=F64)])
        out = {}
        for r in (1, 4, 12):
            err = truncate.energy_error(S, truncate.truncate_states(S, r), r)
            out[str(r)] = err.max().item()
        out["zero"] = truncate.truncate_states(S, 4)[-1].abs().max().item()
        print(json.dumps(out))
    ''', {"GDNVIZ_TEST_TRITON_CHOLQR": "cholqr"})
    assert res.pop("zero") == 0.0
    assert all(v <= 1e-5 for v in res.values()), res


def test_off_by_default_and_shape_checks():
    from gdnviz.gpu import cholqr

    assert os.environ.get("GDNVIZ_TRITON_CHOLQR") != "1" or cholqr.enabled()
    assert cholqr.supports(torch.zeros(1, 128, 32, dtype=torch.float64))
    assert not cholqr.supports(torch.zeros(1, 128, 48, dtype=torch.float64))  # the 48-column join stays in torch
    assert not cholqr.supports(torch.zeros(1, 128, 32, dtype=torch.float32))
    with pytest.raises(ValueError):
        cholqr.cholqr(torch.zeros(1, 96, 32, dtype=torch.float64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernel_matches_torch_and_truncation_stays_exact(monkeypatch):
    from gdnviz import truncate
    from gdnviz.gpu.cholqr import cholqr

    g = torch.Generator().manual_seed(1)
    Z = torch.randn(288, 128, 32, generator=g, dtype=torch.float64).cuda()
    monkeypatch.delenv("GDNVIZ_TRITON_CHOLQR", raising=False)
    ref = truncate._cholqr(Z)
    assert ((cholqr(Z) - ref).norm() / ref.norm()).item() < 1e-12
    from bench.bench_truncate import gdn_like_spectra

    sig = gdn_like_spectra(288, 128, g)
    U = torch.linalg.qr(torch.randn(288, 128, 128, generator=g, dtype=torch.float64))[0]
    S = ((U * sig[:, None, :]) @ U.mT).float().cuda()
    monkeypatch.setenv("GDNVIZ_TRITON_CHOLQR", "1")
    for r in (1, 4, 12, 32):
        assert truncate.energy_error(S, truncate.truncate_states(S, r), r).max().item() <= 1e-5
