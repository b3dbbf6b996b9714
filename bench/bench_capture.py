"""Capture of a long document vs a plain prefill of the same tokens, in the same run (a guard benchmark).

    python bench/bench_capture.py --device cuda --tokens 16384            # H200, Qwen3.5-0.8B shape, bf16
    python bench/bench_capture.py --device cuda --tokens 131072 --repeats 1 --no-compare   # 128K: time and memory
    python bench/bench_capture.py --device cpu --tokens 4096 --demo-shape # the demo model's shape on CPU

Prints one JSON line per measurement: the plain prefill (``model.model``, no cache, no logits: the baseline), the
segmented run without callbacks, gdnviz's capture (segmented run + per-boundary spectra + key statistics; on CUDA
the one-pass state read-out with the statistics on a side stream), each with its ratio to the plain prefill; on
CUDA unless ``--no-compare`` the same capture with inline statistics and through the segment-by-segment loop;
``--naive`` the 256-token loop through a DynamicCache with state snapshots; peak GPU memory and host RSS.
``--profile N`` prints the top N ops of one capture; ``--new-lengths`` times the first capture at unseen lengths.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import (LAST_TIMES, device_name, emit, qwen35_08b_config, random_model,  # noqa: E402
                          run_parser, sync, timeit)


def main():
    ap = run_parser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--small", action="store_true", help="4 layers / 4 heads: a CPU smoke run")
    ap.add_argument("--demo-shape", action="store_true",
                    help="the bundled demo model's shape (hidden 256, 8 layers, 2 GDN heads of 128x128, vocab 8192)")
    ap.add_argument("--naive", action="store_true", help="also time the naive DynamicCache segment loop")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-lengths", default="",
                    help="comma-separated token counts: time the first capture at each new length vs the second")
    ap.add_argument("--profile", type=int, default=0, help="print the top N ops of one capture (torch.profiler)")
    ap.add_argument("--no-compare", action="store_true",
                    help="skip the inline-statistics and segment-loop captures (long documents: time and memory only)")
    args = ap.parse_args()

    from gdnviz import runner
    from gdnviz.capture import capture_document
    from gdnviz.models import from_model

    dev = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(args.dtype or ("bf16" if dev.type == "cuda" else "fp32"))
    cfg = qwen35_08b_config()
    if args.small:
        cfg.num_hidden_layers, cfg.layer_types = 4, ["linear_attention"] * 3 + ["full_attention"]
        cfg.linear_num_key_heads = cfg.linear_num_value_heads = 4
        cfg.vocab_size = 32000
    if args.demo_shape:
        from transformers import Qwen3_5TextConfig

        cfg = Qwen3_5TextConfig(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                                linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
                                linear_conv_kernel_dim=4, tie_word_embeddings=True, max_position_embeddings=16384)
    model = random_model(cfg, dev, dtype)
    lm = from_model(model, "qwen3.5-0.8b-shape-random")
    T, L = args.tokens, args.segment_len
    ids = torch.randint(0, cfg.vocab_size - 1, (1, T), generator=torch.Generator().manual_seed(0)).to(dev)
    base = dict(device=device_name(dev), tokens=T, segment_len=L, dtype=str(dtype), gdn_layers=len(lm.info.gdn_layers),
                heads=lm.info.num_heads, kernel_path=lm.info.kernel_path)

    def plain():
        with torch.inference_mode():
            model.model(input_ids=ids, use_cache=False)

    t_plain = timeit(plain, dev, repeats=args.repeats)
    plain_times = [round(x, 4) for x in LAST_TIMES]  # the spread: captures of identical settings differ by ~15 ms
    emit(what="plain_prefill", seconds=t_plain, **base)

    def scan_only():
        runner.forward(lm, ids, segment_len=L, keep_hidden=False)

    t_scan = timeit(scan_only, dev, repeats=args.repeats)
    emit(what="segmented_run_no_callbacks", seconds=t_scan, baseline="plain_prefill", ratio=t_scan / t_plain, **base)

    holder = {}

    def cap():
        holder["c"] = capture_document(lm, ids[0].cpu(), L)

    t_cap = timeit(cap, dev, repeats=args.repeats)
    cap_times = [round(x, 4) for x in LAST_TIMES]
    c = holder["c"]
    emit(what="capture", seconds=t_cap, baseline="plain_prefill", ratio=t_cap / t_plain,
         seconds_each=cap_times, plain_prefill_seconds_each=plain_times,
         stored_mb=len(c.to_bytes()) / 2**20, boundaries=len(c.positions), backends=c.meta["backends"],
         readouts=c.meta.get("readouts"), pipelined=c.meta.get("pipelined"),
         statistics_seconds=c.meta.get("statistics_seconds"), **base)
    if dev.type == "cuda" and not args.no_compare:  # the same capture with each layer's statistics inline
        def cap_inline():
            holder["i"] = capture_document(lm, ids[0].cpu(), L, pipeline=False)

        t_inl = timeit(cap_inline, dev, repeats=args.repeats)

        emit(what="capture_inline_statistics", seconds=t_inl, baseline="plain_prefill", ratio=t_inl / t_plain,
             pipelined_speedup=t_inl / t_cap, sv_identical=bool(np.array_equal(holder["i"].sv, c.sv)),
             statistics_seconds=holder["i"].meta.get("statistics_seconds"), **base)

    def cap_loop():
        holder["s"] = capture_document(lm, ids[0].cpu(), L, fast_states=False)

    if dev.type == "cuda" and not args.no_compare:  # the one-pass read-out is CUDA-only (CPU: both are the loop)
        t_loop = timeit(cap_loop, dev, repeats=args.repeats)
        emit(what="capture_segment_loop", seconds=t_loop, baseline="plain_prefill", ratio=t_loop / t_plain, **base)

        a, b = holder["c"], holder["s"]
        emit(what="capture_one_pass_vs_loop_max_rel_sv_diff",
             value=float(np.max(np.abs(a.sv - b.sv) / np.maximum(b.sv[..., :1], 1e-30))), **base)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        for name, fn in (("plain prefill", plain), ("capture", cap)):
            with profile(activities=acts, record_shapes=True) as prof:
                fn()
                sync(dev)
            print(f"=== profile: {name}", flush=True)
            print(prof.key_averages().table(sort_by=key, row_limit=args.profile), flush=True)
            if name == "capture":
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile), flush=True)
            # copies and casts by input shape: which tensors the capture moves (aten::copy_ was unattributed)
            rows = [e for e in prof.key_averages(group_by_input_shape=True)
                    if e.key in ("aten::copy_", "aten::_to_copy", "aten::to", "aten::clone", "aten::contiguous")]
            def self_time(e):  # FunctionEventAvg: self_device_time_total (torch ≥ 2.4) or self_cuda_time_total
                return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) \
                    if dev.type == "cuda" else e.self_cpu_time_total

            rows.sort(key=lambda e: -self_time(e))
            print(f"=== {name}: copies by input shape (top 20 by self {dev.type} time, us)", flush=True)
            for e in rows[:20]:
                print(f"  {e.key:16s} calls {e.count:6d}  self {self_time(e):10.0f}  shapes {e.input_shapes}",
                      flush=True)

    if args.new_lengths:
        # first capture at lengths this process has not seen yet (issue #6: no autotuning stall on a new length);
        # the same length again right after is the warm reference
        for n in [int(x) for x in args.new_lengths.split(",")]:
            x = torch.randint(0, cfg.vocab_size - 1, (n,), generator=torch.Generator().manual_seed(n))
            t0 = time.perf_counter()
            capture_document(lm, x, L)
            sync(dev)
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            capture_document(lm, x, L)
            sync(dev)
            emit(what="capture_first_call_at_new_length", tokens_new=n, first_s=first,
                 warm_s=time.perf_counter() - t0, **base)

    if args.naive:
        from transformers import DynamicCache

        gdn = list(lm.info.gdn_layers)

        def naive():
            cache = DynamicCache(config=model.config)
            snaps = []
            with torch.inference_mode():
                for s in range(0, T, L):
                    model.model(input_ids=ids[:, s:s + L], past_key_values=cache, use_cache=True)
                    snaps.append(torch.stack([cache.layers[i].recurrent_states[0] for i in gdn]).clone())
            return snaps

        t_naive = timeit(naive, dev, repeats=1)
        emit(what="naive_dynamiccache_loop_with_snapshots", seconds=t_naive, baseline="plain_prefill",
             ratio=t_naive / t_plain, **base)
    if dev.type == "cuda":
        emit(what="peak_gpu_memory_gib", value=torch.cuda.max_memory_allocated() / 2**30, **base)
    import resource

    emit(what="peak_host_rss_gib", value=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, **base)


if __name__ == "__main__":
    main()
