"""How often is a Cholesky-QR pair's input orthonormal already? (CPU, float64 torch; issue #6 target 1, nineteenth
session: the rule of ``gdnviz.gpu.fused_truncate.checked_cholqr``.)

Runs ``reference_fused``'s two passes for a rank 16 < r ≤ 32 with every pair unchecked and records, per state, the
largest entry of |XᵀX − I| (over the r kept columns for the final U) at the inputs of the pairs' calls: after the
refill (``refill{p}_in``), between the pair's two calls (``refill{p}_mid``), and for the final U before its first
and second calls (``final_in`` / ``final_mid``). One JSON line per (source, r): the fraction of states at or below
1e-14 … 1e-10 and the largest value, on the test batteries (tests/test_truncate.py's ``hard_states``) and 288
GDN-like states (``bench_truncate.gdn_like_states``, seed 61).

    python bench/study_checked_cholqr.py      # a few seconds
"""
from __future__ import annotations

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from bench.common import emit  # noqa: E402


def orth(X: torch.Tensor, m: int = 32) -> torch.Tensor:
    """max |XᵀX − I| over the first m columns, per state."""
    X = X[..., :m]
    return (X.mT @ X - torch.eye(m, dtype=X.dtype)).abs().amax((-1, -2))


def pair_inputs(S: torch.Tensor, r: int, k1: int = 6, k2: int = 4) -> dict[str, torch.Tensor]:
    """The orthogonality of every pair's inputs in ``reference_fused``'s algorithm (pairs unchecked)."""
    from gdnviz import truncate as tr
    from gdnviz.gpu import fused_truncate as ft

    C = tr._cholqr
    S = S.double()
    N, K, V = S.shape
    q, h = ft._BLOCK, ft._HALF
    omega, fill, _ = ft._constants(K, V, S.device)
    G, zscale = tr._normalised_gram(S)  # trace 1, and 1/‖S‖_F for the sketches
    U = torch.zeros(N, K, q, dtype=torch.float64)
    out = {}
    for p, k in ((0, k1), (1, k2)):
        Z = S @ omega[p]
        Qb = C((Z - U @ (U.mT @ Z)) * zscale)
        for _ in range(k):
            Qb = C(G @ (G @ Qb))
        w = (1.0 - Qb.square().sum(-2, keepdim=True)).clamp_min(0.0).sqrt()
        X = Qb + (ft._FILL * w) * fill[p]
        out[f"refill{p}_in"] = orth(X)
        X = C(X)
        out[f"refill{p}_mid"] = orth(X)
        Qb = C(X)
        d, W = torch.linalg.eigh(Qb.mT @ (G @ Qb))
        ritz = Qb @ W.flip(-1)
        take = min(r - h * p, h)
        U[..., h * p:h * p + take] = ritz[..., :take]
        if p == 0:
            G, zscale = ft.deflate(G, U, zscale)
    out["final_in"] = orth(U, r)
    out["final_mid"] = orth(C(U), r)
    return out


def main() -> None:
    from test_truncate import hard_states

    from bench.bench_truncate import gdn_like_states

    for r in (20, 32):
        for name, X in {"hard_batteries": hard_states(r, seed=r)[0],
                        "gdn_like": gdn_like_states(288, 128, 128, seed=61)}.items():
            row = {}
            for key, v in pair_inputs(X, r).items():
                row[key] = {f"le_{t:.0e}": round((v <= t).double().mean().item(), 3) for t in (1e-14, 1e-13, 1e-12, 1e-10)}
                row[key]["max"] = float(f"{v.max().item():.1e}")
            emit(what="checked_cholqr_inputs", source=name, r=r, states=int(X.shape[0]), **row)


if __name__ == "__main__":
    main()
