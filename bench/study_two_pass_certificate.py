"""Would a certified two-pass attempt work at 16 < r ≤ 32? The composed bound e₁ + t₂·e₂, tried on real state
trajectories, GDN-like states and the adversarial batteries (CPU, float64 torch; issue #6 target 1 at r = 32).

A rank r > 16 takes two passes: 16 directions U₁ of S, then r − 16 directions U₂ of the deflated state PS,
P = I − U₁U₁ᵀ. Each pass's a-posteriori bound (``gdnviz.truncate.energy_error_bound`` on its 32-column Ritz basis)
composes into a bound for the whole truncation:

    energy error ≤ e₁ + t₂·e₂,   t₂ = ‖PS‖²_F / ‖S‖²_F,

with e₁ pass 1's bound on S and e₂ pass 2's on PS (relative to ‖PS‖²). Why: the top-r energy of S is at most
top16(S) + top_{r−16}(PS), because σᵢ(PS) ≥ σᵢ₊₁₆(S) (Weyl: U₁U₁ᵀS has rank 16); and the orthonormal basis of
span[U₁, U₂] keeps at least ‖U₁ᵀS‖² + ‖U₂ᵀPS‖², because ‖PU₂‖ ≤ 1. So a pass-by-pass certificate is enough.

One JSON line per (source, r, iters): how many states the composed bound certifies at the kernel's CERT_TOL (5e-6)
and at the criterion (1e-5), the worst actual error among the certified ones, and how often the bound was below the
actual error (it must never be: that count checks the derivation on every state).

    python bench/study_two_pass_certificate.py --tokens 4096      # CPU, a few minutes
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

HALF = 16
CERT_TOL = 5e-6
TOL = 1e-5


def two_pass(X: torch.Tensor, r: int, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(composed bound, actual energy error, pass-1 and pass-2 bounds stacked [N, 2]) per state of ``X [N, K, V]``
    for a rank 16 < r ≤ 32 with ``iters`` filter steps per pass, as ``gdnviz.truncate``'s two passes run."""
    from gdnviz import truncate as tr

    X = X.double()
    Q1 = tr._subspace_pass(X, HALF, iters, None, seed=0)
    e1 = tr.energy_error_bound(X, Q1, HALF)
    U1 = Q1[..., :HALF]
    PS = X - U1 @ (U1.mT @ X)
    s2 = X.square().sum((-1, -2))
    t2 = torch.where(s2 > 0, PS.square().sum((-1, -2)) / s2.clamp_min(1e-300), torch.zeros_like(s2))
    Q2 = tr._subspace_pass(PS, r - HALF, iters, None, seed=1)
    e2 = tr.energy_error_bound(PS, Q2, r - HALF)
    U, _ = torch.linalg.qr(torch.cat([U1, Q2[..., : r - HALF]], dim=-1))
    actual = tr.energy_error(X, U @ (U.mT @ X), r)
    bound = e1 + torch.where(t2 > 0, t2 * e2, torch.zeros_like(t2))
    return bound, actual, torch.stack([e1, e2], -1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--ranks", default="20,32")
    ap.add_argument("--iters", default="1,2,3,6")
    ap.add_argument("--gdn-like", type=int, default=288, help="GDN-like states (bench_truncate's generator)")
    a = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    from study_stopping_bound import trajectory_states
    from test_truncate import hard_states

    from bench.bench_truncate import gdn_like_states

    for r in [int(x) for x in a.ranks.split(",")]:
        sources = {"demo_trajectory": trajectory_states(a.tokens, 256, r),
                   "gdn_like": gdn_like_states(a.gdn_like, 128, 128, seed=61),
                   "hard_batteries": hard_states(r, seed=r)[0]}
        for name, X in sources.items():
            for it in [int(x) for x in a.iters.split(",")]:
                b, actual, per = two_pass(X, r, it)
                cert = b <= CERT_TOL
                emit(what="two_pass_certificate", source=name, r=r, iters=it, states=int(X.shape[0]),
                     certified_at_cert_tol=int(cert.sum()), certified_at_1e_5=int((b <= TOL).sum()),
                     actually_within=int((actual <= TOL).sum()),
                     pass1_certified=int((per[:, 0] <= CERT_TOL).sum()),
                     worst_certified_actual=float(f"{actual[cert].max().item():.3e}") if cert.any() else None,
                     worst_actual=float(f"{actual.max().item():.3e}"),
                     bound_below_actual=int((b < actual - 1e-12).sum()))


if __name__ == "__main__":
    main()
