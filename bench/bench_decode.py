"""Milliseconds per greedy decode step: gdnviz's decoder vs its runner's DynamicCache step, in the same run.

The baseline is gdnviz's runner step through a DynamicCache; against it: gdnviz's ``StaticDecoder``
(``gdnviz.static_decode``: what ``gdnviz.generate`` and sweeps run on CUDA), eager and replayed from a CUDA graph,
and transformers' own forward through a StaticCache (eager and graphed, no gdnviz) for reference.

Rows (``--device cuda``: the 0.8B shape, random weights, bf16; ``--device cpu``: a 24-layer model of tiny widths,
float32, without the graphs):

* ``decode_runner``: ms per step, gdnviz's runner through the run's DynamicCache (the baseline; its greedy tokens are
  fed to every other form, so the logits compare step by step);
* ``decode_gdnviz_static`` / ``decode_gdnviz_graph`` (CUDA): gdnviz's ``StaticDecoder``, its steps eager / replayed
  from a CUDA graph, building the StaticCache, warm-up and capture included; logits against the baseline's;
* ``decode_static``: transformers' forward through a StaticCache of ``prompt + steps`` positions with explicit
  position ids and attention-mask columns, eager; ``max_abs_logit_diff`` against the baseline;
* ``decode_graph`` (CUDA): one captured StaticCache step of transformers replayed; its logits against
  ``decode_static``'s (same cache, same tokens), ``tokens_equal``; ``speedup`` against the baseline.

    python bench/bench_decode.py --device cuda --prompt 4096 --batch 1,4 --steps 64
    python bench/bench_decode.py --device cpu --prompt 256 --batch 1 --steps 8   # CPU smoke run
    python bench/bench_decode.py --device cuda --prompt 4096 --batch 16 --steps 64 --profile 8

``--profile N`` (CUDA): after the timed steps, N more steps of gdnviz's decoder (replays) under ``torch.profiler``: the
GPU ops per step and the CUDA kernels by total time (where a replayed step's time goes). ``--sdpa default,math,...``: the
graphed decoder again with transformers' SDPA (all backends, or only the one named) in place of gdnviz's one-token
attention kernel (``gdnviz.gpu.decode_attention``): ``decode_gdnviz_graph_sdpa`` rows. ``replay_ms``: the
steps after the capture alone.

The prompt is random tokens; no truncation.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import device_name, emit, qwen35_08b_config, random_model, sync  # noqa: E402


def tiny_config():
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=24,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=8192, tie_word_embeddings=True)


def cache_tensors(cache) -> list[torch.Tensor]:
    """Every tensor a cache holds (attention keys/values and lengths, GDN conv and recurrent states)."""
    out = []
    for layer in cache.layers:
        for v in vars(layer).values():
            if isinstance(v, torch.Tensor):
                out.append(v)
            elif isinstance(v, dict):
                out.extend(x for x in v.values() if isinstance(x, torch.Tensor))
    return out


class TransformersStaticStep:
    """One greedy decode step through a StaticCache with static inputs: ``tok [B, 1]``, ``pos [B, 1]`` and a boolean
    attention mask ``[B, 1, 1, M]`` over the cache's M positions (column j visible once position j is written)."""

    def __init__(self, model, ids: torch.Tensor, steps: int):
        from transformers import StaticCache

        B, P = ids.shape
        self.model, self.P = model, P
        self.cache = StaticCache(config=model.config, max_cache_len=P + steps)
        with torch.inference_mode():
            model(ids, past_key_values=self.cache, use_cache=True)  # the prefill fills the cache
        dev = ids.device
        self.tok = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.pos = torch.empty(B, 1, dtype=torch.long, device=dev)
        self.mask = torch.empty(B, 1, 1, P + steps, dtype=torch.bool, device=dev)
        self.snapshot = [t.clone() for t in cache_tensors(self.cache)]
        self.graph = None
        self.out = None
        self.restore()

    def restore(self) -> None:
        """The cache as the prefill left it; the next step at position P, with the prompt's P columns visible."""
        for t, s in zip(cache_tensors(self.cache), self.snapshot):
            t.copy_(s)
        self.pos.fill_(self.P)
        self.mask.zero_()
        self.mask[..., :self.P] = True

    def _step(self) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(input_ids=self.tok, position_ids=self.pos, past_key_values=self.cache, use_cache=True,
                              attention_mask={"full_attention": self.mask, "linear_attention": None}).logits[:, -1]

    def capture(self) -> None:
        """Warm up on a side stream from the prefill's cache, restore it, capture one step (capturing runs no
        kernel). The restore before the warm-up matters: after a timed run the attention layers' device-side
        ``cumulative_length`` stands at the cache's end, and the warm-up's writes would go past it (``index_copy_():
        index out of bounds`` on the H200)."""
        self.restore()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self.set_step(0, self.tok)
                self._step()
        torch.cuda.current_stream().wait_stream(s)
        self.restore()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self._step()

    def set_step(self, i: int, tok: torch.Tensor) -> None:
        """Step i decodes ``tok`` at position P + i."""
        self.tok.copy_(tok)
        self.pos.fill_(self.P + i)
        self.mask[..., self.P + i] = True

    def run(self, tokens: list[torch.Tensor], graph: bool) -> list[torch.Tensor]:
        self.restore()
        logits = []
        for i, t in enumerate(tokens):
            self.set_step(i, t)
            if graph:
                self.graph.replay()
                logits.append(self.out.float().clone())
            else:
                logits.append(self._step().float())
        return logits


def runner_prefill(lm, ids: torch.Tensor):
    """gdnviz's prefill of ``ids`` into a DynamicCache, as ``gdnviz.generate`` runs it: (its RunContext, RunOutput with
    the last position's logits), device synchronised."""
    from gdnviz import runner

    ctx = runner.RunContext(segment_len=runner.DEFAULT_SEGMENT_LEN)
    out = runner.forward(lm, ids, use_cache=True, logits_positions="last", keep_hidden=False, ctx=ctx)
    sync(ids.device)
    return ctx, out


def runner_decode(lm, ids: torch.Tensor, steps: int):
    """The baseline: greedy steps as gdnviz decodes (``gdnviz.generate`` / ``gdnviz.probes.batch``: ``runner.forward``
    one token at a time through the run's DynamicCache, the GDN layers through gdnviz's scan); returns (tokens fed
    [steps × [B, 1]], logits, seconds)."""
    from gdnviz import runner

    ctx, out = runner_prefill(lm, ids)
    tokens, logits = [], []
    t = time.perf_counter()
    nxt = out.logits[:, -1:].argmax(-1)
    for _ in range(steps):
        tokens.append(nxt)
        out = runner.forward(lm, nxt, use_cache=True, cache=out.cache, logits_positions="last", keep_hidden=False,
                             ctx=ctx)
        logits.append(out.logits[:, -1].float())
        nxt = out.logits[:, -1:].argmax(-1)
    sync(ids.device)
    return tokens, logits, time.perf_counter() - t


def gdnviz_static_decode(lm, ids: torch.Tensor, tokens: list, graph: bool, extra: int = 0):
    """gdnviz's own decoder (``gdnviz.static_decode.StaticDecoder``, what ``gdnviz.generate`` and sweeps run on
    CUDA) after a runner prefill, fed ``tokens``: (logits, ms per step, replays). The time includes building the
    StaticCache, the eager warm-up step and the capture, as every generation pays them."""
    from gdnviz.static_decode import StaticDecoder

    ctx, out = runner_prefill(lm, ids)
    t = time.perf_counter()
    dec = StaticDecoder(lm, ctx, out.cache, len(tokens) + extra,
                        attention_mask=torch.ones(ids.shape, dtype=torch.long), graph=graph)
    logits, t_replay, n_replay = [], None, 0
    for nxt in tokens:
        logits.append(dec.step(nxt.reshape(-1)))
        if t_replay is None and dec.replays:  # the capture step: replays alone are timed from here
            sync(ids.device)
            t_replay, n_replay = time.perf_counter(), dec.replays
    sync(ids.device)
    end = time.perf_counter()
    dec.replay_ms = (end - t_replay) / (dec.replays - n_replay) * 1e3 if t_replay and dec.replays > n_replay else None
    return logits, (end - t) / len(tokens) * 1e3, dec


def profile_steps(dec, tok: torch.Tensor, n: int, top: int = 25) -> None:
    """Print what ``n`` more steps of ``dec`` (built with ``n`` steps to spare, replaying its graph) run on the GPU:
    kernels per step, GPU kernel time per step, and the kernels by total GPU time."""
    from torch.profiler import ProfilerActivity, profile

    sync(tok.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            dec.step(tok)
        torch.cuda.synchronize()
    kernels = [r for r in prof.key_averages() if r.self_device_time_total > 0]
    total = sum(r.self_device_time_total for r in kernels)
    print(f"profile: {sum(r.count for r in kernels) / n:.0f} GPU ops per step, "
          f"{total / n / 1e3:.3f} ms of GPU time per step ({dec.replays} replays so far)", flush=True)
    for r in sorted(kernels, key=lambda r: -r.self_device_time_total)[:top]:
        print(f"  {r.self_device_time_total / n / 1e3:8.4f} ms/step  {r.count / n:5.1f}x  {r.key[:110]}", flush=True)


def max_diff(a: list, b: list) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompt", type=int, default=4096, help="prompt tokens")
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--sdpa", default="", help="CUDA: also gdnviz's graphed decoder through transformers' SDPA instead of its "
                    "decode-attention kernel: 'default' (every backend) or SDPBackend names, comma-separated")
    ap.add_argument("--profile", type=int, default=0, help="CUDA: profile this many more steps of gdnviz's decoder")
    a = ap.parse_args()

    from gdnviz.models import from_model

    dev = torch.device(a.device)
    if dev.type == "cuda":
        model = random_model(qwen35_08b_config(), dev, torch.bfloat16)
    else:
        model = random_model(tiny_config(), dev, torch.float32)
    lm = from_model(model, "decode-bench")  # gdnviz's adapter: torch kernels on CPU, fla's on CUDA
    base = dict(device=device_name(dev), prompt=a.prompt, steps=a.steps, dtype=str(next(model.parameters()).dtype),
                layers=model.config.num_hidden_layers)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():  # the caches' tensors are inference tensors: every in-place update happens inside
        for B in (int(x) for x in a.batch.split(",") if x):
            run_batch(lm, dev, g, B, a, base)


def timed_run(dec: TransformersStaticStep, tokens: list, graph: bool, dev) -> tuple[list, float]:
    """(logits per step, ms per step) of ``dec.run`` after a two-step warm-up."""
    dec.run(tokens[:2], graph=graph)
    sync(dev)
    t = time.perf_counter()
    logits = dec.run(tokens, graph=graph)
    sync(dev)
    return logits, (time.perf_counter() - t) / len(tokens) * 1e3


def run_batch(lm, dev, g, B: int, a, base: dict) -> None:
    """The rows for batch size B (inside inference mode)."""
    model = lm.model
    ids = torch.randint(10, model.config.vocab_size, (B, a.prompt), generator=g).to(dev)
    runner_decode(lm, ids, 2)  # warm-up (kernels compile and autotune at these shapes)
    tokens, ref, t_run = runner_decode(lm, ids, a.steps)
    ms_ref = t_run / a.steps * 1e3
    emit(what="decode_runner", batch=B, ms_per_step=round(ms_ref, 3),
         logit_scale=max(x.abs().max().item() for x in ref), **base)
    for graph in ((False, True) if dev.type == "cuda" else (False,)):
        gd, ms_gd, dec = gdnviz_static_decode(lm, ids, tokens, graph, extra=a.profile if graph else 0)
        emit(what="decode_gdnviz_graph" if graph else "decode_gdnviz_static", batch=B, ms_per_step=round(ms_gd, 3),
             replay_ms=dec.replay_ms and round(dec.replay_ms, 3),
             speedup=round(ms_ref / ms_gd, 2), max_abs_logit_diff=max_diff(gd, ref), replays=dec.replays,
             tokens_equal=all(torch.equal(x.argmax(-1), y.argmax(-1)) for x, y in zip(gd, ref)), **base)
        if graph and a.profile and dec.graph is not None:
            profile_steps(dec, tokens[-1].reshape(-1), a.profile)
        del dec
    for name in (x for x in a.sdpa.split(",") if x and dev.type == "cuda"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from gdnviz.gpu import decode_attention

        only = contextlib.nullcontext() if name == "default" else sdpa_kernel([getattr(SDPBackend, name.upper())])
        keep = decode_attention.supported
        decode_attention.supported = lambda *args: False  # this row: transformers' SDPA instead of the kernel
        try:
            with only:
                gd, ms_gd, dec = gdnviz_static_decode(lm, ids, tokens, True)
        finally:
            decode_attention.supported = keep
        emit(what="decode_gdnviz_graph_sdpa", sdpa=name, batch=B, ms_per_step=round(ms_gd, 3),
             replay_ms=dec.replay_ms and round(dec.replay_ms, 3), max_abs_logit_diff=max_diff(gd, ref),
             replays=dec.replays, **base)
        del dec
    dec = TransformersStaticStep(model, ids, a.steps)
    static, ms_static = timed_run(dec, tokens, False, dev)
    emit(what="decode_static", batch=B, ms_per_step=round(ms_static, 3), speedup=round(ms_ref / ms_static, 2),
         max_abs_logit_diff=max_diff(static, ref), **base)
    if dev.type == "cuda":
        graph_rows(dec, tokens, static, ms_ref, dev, B, base)


def graph_rows(dec: TransformersStaticStep, tokens: list, static: list, ms_ref: float, dev, B: int,
               base: dict) -> None:
    """The graphed step's row (CUDA): ms per step replayed, its logits against the eager StaticCache step's."""
    try:
        dec.capture()
    except Exception as e:  # noqa: BLE001 - a finding to report, not a crash of the bench
        emit(what="decode_graph", batch=B, error=f"{type(e).__name__}: {str(e)[:400]}", **base)
        return
    graphed, ms_graph = timed_run(dec, tokens, True, dev)
    emit(what="decode_graph", batch=B, ms_per_step=round(ms_graph, 3), speedup=round(ms_ref / ms_graph, 2),
         max_abs_logit_diff_vs_static=max_diff(graphed, static),
         tokens_equal=all(torch.equal(x.argmax(-1), y.argmax(-1)) for x, y in zip(graphed, static)), **base)


if __name__ == "__main__":
    main()
