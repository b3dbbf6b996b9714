"""How a phased launch of the truncation kernel fills the GPU (issue #6 target 1 at r = 32; CUDA only).

``gdnviz.gpu.cuda_truncate.phase_trace`` runs the kernel's ``GDNVIZ_PHASE_TRACE`` build on N GDN-like states at rank r
with 2 or 3 thread blocks per state and reads back, per item, when its block took its ticket, when its wait for the
state's previous item ended and when it finished, and its SM. Printed per item count: the makespan (first ticket to
last end), each item's work time (wait end → end) and wait, the sum of work over the SMs against SMs × makespan (how
full the GPU was), and the work a perfect packing of the same items would need (sum / SMs). The launch is timed by
itself too (CUDA events, median of repeats), beside the one-block-per-state launch.

    PYTHONPATH=$PWD python3 bench/study_phase_schedule.py --n 288 --rank 32
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from bench.bench_truncate import gdn_like_states  # noqa: E402
from bench.common import device_name, emit  # noqa: E402
from gdnviz.gpu import cuda_truncate as ct  # noqa: E402


def _ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=288)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--save", default="", help="write the raw traces (torch.save: {items: [N, items, 4]}) here")
    a = ap.parse_args()
    dev = torch.device("cuda")
    S = gdn_like_states(a.n, 128, 128, seed=0).float().to(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    base = dict(device=device_name(dev), n=a.n, r=a.rank, sms=sms)
    ref = ct.truncate_cuda(S, a.rank)
    raw = {}
    for items in (2, 3):
        ct.phase_trace(S, a.rank, items)  # compile and warm
        tr = ct.phase_trace(S, a.rank, items)
        torch.cuda.synchronize()
        raw[items] = tr
        span = tr[..., 2].max().item()
        work = tr[..., 2] - tr[..., 1]
        wait = tr[..., 1] - tr[..., 0]
        per_item = {f"item{i}": dict(work_us_mean=round(work[:, i].mean().item(), 1),
                                     work_us_min=round(work[:, i].min().item(), 1),
                                     work_us_max=round(work[:, i].max().item(), 1),
                                     wait_us_mean=round(wait[:, i].mean().item(), 2),
                                     wait_us_max=round(wait[:, i].max().item(), 2)) for i in range(items)}
        busy = (tr[..., 2] - tr[..., 0]).sum().item()
        # item 0's work by its SM's index (parity and halves: L2 partition or GPC effects) and by state order
        sm = tr[:, 0, 3]
        by_sm = {"even_sm": work[sm % 2 == 0, 0].mean().item(), "odd_sm": work[sm % 2 == 1, 0].mean().item(),
                 "low_sm": work[sm < sms // 2, 0].mean().item(), "high_sm": work[sm >= sms // 2, 0].mean().item(),
                 "first_wave": work[tr[:, 0, 0] < 1.0, 0].mean().item(),
                 "later": work[tr[:, 0, 0] >= 1.0, 0].mean().item()}
        per_item["item0_work_us_by"] = {k: round(v, 1) for k, v in by_sm.items()}
        last_start = tr[..., 0].max().item()
        emit(what="phase_schedule", items=items, makespan_us=round(span, 1), sum_work_us=round(work.sum().item(), 1),
             packed_us=round(work.sum().item() / sms, 1), occupancy=round(busy / (sms * span), 3),
             last_ticket_us=round(last_start, 1), sms_used=int(tr[..., 3].unique().numel()), **per_item, **base)
    # what varies between states: the profile build's cycles per phase (thread 0; one block per state, no phasing)
    cyc = ct.phase_cycles(S, a.rank)
    total = cyc[:, :15].sum(1)
    spread = {name: [int(cyc[:, i].min()), int(cyc[:, i].median()), int(cyc[:, i].max())]
              for i, name in enumerate(ct.PHASES) if i < 15}
    sweeps = cyc[:, 15].long()
    emit(what="phase_cycles_spread", note="[min, median, max] over the states, thread 0's cycles",
         total=[int(total.min()), int(total.median()), int(total.max())], phases=spread,
         sweeps_histogram={int(k): int((sweeps == k).sum()) for k in sweeps.unique()},
         total_by_sweeps={int(k): int(total[sweeps == k].median()) for k in sweeps.unique()}, **base)
    raw["cycles"] = cyc
    if a.save:
        torch.save(raw, a.save)
    os.environ["GDNVIZ_CUDA_TRUNCATE_PHASED"] = "0"
    unphased = _ms(lambda: ct.truncate_cuda(S, a.rank), a.repeats)
    row = dict(unphased_ms=round(unphased, 4))
    for items in (2, 3):
        os.environ["GDNVIZ_CUDA_TRUNCATE_PHASED"] = str(items)
        row[f"phased{items}_ms"] = round(_ms(lambda: ct.truncate_cuda(S, a.rank), a.repeats), 4)
        row[f"phased{items}_same_bits"] = bool(torch.equal(ct.truncate_cuda(S, a.rank), ref))
    os.environ.pop("GDNVIZ_CUDA_TRUNCATE_PHASED")
    emit(what="phase_launch_eager", note="one eager launch each (CUDA events), not graph replay", **row, **base)


if __name__ == "__main__":
    main()
