"""Where one sweep batch's time goes: prefill and decode of the untouched and the truncated setting, and the top
CUDA ops (with input shapes) of the decode steps.

    python bench/studies/profile_sweep_batch.py --device cuda --length 4096 --batch 16 --rank 4 --top 20

Rows: ``ceiling`` (transformers' forward on the same left-padded batch, no cache), ``prefill`` (gdnviz's batched
prefill, one answer token) and ``greedy`` (prefill + ``--new`` answer tokens) per setting; ``decode_ms_per_step`` =
(greedy − prefill) / (new − 1). Then profiler tables of untouched decode steps alone (after a prefill), grouped by
input shape: eager static steps (every kernel under the aten op that launched it) and the same steps replayed from
the CUDA graph (``--top 0``: none).
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.common import emit, prompt_batches, qwen35_08b_config, random_model, sync  # noqa: E402


def main():
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args()

    from gdnviz.models import from_model, load
    from gdnviz.probes.batch import batched_greedy, pad_left
    from gdnviz.truncation import TruncationSpec

    dev = torch.device(a.device)
    demo = load("demo", device=str(dev), dtype="bfloat16")
    model = random_model(qwen35_08b_config(vocab_size=len(demo.tokenizer)), dev, torch.bfloat16)
    lm = from_model(model, "qwen3.5-0.8b-shape-random", tokenizer=demo.tokenizer)
    prompts = prompt_batches(lm, "niah_single_1", a.length, a.batch, a.batch)[0]
    base = dict(length=a.length, batch=len(prompts), tokens=[len(p) for p in prompts][:3])

    def timed(fn, reps=2):
        fn()
        best = 1e9
        for _ in range(reps):
            sync(dev)
            t = time.perf_counter()
            fn()
            sync(dev)
            best = min(best, time.perf_counter() - t)
        return best

    ids, mask, _ = pad_left(prompts)

    def ceiling():
        with torch.inference_mode():
            lm.model.model(input_ids=ids.to(dev), attention_mask=mask.to(dev), use_cache=False)

    emit(what="ceiling", seconds=round(timed(ceiling), 4), **base)
    for name, spec in (("untouched", None), (f"r={a.rank}", TruncationSpec.all_heads(lm.info, a.rank))):
        p = timed(lambda: batched_greedy(lm, prompts, 1, spec=spec, stop_ids=set()))
        g = timed(lambda: batched_greedy(lm, prompts, a.new, spec=spec, stop_ids=set()), reps=1)
        emit(what="setting", setting=name, prefill_seconds=round(p, 4), greedy_seconds=round(g, 4),
             decode_ms_per_step=round(1000 * (g - p) / (a.new - 1), 3), **base)
    if not a.top:  # --top 0: the timings alone
        return
    from torch.profiler import ProfilerActivity, profile

    from gdnviz.probes.batch import batched_forward
    from gdnviz.static_decode import StaticDecoder

    # the decode steps alone: untouched, eager static steps (graph=False, so every kernel is attributed to the aten
    # op that launched it), then the same steps replayed from the graph (the kernels a sweep's decode really runs)
    for graph in (False, True):
        out, ctx, mask, _ = batched_forward(lm, prompts, use_cache=True, logits_positions="last", keep_hidden=False)
        dec = StaticDecoder(lm, ctx, out.cache, a.new, attention_mask=mask, positions=mask.sum(-1), graph=graph)
        del out
        nxt = [0] * len(prompts)
        for _ in range(4):  # warm-up, and the graph's capture
            dec.step(nxt)
        sync(dev)
        steps = a.new - 4
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            t = time.perf_counter()
            for _ in range(steps):
                dec.step(nxt)
            sync(dev)
            ms = 1000 * (time.perf_counter() - t) / steps
        emit(what="decode_profile", graph=graph, replays=dec.replays, reason=dec.reason,
             ms_per_step_profiled=round(ms, 3), steps=steps, **base)
        print(prof.key_averages(group_by_input_shape=True).table(
            sort_by="device_time_total", row_limit=a.top, max_name_column_width=60, max_shapes_column_width=110))

if __name__ == "__main__":
    main()
