"""Where one fused CUDA truncation's time goes: the kernel of gdnviz.gpu.cuda_truncate built with GDNVIZ_PROFILE
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
from bench.bench_truncate import gdn_like_states, time_ms  # noqa: E402
from bench.common import device_name, emit  # noqa: E402
from gdnviz.gpu import cuda_truncate as ct  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ranks", default="1,4,12,32")
    ap.add_argument("--sizes", default="16,288")
    ap.add_argument("--attempts", action="store_true", help="profile the certified attempts (else the full algorithm)")
    a = ap.parse_args()
    os.environ["GDNVIZ_CUDA_TRUNCATE_ATTEMPT"] = "1" if a.attempts else "0"
    dev = torch.device(a.device)
    S = gdn_like_states(max(int(x) for x in a.sizes.split(",")), 128, 128, seed=0).float().to(dev)
    for n in [int(x) for x in a.sizes.split(",")]:
        for r in [int(x) for x in a.ranks.split(",")]:
            X = S[:n].contiguous()
            ct.truncate_cuda(X, r)
            torch.cuda.synchronize()
            us = time_ms(lambda: ct.truncate_cuda(X, r), dev, 3, 20) * 1e3
            extra = {}
            if a.attempts:
                cyc, done = ct.phase_cycles(X, r, attempts=True)
                extra = dict(certified=int(done.sum()) if done.numel() else 0)
                if done.numel() and done.any():
                    cyc = cyc[done.bool()]
            else:
                cyc = ct.phase_cycles(X, r)
            med = cyc.median(0).values
            row = {name: int(med[i]) for i, name in enumerate(ct.PHASES) if i < 15}
            emit(what="cuda_truncate_phases", n=n, r=r, attempts=a.attempts, us_per_launch=round(us, 1),
                 total_cycles=int(cyc[:, :15].sum(1).median()), jacobi_sweeps=int(med[15]),
                 cholqr_skipped_mean=round(cyc[:, 16].mean().item(), 2), cycles=row,
                 cholqr_parts={name: int(med[i]) for i, name in enumerate(ct.PHASES) if i >= 17},
                 device=device_name(dev), **extra)


if __name__ == "__main__":
    main()
