"""Shared helpers for the benchmarks: a Qwen3.5-0.8B-shaped random model, the common arguments, timing, JSON lines.

Every benchmark prints one JSON line per measurement (:func:`emit`). Timing: :func:`timeit` (median wall seconds,
device synchronised around each call) for whole runs, :func:`time_ms` (median milliseconds, CUDA events on a GPU) for
kernels. ``device`` arguments take a ``torch.device`` or its name.
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import sys
import time

import torch


def qwen35_08b_config(vocab_size: int = 248320):
    """Qwen3.5-0.8B's text config (24 layers: 18 GDN with 16 heads of 128x128, 6 full attention)."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        tie_word_embeddings=True, max_position_embeddings=262144)


def random_model(cfg, device, dtype, seed=0):
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        m = Qwen3_5ForCausalLM(cfg)
    return m.to(dtype=dtype).eval()


def run_parser(tokens: int = 16384, description: str | None = None):
    """The arguments every whole-document benchmark takes: ``--device`` (CUDA when there is one), ``--tokens``,
    ``--segment-len``; each script adds its own."""
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=tokens)
    ap.add_argument("--segment-len", type=int, default=256)
    return ap


def retrieval_parser(description: str | None = None):
    """The arguments every retrieval benchmark (sweeps, the cluster, the first result) takes: ``--device`` (CUDA when
    there is one), ``--model`` (``retrieval_model``'s name), ``--dtype`` and ``--task``; each script adds its own.
    ``retrieval_dtype(args, device)`` resolves the dtype."""
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", choices=["demo", "0.8b"], default="0.8b")
    ap.add_argument("--dtype", default=None, help="bfloat16 (CUDA default) or float32 (CPU default)")
    ap.add_argument("--task", default="niah_single_1")
    return ap


def retrieval_dtype(args, device) -> str:
    """``--dtype``, else bfloat16 on CUDA and float32 elsewhere."""
    return args.dtype or ("bfloat16" if torch.device(device).type == "cuda" else "float32")


def sync(device) -> None:
    """Wait for ``device``'s queued work (a no-op on CPU)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


#: The sorted wall times of the last :func:`timeit` call, seconds (for benches that report the spread).
LAST_TIMES: list = []


def time_once(fn, device) -> float:
    """Wall seconds of one call of ``fn`` (device synchronised before and after)."""
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def median(xs) -> float:
    """The middle value of ``xs`` (the upper one of the two middle values for an even count)."""
    xs = sorted(xs)
    return xs[len(xs) // 2]


def timeit(fn, device, repeats=3, warmup=1):
    """Median wall time in seconds over ``repeats`` after ``warmup`` calls (device synchronised); every time, sorted,
    is left in :data:`LAST_TIMES`."""
    for _ in range(warmup):
        fn()
    sync(device)
    LAST_TIMES[:] = sorted(time_once(fn, device) for _ in range(repeats))
    return median(LAST_TIMES)


def time_ms(fn, device, warmup: int, repeats: int) -> float:
    """Median wall time of ``fn()`` in ms after ``warmup`` calls: CUDA events around each call on a GPU,
    ``time.perf_counter`` on CPU."""
    dev = torch.device(device)
    for _ in range(warmup):
        fn()
    sync(dev)
    times = []
    for _ in range(repeats):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def device_name(device) -> str:
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def emit(**row) -> None:
    """Print ``row`` as one JSON line (values JSON cannot hold as their ``str``), with the torch version added."""
    row.setdefault("torch", torch.__version__)
    print(json.dumps(row, default=str), flush=True)
    sys.stdout.flush()


@contextlib.contextmanager
def env(name: str, value: str):
    """Environment variable ``name`` set to ``value`` inside the block, restored (or removed) after it."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def retrieval_model(name: str, device, dtype: str):
    """The model of the retrieval benchmarks: ``"demo"`` (the bundled demo model and its tokenizer) or ``"0.8b"``
    (a random-initialised Qwen3.5-0.8B shape with the demo tokenizer's 8,192-token vocabulary, so the prompts are
    real RULER prompts), as a ``gdnviz.models.LoadedModel`` on ``device`` in ``dtype``."""
    from gdnviz.models import from_model, load

    demo = load("demo", device=str(device), dtype=dtype)
    if name == "demo":
        return demo
    model = random_model(qwen35_08b_config(vocab_size=len(demo.tokenizer)), torch.device(device), getattr(torch, dtype))
    return from_model(model, "qwen3.5-0.8b-shape-random", tokenizer=demo.tokenizer)


def prompt_batches(lm, task: str, length: int, n: int, batch: int):
    """The sweep's prompts of (task, length) in ``run_sweep``'s batches (longest first)."""
    from gdnviz.probes import ruler

    smp = ruler.generate_many(task, lm.tokenizer, length, n, 0, chat_template=None)
    order = sorted(range(len(smp)), key=lambda i: -smp[i].n_tokens)
    return [[smp[i].input_ids for i in order[b:b + batch]] for b in range(0, len(order), batch)]


def ceiling_seconds(lm, task: str, length: int, n: int, batch: int, dev) -> float:
    """Seconds of the plain batched prefill of the sweep's prompts in its batches: ``lm.model.model`` (transformers'
    forward, no gdnviz run) on the left-padded ids with their attention mask, no cache; after one warm-up batch."""
    from gdnviz.probes.batch import pad_left

    batches = prompt_batches(lm, task, length, n, batch)

    def one(prompts):
        ids, mask, _ = pad_left(prompts)
        with torch.inference_mode():
            lm.model.model(input_ids=ids.to(dev), attention_mask=mask.to(dev), use_cache=False)

    one(batches[0])
    sync(dev)
    t = time.perf_counter()
    for p in batches:
        one(p)
    sync(dev)
    return time.perf_counter() - t
