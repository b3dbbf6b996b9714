"""Could a truncation work with a block of r + p columns instead of 32, warm-started from the previous boundary's
kept directions, and know from the rigorous bound when one or two filter steps were enough? Measured on real state
trajectories (CPU): the bundled demo model (trained, 6 GDN layers × 2 heads of 128×128) truncating every head at
every boundary of a sample document (the eager loop, as the product runs it).

At every boundary and head, before the product's own truncation moves the run on, the state is truncated again with
a float64 block subspace iteration of ``q = r + p`` columns: start from ``[U_prev, S·Ω]`` (warm: the r directions the
product kept at the previous boundary plus p sketch columns) or ``S·Ω_q`` (cold), ``steps`` filter steps
``Q ← orth(G(GQ))``, a Rayleigh–Ritz step, then ``gdnviz.truncate.energy_error_bound`` on the top r Ritz vectors.
One JSON line per (r, p, start, steps): the share of states the bound certifies (≤ 1e-5), the worst actual error
among certified states (must be ≤ 1e-5), how often the bound undercut the actual error (must be 0), and the worst
actual error overall.

    python bench/study_small_block.py --tokens 4096          # CPU, a few minutes

Why: the fused truncation kernel spends ~65% of its cycles in a 32-column Jacobi and Cholesky-QRs (bench/RESULTS.md,
sixth session); with q = r + 4 columns those shrink ~4-16×, which is the kind of factor target 3 (truncated run ≤ 2×
the prefill) needs. A high certification rate would justify a kernel that tries the small block first and falls
back to today's algorithm only for uncertified states.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import emit  # noqa: E402

TOL = 1e-5


def orth(A: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(A)[0]


def small_block(X: torch.Tensor, r: int, q: int, steps: int, warm: torch.Tensor | None, seed: int = 0):
    """Top-r basis [N, K, q] (Ritz vectors, descending) of float64 states X [N, K, V] from a q-column block."""
    from gdnviz.truncate import _normalised_gram

    N, K, V = X.shape
    G, _ = _normalised_gram(X)
    gen = torch.Generator().manual_seed(seed)
    extra = q - (warm.shape[2] if warm is not None else 0)
    Omega = torch.randn(V, extra, generator=gen, dtype=torch.float64)
    Z = X @ Omega
    Q = orth(torch.cat([warm, Z], dim=2) if warm is not None else Z)
    for _ in range(steps):
        Q = orth(G @ (G @ Q))
    T = Q.mT @ G @ Q
    w, W = torch.linalg.eigh(0.5 * (T + T.mT))
    return Q @ W.flip(-1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--segment-len", type=int, default=256)
    ap.add_argument("--ranks", default="1,4,12")
    ap.add_argument("--extra", default="4,8", help="p: sketch columns beyond r")
    ap.add_argument("--steps", default="0,1,2")
    a = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    from gdnviz import runner
    from gdnviz.documents import sample_documents, tokenize
    from gdnviz.intervene import TruncateCallback, TruncationSpec
    from gdnviz.models import load
    from gdnviz.truncate import energy_error, energy_error_bound

    lm = load("demo", device="cpu", dtype="float32")
    text = "\n\n".join(d.text for d in sorted(sample_documents(), key=lambda d: -len(d.text)))
    ids = tokenize(lm.tokenizer, text)[: a.tokens]
    extras = [int(x) for x in a.extra.split(",")]
    steps = [int(x) for x in a.steps.split(",")]

    class Study(TruncateCallback):
        def __init__(self, info, spec, r):
            super().__init__(info, spec, warm_start=True)
            self.r = r
            self.res: dict = {}

        def on_boundary(self, layer, position, state, rows=None):
            sel = self.per_layer.get(layer)
            if sel is not None and rows is None:
                X = state[0, sel[0]].double()
                prev = self._basis.get(layer)
                for p in extras:
                    for start in ("cold", "warm"):
                        if start == "warm" and prev is None:
                            continue
                        warm = prev[:, :, : self.r].double() if start == "warm" else None
                        for s in steps:
                            Q = small_block(X, self.r, self.r + p, s, warm, seed=position)
                            b = energy_error_bound(X, Q, self.r)
                            Qr = Q[:, :, : self.r]
                            e = energy_error(X, Qr @ (Qr.mT @ X), self.r)
                            self.res.setdefault((p, start, s), []).append(torch.stack([b, e], 1))
            return super().on_boundary(layer, position, state, rows)

    for r in [int(x) for x in a.ranks.split(",")]:
        cb = Study(lm.info, TruncationSpec.all_heads(lm.info, r), r)
        runner.forward(lm, torch.tensor([ids]), segment_len=a.segment_len, callbacks=[cb], keep_hidden=False)
        for (p, start, s), rows in sorted(cb.res.items()):
            be = torch.cat(rows)
            b, e = be[:, 0], be[:, 1]
            ok = b <= TOL
            emit(what="small_block_study", r=r, block=r + p, start=start, steps=s, states=int(b.numel()),
                 certified_share=round(ok.double().mean().item(), 4),
                 worst_certified_actual=float(f"{e[ok].max().item():.3e}") if ok.any() else None,
                 bound_below_actual=int((b < e - 1e-12).sum()), worst_actual=float(f"{e.max().item():.3e}"),
                 share_actual_within=round((e <= TOL).double().mean().item(), 4), tokens=len(ids))


if __name__ == "__main__":
    main()
