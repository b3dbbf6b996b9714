"""NumPy replica of the Triton Jacobi kernel (gdnviz.gpu.jacobi) and the sweep counts quoted in its docstring.

The replica performs the same float64 operations in the same order as ``_jacobi_kernel``, so it reproduces the
kernel run under ``TRITON_INTERPRET=1`` bit for bit (``tests/test_jacobi.py`` checks that) at NumPy speed — the
interpreter needs seconds per 32×32 matrix, this a few milliseconds. Compiled on a GPU the kernel may round
differently (fused multiply-adds), not follow a different algorithm.

    .venv/bin/python bench/jacobi_replica.py [--quick]

prints, per family of matrices, the sweeps used (histogram) and the worst errors against ``numpy.linalg.eigh``.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import numpy as np

EPS = 2.0**-53  # the kernel's _SKIP
TOL = 1e-15
MAX_SWEEPS = 24  # the kernel's default


def partner(P: int, k: int) -> np.ndarray:
    """Round-robin partner of every index in round k of a P×P sweep."""
    m = P - 1
    i = np.arange(P)
    j = (2 * k - i + m) % m
    return np.where(i == m, k, np.where(j == i, m, j))


def jacobi(A0: np.ndarray, max_sweeps: int = MAX_SWEEPS, tol: float = TOL, skip: float = EPS):
    """(eigenvalues ascending, eigenvectors as columns, sweeps, off(A)/‖A‖_F after each sweep) of one matrix."""
    n = A0.shape[-1]
    P = 1 << (max(n, 2) - 1).bit_length()
    A = np.zeros((P, P))
    A[:n, :n] = np.tril(A0) + np.tril(A0, -1).T  # lower triangle, like the kernel and torch.linalg.eigh
    V = np.eye(P)
    idx = np.arange(P)
    fro2 = (A * A).sum()
    thresh = (tol * tol) * fro2  # Python scalars in the kernel take the float64 tensor's type: exact
    off2 = np.where(np.eye(P, dtype=bool), 0.0, A * A).sum()
    d = np.diag(A).copy()
    sweep, nrot, offs = 0, 1, []
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        while sweep < max_sweeps and off2 > thresh and nrot > 0:
            rotated = np.zeros(P, bool)
            for k in range(P - 1):
                pr = partner(P, k)
                a_ip = A[idx, pr]
                a_pi = a_ip[pr]
                d_pr = d[pr]
                is_p = idx < pr
                app = np.where(is_p, d, d_pr)
                aqq = np.where(is_p, d_pr, d)
                apq = 0.5 * (a_ip + a_pi)
                rot = np.abs(apq) > skip * (np.sqrt(np.abs(app)) * np.sqrt(np.abs(aqq)))
                tau = (aqq - app) / (2.0 * np.where(rot, apq, 1.0))
                t = 1.0 / (np.abs(tau) + np.sqrt(1.0 + tau * tau))
                t = np.where(rot, np.where(tau < 0.0, -t, t), 0.0)
                c = 1.0 / np.sqrt(1.0 + t * t)
                s = t * c
                sig = np.where(is_p, -s, s)
                d = np.where(is_p, app - t * apq, aqq + t * apq)
                A = c[None, :] * A + sig[None, :] * A[:, pr]
                A = c[:, None] * A + sig[:, None] * A[pr, :]
                V = c[None, :] * V + sig[None, :] * V[:, pr]
                A[idx, idx] = d
                A[idx[rot], pr[rot]] = 0.0
                rotated |= rot
            off2 = np.where(np.eye(P, dtype=bool), 0.0, A * A).sum()
            nrot = int(rotated.sum())
            sweep += 1
            offs.append(float(np.sqrt(off2 / fro2)) if fro2 > 0 else 0.0)
    order = np.argsort(d[:n], kind="stable")
    return d[:n][order], V[:n, :n][:, order], sweep, offs


def families(quick: bool):
    import torch

    F64 = torch.float64
    g = torch.Generator().manual_seed(5)

    def spec(lam):
        b, n = lam.shape
        U = torch.linalg.qr(torch.randn(b, n, n, generator=g, dtype=torch.float64))[0]
        return ((U * lam[:, None, :]) @ U.mT).numpy()

    for n in (32, 64):
        r = torch.arange(n, dtype=torch.float64)
        B = (6 if quick else 20) if n == 32 else (2 if quick else 6)
        X = torch.randn(B, n, n, generator=g, dtype=torch.float64)
        yield f"{n} random symmetric", (X + X.mT).numpy()
        yield f"{n} PSD geometric 1e0..1e-16", spec(10.0 ** (-16 * r / (n - 1)).expand(B, n).contiguous())
        yield f"{n} PSD log-uniform 1e0..1e-16", spec(10.0 ** (-16 * torch.rand(B, n, generator=g, dtype=F64)))
        yield f"{n} PSD geometric 1e0..1e-8", spec(10.0 ** (-8 * r / (n - 1)).expand(B, n).contiguous())
    yield "32 truncate_states Rayleigh quotients", ritz_matrices(quick)


def ritz_matrices(quick: bool) -> np.ndarray:
    """The 32×32 T = QᵀGQ of truncate_states's Rayleigh–Ritz steps on the hard batteries of tests/test_truncate.py."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [root, os.path.join(root, "tests")]
    import torch

    import gdnviz.truncate as tr
    from test_truncate import hard_states

    seen, orig = [], tr._ritz

    def record(Q, G):
        seen.append(Q.mT @ (G @ Q))
        return orig(Q, G)

    tr._ritz = record
    try:
        for r in (4,) if quick else (1, 4, 12, 32):
            S, _ = hard_states(r, seed=r)
            tr.truncate_states(S, r)
    finally:
        tr._ritz = orig
    return torch.cat(seen).numpy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer matrices per family")
    args = ap.parse_args()
    for name, mats in families(args.quick):
        hist = collections.Counter()
        worst = np.zeros(3)
        for A in mats:
            w, V, sweeps, _ = jacobi(A)
            n = A.shape[-1]
            nrm = max(np.linalg.norm(A), 1e-300)
            hist[sweeps] += 1
            worst = np.maximum(worst, [np.abs(w - np.linalg.eigvalsh(A)).max() / nrm,
                                       np.linalg.norm(V.T @ V - np.eye(n)), np.linalg.norm(A @ V - V * w) / nrm])
        print(f"{name:40s} n={len(mats):3d} sweeps {dict(sorted(hist.items()))}  max |Δλ|/‖A‖ {worst[0]:.1e}  "
              f"‖VᵀV−I‖ {worst[1]:.1e}  ‖AV−VΛ‖/‖A‖ {worst[2]:.1e}", flush=True)


if __name__ == "__main__":
    main()
