"""Where a capture's statistics spend their time, per component, without the model: the library's own statistics
code (gdnviz.capture.CaptureCallback, gdnviz.statistics) on synthetic inputs of one GDN layer of Qwen3.5-0.8B's shape
(16 heads, 128×128 states, unit keys, log-decays in float32), each component timed alone (device synchronised, median
of --repeats), then every layer of a whole capture's statistics with the host assembly at the end.

    python bench/bench_capture_stats.py --device cuda --tokens 16384

One JSON line per component (keys float32, as a capture hands them; ``--key-dtype bfloat16`` otherwise): ms per layer,
and × the number of GDN layers (18) as ms per capture. Components: ``keycone_parts`` (the key cone's sums and
eigenvalues in a solve of their own), ``keycone_sums`` (the sums alone, as a capture runs them), ``layer_input`` (that
+ gates, key mean and samples, and their copies to the host), ``svdvals`` (the boundary states' spectra),
``layer_end`` (the spectra with the key cone's matrices' eigenvalues in the same solve, the final state, and the
copies), ``all_layers`` (both jobs for every layer as a capture launches them, then ``result()``: waiting for the GPU
and assembling the host arrays), and ``result_assembly`` (``result()``'s host part alone, from
``statistics_seconds["results"]``). Compare ``all_layers`` with bench_capture.py's capture minus its run without
callbacks to see how much of the statistics the forward hides.
"""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import device_name, emit, run_parser, timeit  # noqa: E402


def main():
    ap = run_parser()
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", type=int, default=0, help="CUDA kernels of one keycone_parts call (top N)")
    ap.add_argument("--key-dtype", default="float32",
                    help="the keys' dtype: float32 as a capture hands them (on_layer_input), or bfloat16")
    args = ap.parse_args()
    from gdnviz.analysis.keycone import keycone_sums
    from gdnviz.capture import CaptureCallback
    from gdnviz.statistics import batched_svdvals, keycone_parts

    dev = torch.device(args.device)
    T, L, H, K, NL = args.tokens, args.segment_len, args.heads, args.dk, args.layers
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(1, T, H, K, generator=gen)
    keys = (keys / torch.linalg.vector_norm(keys, dim=-1, keepdim=True)).to(dev, getattr(torch, args.key_dtype))
    g = torch.log(torch.rand(1, T, H, generator=gen) * 0.1 + 0.9).to(dev)
    beta = torch.rand(1, T, H, generator=gen).to(dev, torch.bfloat16)
    nb = T // L
    states = (torch.randn(nb, 1, H, K, K, generator=gen) / K).to(dev)  # [NB, B=1, H, K, V] as the runner hands them
    final = states[-1].clone()
    info = SimpleNamespace(gdn_layers=list(range(NL)), num_heads=H, d_k=K, d_v=K)
    base = dict(device=device_name(dev), tokens=T, segment_len=L, heads=H, d_k=K, layers=NL, key_dtype=args.key_dtype)

    def row(what, seconds, **kw):
        emit(what=what, ms_per_layer=seconds * 1e3, ms_per_capture=seconds * 1e3 * NL, **kw, **base)

    row("keycone_parts", timeit(lambda: keycone_parts(keys[0], g[0]), dev, args.repeats))
    row("keycone_sums", timeit(lambda: keycone_sums(keys[0], g[0]), dev, args.repeats))  # what a capture runs
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        keycone_parts(keys[0], g[0])
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            keycone_parts(keys[0], g[0])
            torch.cuda.synchronize()
        print("keycone_parts")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.profile, max_name_column_width=70))
    cb = CaptureCallback(info, T, L)
    cb.on_layer_input(0, 0, keys, g, beta)  # allocates the host buffers
    row("layer_input", timeit(lambda: cb._layer_input_stats(0, keys[0], g[0], beta[0]), dev, args.repeats))
    row("svdvals", timeit(lambda: batched_svdvals(states[:, 0]), dev, args.repeats), states=nb * H)
    mats = cb._kc_mats[0]  # the key cone's matrices from layer_input, solved with the spectra in layer_end

    def layer_end():
        cb._kc_mats[0] = mats
        cb._layer_end_stats(0, [states[:, 0]], final)

    row("layer_end", timeit(layer_end, dev, args.repeats))
    cb.close()

    holder = {}

    def whole():
        c = CaptureCallback(info, T, L)
        for layer in range(NL):
            c.on_layer_input(layer, 0, keys, g, beta)
            c.on_boundaries(layer, list(range(L, T + 1, L)), states)
            c.on_layer_end(layer, T, final)
        holder["res"] = c.result({})
        holder["secs"] = c.statistics_seconds

    t = timeit(whole, dev, args.repeats)
    emit(what="all_layers", ms_per_capture=t * 1e3, statistics_seconds=holder["secs"], **base)
    emit(what="result_assembly", ms_per_capture=holder["secs"].get("results", float("nan")) * 1e3, **base)


if __name__ == "__main__":
    main()
