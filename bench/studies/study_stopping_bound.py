"""Can a truncation know, from what it has computed, that its energy is within 1e-5 of exact? A rigorous a-posteriori
bound, tried on real state trajectories and on the adversarial batteries (CPU).

After ``iters`` filter steps, the refill and the Rayleigh–Ritz step, a pass of ``gdnviz.truncation`` holds an
orthonormal ``Q [K, q]`` (q = 32) whose leading columns are the kept directions, on the trace-1 Gram matrix ``G``.
With ``T = QᵀGQ`` and ``R = (I − QQᵀ) G Q`` (what G does outside span Q), in the basis [Q_r, Q_c, Q⊥]:

    G = [[T_rr, T_rcᵀ, R_rᵀ], [T_rc, T_cc, R_cᵀ], [R_r, R_c, D]],   D = Q⊥ᵀ G Q⊥,  ‖D‖_F² = ‖G‖_F² − ‖T‖_F² − 2‖R‖_F².

For any split G = [[A, Bᵀ], [B, C]] and ε > 0, G ≼ diag(A + BᵀB/ε, C + εI) (the difference is a square), so by Ky Fan
the top-r energy E* ≤ tr(A) + ‖B‖_F²/ε as soon as λ_min(A) ≥ λ_max(C) + ε. Here A = T_rr (tr A is the energy the
truncation keeps), B = [T_rc; R_r], and λ_max(C) ≤ c := max(λ_max(T_cc), ‖D‖_F) + ‖R_c‖_F (Weyl). So

    energy error = E* − tr(T_rr) ≤ (‖T_rc‖_F² + ‖R_r‖_F²) / (λ_min(T_rr) − c)     whenever λ_min(T_rr) > c,

every quantity computable from G, Q and GQ (which the Rayleigh–Ritz step forms anyway): the library's
``gdnviz.truncation.energy_error_bound``. One JSON line per
(source, r, iters): how many states the bound certifies (≤ 1e-5), the worst actual error among the certified ones
(must be ≤ 1e-5: the bound is an upper bound), and whether the bound was ever below the actual error (it must not).

    python bench/studies/study_stopping_bound.py --tokens 4096     # CPU, a few minutes
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.common import emit  # noqa: E402

TOL = 1e-5


def bound(X: torch.Tensor, r: int, iters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a-posteriori bound, actual energy error) per state of ``X [N, K, V]`` for one pass with ``iters`` steps."""
    from gdnviz.truncation import reference as tr

    X = X.double()
    Q = tr.subspace_pass(X, r, iters)  # [N, K, 32], top-r Ritz vectors first
    b = tr.energy_error_bound(X, Q, r)
    return b, tr.energy_error(X, Q[..., :r] @ (Q[..., :r].mT @ X), r)


def trajectory_states(tokens: int, segment_len: int, r: int) -> torch.Tensor:
    """Every head's state at every boundary of the demo model truncating all heads to rank r (eager loop)."""
    from gdnviz import runner
    from gdnviz.documents import sample_documents, tokenize
    from gdnviz.truncation import TruncateCallback, TruncationSpec
    from gdnviz.models import load

    lm = load("demo", device="cpu", dtype="float32")
    text = "\n\n".join(d.text for d in sorted(sample_documents(), key=lambda d: -len(d.text)))
    ids = tokenize(lm.tokenizer, text)[:tokens]
    got = []

    class Keep(TruncateCallback):
        def on_boundary(self, layer, position, state, rows=None):
            sel = self.per_layer.get(layer)
            if sel is not None:
                got.append(state[0, sel[0]].double().clone())
            return super().on_boundary(layer, position, state, rows)

    runner.forward(lm, torch.tensor([ids]), segment_len=segment_len,
                   callbacks=[Keep(lm.info, TruncationSpec.all_heads(lm.info, r))], keep_hidden=False)
    return torch.cat(got)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--ranks", default="1,4,12,16")
    ap.add_argument("--max-iters", type=int, default=4)
    a = ap.parse_args()
    from tests.support.states import hard_states

    from gdnviz.truncation import iterations_for

    for r in [int(x) for x in a.ranks.split(",")]:
        sources = {"demo_trajectory": trajectory_states(a.tokens, 256, r), "hard_batteries": hard_states(r, seed=r)[0]}
        for name, X in sources.items():
            for it in range(a.max_iters + 1):
                b, actual = bound(X, r, it)
                ok = b <= TOL
                emit(what="stopping_bound", source=name, r=r, iters=it, default_iters=iterations_for(r),
                     states=int(X.shape[0]), certified=int(ok.sum()), actually_within=int((actual <= TOL).sum()),
                     worst_certified_actual=float(f"{actual[ok].max().item():.3e}") if ok.any() else None,
                     bound_below_actual=int((b < actual - 1e-12).sum()))


if __name__ == "__main__":
    main()
