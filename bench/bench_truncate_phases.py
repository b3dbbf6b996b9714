"""Where one CUDA truncation's time goes: the kernel of gdnviz.truncation.cuda built with GDNVIZ_PROFILE
(thread 0 sums clock64() deltas per phase), on GDN-like float32 states, next to the kernel's wall time (CUDA events,
the normal build) for the same batch.

    python bench/bench_truncate_phases.py --device cuda [--attempts]

One JSON line per (states, rank): median cycles per phase over the states, Jacobi sweeps, the mean number of checked
Cholesky-QRs skipped per state, the Cholesky-QR's cycles by part, total cycles, and the normal build's time per launch
in µs. ``--attempts``: the certified attempts on (the default of ``truncate_cuda``);
the medians are then over the states an attempt certified (``certified`` of ``n``), the time is the whole call's.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench_truncate import time_ms  # noqa: E402
from bench.common import device_name, emit  # noqa: E402
from gdnviz.truncation import cuda as ct  # noqa: E402
from tests.support.states import gdn_like_states  # noqa: E402

# The GDNVIZ_PROFILE build's counters: clock64() cycles of thread 0 per phase (summed over passes and calls); index 15
# counts Jacobi sweeps, 16 the checked Cholesky-QRs that found their block orthonormal already; 17 … 19 split
# "cholqr" by part (QᵀQ and its check; warp 0's factorisation; the substitution). The Jacobi's time is jacobi +
# jacobi_rotations + jacobi_barriers + jacobi_apply (jacobi alone keeps the per-sweep stop test).
PHASES = ("gram_G", "sketch_Z", "cholqr", "gemm_GQ", "refill", "ritz_T", "jacobi", "select_U", "deflate_G", "load_U",
          "project", "certify", "jacobi_rotations", "jacobi_barriers", "jacobi_apply", "jacobi_sweeps",
          "cholqr_skipped", "cholqr_gram_check", "cholqr_factor", "cholqr_subst")


def phase_cycles(X: torch.Tensor, rank: int, attempts: bool = False):
    """Per state, the counters of ``PHASES`` (float64 ``[N, 20]``, CPU) from the profile build; the outputs are
    ``truncate_cuda``'s. ``attempts=False``: the full algorithm only; ``True``: returns (cycles, done) — a state with
    done = 1 holds its attempt's counters, the others the full algorithm's."""
    res = ct.launch(X, int(rank), None, profile=True, attempts=attempts)
    cyc = res.scratch[:, 0, :len(PHASES)].cpu()
    return (cyc, res.done.cpu()) if attempts else cyc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ranks", default="1,4,12,32")
    ap.add_argument("--sizes", default="16,288")
    ap.add_argument("--attempts", action="store_true", help="profile the certified attempts (else the full algorithm)")
    a = ap.parse_args()
    dev = torch.device(a.device)
    S = gdn_like_states(max(int(x) for x in a.sizes.split(",")), 128, 128, seed=0).float().to(dev)
    for n in [int(x) for x in a.sizes.split(",")]:
        for r in [int(x) for x in a.ranks.split(",")]:
            X = S[:n].contiguous()
            ct.launch(X, r, attempts=a.attempts)
            torch.cuda.synchronize()
            us = time_ms(lambda: ct.launch(X, r, attempts=a.attempts), dev, 3, 20) * 1e3
            extra = {}
            if a.attempts:
                cyc, done = phase_cycles(X, r, attempts=True)
                extra = dict(certified=int(done.sum()) if done.numel() else 0)
                if done.numel() and done.any():
                    cyc = cyc[done.bool()]
            else:
                cyc = phase_cycles(X, r)
            med = cyc.median(0).values
            row = {name: int(med[i]) for i, name in enumerate(PHASES) if i < 15}
            emit(what="truncation_kernel_phases", n=n, r=r, attempts=a.attempts, us_per_launch=round(us, 1),
                 total_cycles=int(cyc[:, :15].sum(1).median()), jacobi_sweeps=int(med[15]),
                 cholqr_skipped_mean=round(cyc[:, 16].mean().item(), 2), cycles=row,
                 cholqr_parts={name: int(med[i]) for i, name in enumerate(PHASES) if i >= 17},
                 device=device_name(dev), **extra)


if __name__ == "__main__":
    main()
