"""Truncated run (every GDN head cut to rank r at every boundary) vs a plain prefill of the same tokens, in the same
run (a guard benchmark).

    python bench/bench_truncated_run.py --device cuda --tokens 16384 --ranks 4,12,32 --eager-rank 0   # H200, bf16
    python bench/bench_truncated_run.py --device cpu --tokens 1024 --small                          # CPU smoke run

Rows (JSON lines): the plain prefill (``model.model``, no cache, no logits: the baseline); the segmented run without
callbacks; for each ``--ranks`` r the truncated run as gdnviz runs it (on CUDA the segment loop in CUDA-graph
windows; first call = capture, then the warm median), with its ratio to the plain prefill; with ``--mixed-ranks``
the heads of every layer at different ranks (graph windows and the eager loop); for ``--eager-rank`` the eager
segment loop, with the largest |Δ log-prob| against the graphed run at the last 16 positions. The graphed rows
count the timed runs' states by how the contract's deferred check treated them: ``states_checked`` (exactly) and
``states_certified`` (skipped: the kernel's attempts certified them). ``--profile N`` prints
the top N ops of one warm graphed run.
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import device_name, emit, qwen35_08b_config, random_model, run_parser, sync, timeit  # noqa: E402


def main():
    ap = run_parser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--ranks", default="1,4,12,32")
    ap.add_argument("--eager-rank", type=int, default=4, help="rank of the one eager-loop row (0: skip it)")
    ap.add_argument("--mixed-ranks", default="",
                    help="comma-separated ranks given to the heads of every layer in turn (head h gets ranks[h %% n]): "
                         "rows for graph windows and the eager loop")
    ap.add_argument("--small", action="store_true", help="4 layers / 4 heads, vocab 32000: a CPU smoke run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", type=int, default=0)
    args = ap.parse_args()

    from gdnviz import runner
    from gdnviz.models import from_model
    from gdnviz.truncation import TruncationSpec, contract
    from gdnviz.truncation.callback import TruncateCallback

    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = qwen35_08b_config()
    if args.small:
        cfg.num_hidden_layers, cfg.layer_types = 4, ["linear_attention"] * 3 + ["full_attention"]
        cfg.linear_num_key_heads = cfg.linear_num_value_heads = 4
        cfg.vocab_size = 32000
    model = random_model(cfg, dev, dtype)
    lm = from_model(model, "qwen3.5-0.8b-shape-random")
    T, L = args.tokens, args.segment_len
    ids = torch.randint(0, cfg.vocab_size - 1, (1, T), generator=torch.Generator().manual_seed(0)).to(dev)
    n_heads = len(lm.info.gdn_layers) * lm.info.num_heads
    base = dict(device=device_name(dev), tokens=T, segment_len=L, dtype=str(dtype), heads_truncated=n_heads,
                boundaries=T // L)
    last = list(range(T - 16, T))

    def plain():
        with torch.inference_mode():
            model.model(input_ids=ids, use_cache=False)

    t_plain = timeit(plain, dev, repeats=args.repeats)
    emit(what="plain_prefill", seconds=t_plain, **base)

    def scan_only():
        runner.forward(lm, ids, segment_len=L, keep_hidden=False)

    t_scan = timeit(scan_only, dev, repeats=args.repeats)
    emit(what="segmented_run_no_callbacks", seconds=t_scan, baseline="plain_prefill", ratio=t_scan / t_plain, **base)

    def truncated(r, graphs, holder=None):
        """One truncated run: every head at rank ``r``, or the per-head ranks of ``r`` when it is a TruncationSpec."""
        spec = r if isinstance(r, TruncationSpec) else TruncationSpec.all_heads(lm.info, r)
        ctx = runner.RunContext(segment_len=L, callbacks=[TruncateCallback(lm.info, spec)], graphs=graphs)
        # as the probes run it: held to the 1e-5 contract (checked on a side stream, answered again on a breach)
        out = contract.run_checked(
            lambda: runner.forward(lm, ids, logits_positions=last, keep_hidden=False, ctx=ctx), spec)
        if holder is not None:
            holder["logp"] = out.logits.float().log_softmax(-1)
            holder["readouts"] = sorted(ctx.readouts)

    graphed = {}
    for r in [int(x) for x in args.ranks.split(",") if x]:
        h = {}
        sync(dev)
        t0 = time.perf_counter()
        truncated(r, True, h)
        sync(dev)
        t_first = time.perf_counter() - t0
        c0 = contract.counts(dev)
        t = timeit(lambda: truncated(r, True), dev, repeats=args.repeats, warmup=0)
        c1 = contract.counts(dev)
        graphed[r] = h
        emit(what="truncated_run_graph", rank=r, seconds=t, first_call_seconds=t_first, baseline="plain_prefill",
             ratio=t / t_plain, readouts=h["readouts"], states_checked=c1["checked"] - c0["checked"],
             states_certified=c1["certified"] - c0["certified"], contract_breaches=c1["breaches"] - c0["breaches"],
             worst_energy_error=c1["worst"], **base)
    if args.mixed_ranks and dev.type == "cuda":
        mixed = [int(x) for x in args.mixed_ranks.split(",")]
        spec_m = TruncationSpec.from_dict({(l, h): mixed[h % len(mixed)] for l in lm.info.gdn_layers
                                           for h in range(lm.info.num_heads)})
        for graphs in (True, False):
            h = {}
            t_first = timeit(lambda: truncated(spec_m, graphs, h), dev, repeats=1, warmup=0)
            t = timeit(lambda: truncated(spec_m, graphs), dev, repeats=args.repeats if graphs else 1, warmup=0)
            emit(what="truncated_run_mixed_ranks", ranks=mixed, graphs=graphs,
                 seconds=t, first_call_seconds=t_first, baseline="plain_prefill", ratio=t / t_plain,
                 readouts=h["readouts"], **base)
    if args.eager_rank:
        r = args.eager_rank
        h = {}
        t = timeit(lambda: truncated(r, False, h), dev, repeats=1, warmup=0)
        row = dict(what="truncated_run_eager_loop", rank=r, seconds=t, baseline="plain_prefill", ratio=t / t_plain,
                   readouts=h["readouts"], **base)
        if r in graphed:
            row["max_abs_dlogp_graph_vs_eager"] = (graphed[r]["logp"] - h["logp"]).abs().max().item()
        emit(**row)
    if args.profile and dev.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        r = int(args.ranks.split(",")[0])
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            truncated(r, True)
            sync(dev)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.profile), flush=True)


if __name__ == "__main__":
    main()
