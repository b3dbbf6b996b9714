"""Fewer filter steps at 16 < r ≤ 32: does the second pass need its own cold start? (CPU, float64 torch; issue #6
target 1 at r = 32.)

A rank r > 16 takes two passes of a 32-column block (``gdnviz.gpu.fused_truncate.reference_fused``): 16 directions
U₁ of G, then 16 of the deflated G₂ = PGP, each pass from a fresh Gaussian sketch with ``iterations_for(16)`` = 6
filter steps ``Q ← cholqr(G (G Q))``. Pass 1's other 16 Ritz vectors V₂ have already had those 6 steps; they
approximate G's eigenvectors 17–32 and lie ⊥ U₁. Started from ``[V₂, 16 sketch columns]``, pass 2 should need
fewer steps. And pass 1's kept directions need not be exact: only span[U₁, U₂] matters for the energy.

This runs the kernel's algorithm (the same constants: Ω, refill, shifted Cholesky-QR, deflation) with ``k1`` steps in
pass 1, ``k2`` in pass 2 and pass 2 cold (``warm=0``, today's algorithm) or warm (``warm=1``), on:

* ``hard_batteries``: tests/test_truncate.py's hard states for this rank (clustered and repeated values at the cut,
  rank-deficient, ill-conditioned, toy gated-delta-rule states) — what ``iterations_for`` was calibrated on;
* ``gdn_like``: bench_truncate's GDN-like states (target 1's benchmark states);
* ``demo_trajectory``: every head at every boundary of the demo model truncating all heads at r.

One JSON line per (source, r, k1, k2, warm): worst and 99th-percentile energy error, and how many states exceed 1e-6
(``iterations_for``'s calibration level) and 1e-5 (the criterion).

    python bench/study_pass2_warm.py --tokens 4096      # CPU, a few minutes
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from bench.common import emit  # noqa: E402


def two_pass_basis(S: torch.Tensor, r: int, k1: int, k2: int, warm: bool) -> torch.Tensor:
    """``reference_fused``'s two passes for one rank 16 < r ≤ 32 with ``k1`` / ``k2`` filter steps; ``warm``: pass
    2 starts from pass 1's Ritz vectors 17–32 and the first 16 sketch columns instead of 32 sketch columns. Returns
    the orthonormal basis U [N, K, 32] whose first r columns are kept."""
    from gdnviz import truncate as tr
    from gdnviz.gpu import fused_truncate as ft

    S = S.to(torch.float64)
    N, K, V = S.shape
    q, h = ft._BLOCK, ft._HALF
    omega, fill, _ = ft._constants(K, V, S.device)
    G = S @ S.mT
    trc = G.diagonal(dim1=-2, dim2=-1).sum(-1)[:, None, None]
    inv = torch.where(trc > 0, trc.clamp_min(1e-300).rsqrt(), torch.zeros_like(trc))
    G = G * (inv * inv)
    U = torch.zeros(N, K, q, dtype=torch.float64)
    zscale = inv
    rest = None
    for p, k in ((0, k1), (1, k2)):
        Z = S @ omega[p]
        Z = (Z - U @ (U.mT @ Z)) * zscale
        if p == 1 and warm:
            Z = torch.cat([rest, Z[..., : q - h]], dim=-1)
        Qb = tr._cholqr(Z)
        for _ in range(k):
            Qb = tr._cholqr(G @ (G @ Qb))
        w = (1.0 - Qb.square().sum(-2, keepdim=True)).clamp_min(0.0).sqrt()
        Qb = tr._cholqr(tr._cholqr(Qb + (ft._FILL * w) * fill[p]))
        T = Qb.mT @ (G @ Qb)
        d, W = torch.linalg.eigh(T)
        Ritz = Qb @ W.flip(-1)  # descending
        take = min(r - h * p, h)
        U[..., h * p: h * p + take] = Ritz[..., :take]
        if p == 0:
            rest = Ritz[..., h:]
            G, zscale = ft.deflate(G, U, zscale)
    return tr._cholqr(tr._cholqr(U))


def energy_errors(S: torch.Tensor, U: torch.Tensor, r: int) -> torch.Tensor:
    """Exact top-r energy minus the energy U's first r columns keep, relative to ‖S‖²_F, per state."""
    S = S.to(torch.float64)
    tot = S.square().sum((-1, -2)).clamp_min(1e-300)
    sv = torch.linalg.svdvals(S)
    exact = sv[:, :r].square().sum(-1)
    kept = (U[..., :r].mT @ S).square().sum((-1, -2))
    return ((exact - kept) / tot).clamp_min(0.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--ranks", default="20,32")
    ap.add_argument("--configs", default="6:6:0,6:6:1,6:2:1,6:3:1,4:2:1,4:3:1,3:3:1,3:2:1,2:2:1",
                    help="k1:k2:warm triples")
    ap.add_argument("--gdn-like", type=int, default=288)
    a = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    from study_stopping_bound import trajectory_states
    from test_truncate import hard_states

    from bench.bench_truncate import gdn_like_states

    for r in [int(x) for x in a.ranks.split(",")]:
        sources = {"hard_batteries": hard_states(r, seed=r)[0],
                   "gdn_like": gdn_like_states(a.gdn_like, 128, 128, seed=61)}
        if a.tokens > 0:
            sources["demo_trajectory"] = trajectory_states(a.tokens, 256, r)
        for name, X in sources.items():
            for k1, k2, w in [tuple(int(v) for v in c.split(":")) for c in a.configs.split(",")]:
                err = energy_errors(X, two_pass_basis(X, r, k1, k2, bool(w)), r)
                emit(what="pass2_warm", source=name, r=r, k1=k1, k2=k2, warm=bool(w), states=int(X.shape[0]),
                     worst=float(f"{err.max().item():.3e}"),
                     p99=float(f"{torch.quantile(err, 0.99).item():.3e}"),
                     over_1e_6=int((err > 1e-6).sum()), over_1e_5=int((err > 1e-5).sum()))


if __name__ == "__main__":
    main()
