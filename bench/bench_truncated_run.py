"""Truncated run (every GDN head cut to rank r at every boundary) vs a plain prefill of the same tokens, same run.

    python bench/bench_truncated_run.py --device cuda --tokens 16384          # H200, Qwen3.5-0.8B shape, bf16
    python bench/bench_truncated_run.py --device cpu --tokens 1024 --small    # CPU smoke run

Issue #6 target 3: 16K tokens with all 288 heads truncated at all 64 boundaries in ≤ 2× the plain prefill. Rows
(JSON lines): plain prefill (``model.model``, no cache, no logits); the segmented run without callbacks; for each
r the truncated run with the segment loop in CUDA-graph windows (``gdnviz.gpu.scan_graph``; first call = capture,
then the warm median; the boundary work is the CUDA truncation kernel, ``gdnviz.truncation.dispatch``), and for one
r the eager loop (one fla call + one truncation call per segment); the max |Δ log-prob| of the graph run against
the eager run at the last 16 positions (the same kernel: rounding-level differences at most). ``--profile N`` prints
the top N ops of one warm graphed run.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import (device_name, emit, env, fla_conv_flip, qwen35_08b_config, random_model,  # noqa: E402
                          run_parser, second_baselines, sync, timeit)


def main():
    ap = run_parser()
    ap.add_argument("--ranks", default="1,4,12,32")
    ap.add_argument("--eager-rank", type=int, default=4, help="rank of the one eager-loop row (0: skip it)")
    ap.add_argument("--mixed-ranks", default="",
                    help="comma-separated ranks given to the heads of every layer in turn (head h gets ranks[h %% n]): "
                         "rows for graph windows (the CUDA kernel with per-head ranks) and the "
                         "eager loop")
    ap.add_argument("--small", action="store_true", help="4 layers / 4 heads, vocab 32000: a CPU smoke run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", type=int, default=0)
    ap.add_argument("--split-ab", action="store_true",
                    help="after each --ranks row, the same run with GDNVIZ_SPLIT_SCAN=0 (fla's whole chunk pass per "
                         "segment inside the graph windows instead of its chunk-local half once per window); the "
                         "row says whether the last positions' log-probabilities are identical")
    ap.add_argument("--qknorm-ab", action="store_true",
                    help="the run without callbacks and each --ranks row again with q̂, k̂ normalised the other way "
                         "than the default (GDNVIZ_FAST_QK_NORM=0: through float32; =1: straight into the value "
                         "dtype, kernels.unit_rows), with the largest change of the last positions' log-probabilities")
    ap.add_argument("--fla-conv-ab", action="store_true",
                    help="the plain prefill with GDNVIZ_FLA_CONV=all (fla's causal_conv1d instead of transformers' "
                         "PyTorch fallback) first, a second baseline every row is also divided by, then the run "
                         "without callbacks and each --ranks row with the other convolution than the default")
    ap.add_argument("--env-ab", action="append", default=[],
                    help="NAME=VALUE[,NAME=VALUE...]: the run without callbacks and each --ranks row again with these "
                         "environment variables set (CUDA graphs recaptured); repeatable")
    args = ap.parse_args()

    from gdnviz import runner
    from gdnviz.gpu import scan_graph
    from gdnviz.truncation import TruncateCallback, TruncationSpec
    from gdnviz.models import from_model

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
    ratios = second_baselines(args.fla_conv_ab, plain, dev, args.repeats, t_plain, base)

    def scan_only():
        runner.forward(lm, ids, segment_len=L, keep_hidden=False)

    t_scan = timeit(scan_only, dev, repeats=args.repeats)
    emit(what="segmented_run_no_callbacks", seconds=t_scan, baseline="plain_prefill", ratio=t_scan / t_plain,
         **ratios(t_scan), **base)

    def truncated(r, graphs, holder=None):
        """One truncated run: every head at rank ``r``, or the per-head ranks of ``r`` when it is a TruncationSpec."""
        spec = r if isinstance(r, TruncationSpec) else TruncationSpec.all_heads(lm.info, r)
        ctx = runner.RunContext(segment_len=L, callbacks=[TruncateCallback(lm.info, spec)], graphs=graphs)
        out = runner.forward(lm, ids, logits_positions=last, keep_hidden=False, ctx=ctx)
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
        t = timeit(lambda: truncated(r, True), dev, repeats=args.repeats, warmup=0)
        graphed[r] = h
        emit(what="truncated_run_graph", rank=r, seconds=t, first_call_seconds=t_first, baseline="plain_prefill",
             ratio=t / t_plain, **ratios(t), readouts=h["readouts"], **base)
        if args.split_ab:
            h0 = {}
            with env("GDNVIZ_SPLIT_SCAN", "0"):
                truncated(r, True, h0)
                t0 = timeit(lambda: truncated(r, True), dev, repeats=args.repeats, warmup=0)
            scan_graph.clear()
            emit(what="truncated_run_graph_unsplit", rank=r, seconds=t0, baseline="plain_prefill", ratio=t0 / t_plain,
                 split_seconds=t, split_speedup=t0 / t,
                 logp_identical=bool(torch.equal(h0["logp"], h["logp"])),
                 max_abs_logp_diff=float((h0["logp"] - h["logp"]).abs().max()), **base)
    def switched_rows(suffix):
        """Inside a switch's env block: the run without callbacks and each graphed rank again, rows named with
        ``suffix``, each with the largest change of the last positions' log-probabilities against its default row
        and its ratio to every second baseline."""
        t_nc = timeit(scan_only, dev, repeats=args.repeats)
        emit(what=f"segmented_run_no_callbacks_{suffix}", seconds=t_nc, baseline="plain_prefill",
             ratio=t_nc / t_plain, default_seconds=t_scan, **ratios(t_nc), **base)
        for r, h in graphed.items():
            hs = {}
            truncated(r, True, hs)
            t = timeit(lambda: truncated(r, True), dev, repeats=args.repeats, warmup=0)
            emit(what=f"truncated_run_graph_{suffix}", rank=r, seconds=t, baseline="plain_prefill", ratio=t / t_plain,
                 **ratios(t), max_abs_logp_diff=float((hs["logp"] - h["logp"]).abs().max()), **base)

    if args.qknorm_ab:
        with env("GDNVIZ_FAST_QK_NORM", "0" if runner.FAST_QK_NORM else "1"):
            switched_rows("float32_qk_norm" if runner.FAST_QK_NORM else "fast_qk_norm")
    if args.fla_conv_ab:
        value, suffix = fla_conv_flip()
        with env("GDNVIZ_FLA_CONV", value):
            switched_rows(suffix)
    for spec in args.env_ab:
        pairs = [kv.split("=", 1) for kv in spec.split(",") if kv]
        scan_graph.clear()
        with contextlib.ExitStack() as stack:
            for k, v in pairs:
                stack.enter_context(env(k, v))
            switched_rows("env_" + "_".join(f"{k.removeprefix('GDNVIZ_').lower()}{v}" for k, v in pairs))
        scan_graph.clear()
    if args.mixed_ranks and dev.type == "cuda":
        mixed = [int(x) for x in args.mixed_ranks.split(",")]
        spec_m = TruncationSpec({(l, h): mixed[h % len(mixed)] for l in lm.info.gdn_layers
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
