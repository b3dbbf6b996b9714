"""How many filter steps does a truncation need when it starts from the previous boundary's basis? Measured on real
state trajectories: the bundled demo model (trained, 6 GDN layers × 2 heads of 128×128) truncating every head at
every boundary of a sample document, as the product does (the eager loop, warm-started ``TruncateCallback``).

At every boundary and head, before the product's own truncation moves the run on, the state is truncated again with
``iters`` = 0 … 5 filter steps per pass, from a cold start (the fixed random sketch) and from the basis the product
kept at the previous boundary; the energy error against the exact float64 SVD (retained energy, relative to ‖S‖²)
is recorded. One JSON line per (r, iters): the worst error and the share of states over the 1e-5 criterion, cold and
warm, next to the default count ``iterations_for(r)``.

    python bench/study_warm_start.py --tokens 4096          # CPU, a few minutes

Why: a warm start that needed one or two steps instead of four would cut the fused kernel's Cholesky-QRs and
products by half or more, and (with a nearly diagonal Rayleigh quotient) its Jacobi sweeps — the lever the truncated
run needs (bench/RESULTS.md, sixth session).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import emit  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--segment-len", type=int, default=256)
    ap.add_argument("--ranks", default="1,4,12,32")
    ap.add_argument("--max-iters", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    from gdnviz import runner
    from gdnviz.documents import sample_documents, tokenize
    from gdnviz.intervene import TruncateCallback, TruncationSpec
    from gdnviz.models import load
    from gdnviz.truncate import energy_error, iterations_for, truncate_states

    lm = load("demo", device="cpu", dtype="float32")
    text = "\n\n".join(d.text for d in sorted(sample_documents(), key=lambda d: -len(d.text)))
    ids = tokenize(lm.tokenizer, text)[: a.tokens]
    its = list(range(a.max_iters + 1))

    class Study(TruncateCallback):
        def __init__(self, info, spec):
            super().__init__(info, spec, warm_start=True)
            self.err = {"cold": {i: [] for i in its}, "warm": {i: [] for i in its}}

        def on_boundary(self, layer, position, state, rows=None):
            sel = self.per_layer.get(layer)
            if sel is not None and rows is None:
                heads, ranks = sel
                X = state[0, heads].double()
                r = int(ranks[0])
                prev = self._basis.get(layer)
                for i in its:
                    self.err["cold"][i].append(energy_error(X, truncate_states(X, r, iters=i), r))
                    if prev is not None:
                        w = truncate_states(X, r, warm_start=prev, iters=i)
                        self.err["warm"][i].append(energy_error(X, w, r))
            return super().on_boundary(layer, position, state, rows)

    for r in [int(x) for x in a.ranks.split(",")]:
        cb = Study(lm.info, TruncationSpec.all_heads(lm.info, r))
        runner.forward(lm, torch.tensor([ids]), segment_len=a.segment_len, callbacks=[cb], keep_hidden=False)
        for i in its:
            row = dict(what="warm_start_study", r=r, iters=i, default_iters=iterations_for(r), tokens=len(ids),
                       segment_len=a.segment_len)
            for kind in ("cold", "warm"):
                e = torch.cat(cb.err[kind][i]) if cb.err[kind][i] else torch.zeros(0)
                row[f"{kind}_states"] = int(e.numel())
                row[f"{kind}_max_err"] = float(f"{e.max().item():.3e}") if e.numel() else None
                row[f"{kind}_share_over_1e-5"] = round((e > 1e-5).double().mean().item(), 4) if e.numel() else None
            emit(**row)


if __name__ == "__main__":
    main()
