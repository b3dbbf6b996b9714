"""The Streamlit process runs its BLAS on one thread (gdnviz.ui.blas); checked in a fresh interpreter."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_one_blas_thread_sets_the_blas_to_one_thread_in_this_process():
    code = r'''
import json, numpy as np
from gdnviz.ui import blas
before = blas.blas_threads()
after = blas.one_blas_thread()
a = np.random.default_rng(0).standard_normal((300, 200))
s = np.linalg.svd(a, compute_uv=False)
print(json.dumps([before, after, blas.blas_threads(), bool(np.allclose(s ** 2, np.linalg.eigvalsh(a.T @ a)[::-1]))]))
'''
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after, now, svd_ok = json.loads(out.stdout.strip().splitlines()[-1])
    if before is None:
        pytest.skip("no BLAS library found in this process")
    assert before == 2 and after == now == 1 and svd_ok
