"""Would a certified two-pass attempt work at 16 < r ≤ 32? The composed bound e₁ + t₂·e₂, tried on real state
trajectories, GDN-like states and the adversarial batteries (CPU, float64 torch; issue #6 target 1 at r = 32).

A rank r > 16 takes two passes: 16 directions U₁ of S, then r − 16 directions U₂ of the deflated state PS,
P = I − U₁U₁ᵀ. Each pass's a-posteriori bound (``gdnviz.truncation.energy_error_bound`` on its 32-column Ritz basis)
composes into a bound for the whole truncation:

    energy error ≤ e₁ + t₂·e₂,   t₂ = ‖PS‖²_F / ‖S‖²_F,

with e₁ pass 1's bound on S and e₂ pass 2's on PS (relative to ‖PS‖²). Why: the top-r energy of S is at most
top16(S) + top_{r−16}(PS), because σᵢ(PS) ≥ σᵢ₊₁₆(S) (Weyl: U₁U₁ᵀS has rank 16); and the orthonormal basis of
span[U₁, U₂] keeps at least ‖U₁ᵀS‖² + ‖U₂ᵀPS‖², because ‖PU₂‖ ≤ 1. So a pass-by-pass certificate is enough.

``--schatten 4,8`` also tries a tighter term for G outside each pass's block (``schatten_bound``). One JSON line per
(source, r, iters, p): how many states the composed bound certifies at the kernel's CERT_TOL (5e-6)
and at the criterion (1e-5), the worst actual error among the certified ones, and how often the bound was below the
actual error (it must never be: that count checks the derivation on every state).

    python bench/studies/study_two_pass_certificate.py --tokens 4096      # CPU, a few minutes
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)
from bench.common import emit  # noqa: E402

HALF = 16
CERT_TOL = 5e-6
TOL = 1e-5


def schatten_bound(X: torch.Tensor, Q: torch.Tensor, r: int, p: int) -> torch.Tensor:
    """``gdnviz.truncation.energy_error_bound(X, Q, r)`` with λ_max(D) bounded by the Schatten norm
    ‖D‖_p = (tr D^p)^{1/p} (p = 4, 8, …; D = P⊥ G P⊥ formed explicitly, P⊥ = I − QQᵀ) instead of ‖D‖_F = ‖D‖_2:
    every ‖D‖_p ≥ λ_max(D) for a positive semidefinite D, and it falls toward λ_max(D) as p grows."""
    from gdnviz.truncation import reference as tr

    X = X.double()
    G, _ = tr.normalised_gram(X)
    GQ = G @ Q
    T = Q.mT @ GQ
    T = 0.5 * (T + T.mT)
    R = GQ - Q @ T
    P = torch.eye(X.shape[1], dtype=X.dtype) - Q @ Q.mT
    D = P @ G @ P
    M = D
    for _ in range(p.bit_length() - 2):  # D^(p/2) by repeated squaring (p a power of two ≥ 4)
        M = M @ M
    dp = M.square().sum((-1, -2)).clamp_min(0) ** (1.0 / p)  # ‖D^(p/2)‖_F^(2/p) = (tr D^p)^(1/p)
    lam_c = torch.linalg.eigvalsh(T[:, r:, r:])[:, -1] if r < Q.shape[2] else torch.zeros_like(dp)
    c = torch.maximum(lam_c, dp) + R[:, :, r:].square().sum((-1, -2)).sqrt()
    gap = torch.linalg.eigvalsh(T[:, :r, :r])[:, 0] - c
    off = T[:, r:, :r].square().sum((-1, -2)) + R[:, :, :r].square().sum((-1, -2))
    bound = torch.where(gap > 0, off / gap.clamp_min(1e-300), torch.full_like(gap, float("inf")))
    zero = G.diagonal(dim1=-2, dim2=-1).sum(-1) == 0
    return torch.where(zero, torch.zeros_like(bound), bound)


def two_pass(X: torch.Tensor, r: int, iters: int, p: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(composed bound, actual energy error, [pass-1 bound, pass-2 bound, joint bound] [N, 3]) per state of ``X [N, K, V]``
    for a rank 16 < r ≤ 32 with ``iters`` filter steps per pass, as ``gdnviz.truncation``'s two passes run. ``p``:
    the Schatten norm bounding λ_max(D) (2: ``energy_error_bound``'s ‖D‖_F)."""
    from gdnviz.truncation import reference as tr

    def pass_bound(Y, Q, k):
        """The pass's bound, or the energy its kept directions miss, 1 − tr(Q_kᵀ G Q_k) (G of trace 1: the top-k
        energy is at most 1), whichever is smaller — the kernel's certificate takes both (rank-deficient states)."""
        b = tr.energy_error_bound(Y, Q, k) if p == 2 else schatten_bound(Y, Q, k, p)
        G, _ = tr.normalised_gram(Y)
        Qk = Q[..., :k]
        miss = (1.0 - (Qk.mT @ G @ Qk).diagonal(dim1=-2, dim2=-1).sum(-1)).clamp_min(0.0)
        return torch.minimum(b, miss)

    X = X.double()
    Q1 = tr.subspace_pass(X, HALF, iters)
    e1 = pass_bound(X, Q1, HALF)
    U1 = Q1[..., :HALF]
    PS = X - U1 @ (U1.mT @ X)
    s2 = X.square().sum((-1, -2))
    t2 = torch.where(s2 > 0, PS.square().sum((-1, -2)) / s2.clamp_min(1e-300), torch.zeros_like(s2))
    Q2 = tr.subspace_pass(PS, r - HALF, iters)
    e2 = pass_bound(PS, Q2, r - HALF)
    U, _ = torch.linalg.qr(torch.cat([U1, Q2[..., : r - HALF]], dim=-1))
    actual = tr.energy_error(X, U @ (U.mT @ X), r)
    bound = e1 + torch.where(t2 > 0, t2 * e2, torch.zeros_like(t2))
    # one bound for the final cut only: the 48-column basis [U1, pass 2's 32 Ritz vectors] (its first r columns span
    # the kept directions), so the cut at 16 inside the answer need not have a gap
    B, _ = torch.linalg.qr(torch.cat([U1, Q2], dim=-1))
    joint = pass_bound(X, B, r)
    return bound, actual, torch.stack([e1, e2, joint], -1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--ranks", default="20,32")
    ap.add_argument("--iters", default="1,2,3,6")
    ap.add_argument("--gdn-like", type=int, default=288, help="GDN-like states (bench_truncate's generator)")
    ap.add_argument("--schatten", default="2", help="comma-separated p for the bound on λ_max(D): 2 (‖D‖_F), 4, 8")
    a = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    from study_stopping_bound import trajectory_states
    from tests.support.states import hard_states

    from tests.support.states import gdn_like_states

    for r in [int(x) for x in a.ranks.split(",")]:
        sources = {"demo_trajectory": trajectory_states(a.tokens, 256, r),
                   "gdn_like": gdn_like_states(a.gdn_like, 128, 128, seed=61),
                   "hard_batteries": hard_states(r, seed=r)[0]}
        for name, X in sources.items():
            for it, sp in [(int(i), int(q)) for i in a.iters.split(",") for q in a.schatten.split(",")]:
                b, actual, per = two_pass(X, r, it, sp)
                cert = b <= CERT_TOL
                emit(what="two_pass_certificate", source=name, r=r, iters=it, schatten_p=sp, states=int(X.shape[0]),
                     certified_at_cert_tol=int(cert.sum()), certified_at_1e_5=int((b <= TOL).sum()),
                     actually_within=int((actual <= TOL).sum()),
                     pass1_certified=int((per[:, 0] <= CERT_TOL).sum()),
                     joint_certified=int((per[:, 2] <= CERT_TOL).sum()),
                     joint_below_actual=int((per[:, 2] < actual - 1e-12).sum()),
                     worst_certified_actual=float(f"{actual[cert].max().item():.3e}") if cert.any() else None,
                     worst_actual=float(f"{actual.max().item():.3e}"),
                     bound_below_actual=int((b < actual - 1e-12).sum()))


if __name__ == "__main__":
    main()
