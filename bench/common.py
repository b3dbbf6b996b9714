"""Shared helpers for benchmarks: a Qwen3.5-0.8B-shaped random model, timing, JSON lines."""
from __future__ import annotations

import contextlib
import json
import os
import platform
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


def run_parser(tokens: int = 16384):
    """The arguments every whole-document benchmark takes: ``--device`` (CUDA when there is one), ``--tokens``,
    ``--segment-len``; each script adds its own."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=tokens)
    ap.add_argument("--segment-len", type=int, default=256)
    return ap


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


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


def device_name(device) -> str:
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def emit(**row):
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


def fla_conv_flip() -> tuple[str, str]:
    """(GDNVIZ_FLA_CONV value, row suffix) for the ``--fla-conv-ab`` rows: the other side of the library's default
    (``transformers_family.FLA_CONV``: fla's convolution in runs, on since the twelfth session)."""
    from gdnviz.models import transformers_family

    return ("0", "fallback_conv") if transformers_family.FLA_CONV else ("1", "fla_conv")


def plain_prefill_fla_conv(plain, dev, repeats: int, t_plain: float, base: dict) -> float:
    """Time ``plain`` (a plain prefill) on ``dev`` with fla's short convolution (``GDNVIZ_FLA_CONV=all``), emit the
    row (with the fields of ``base``), return its seconds: the second baseline of the ``--fla-conv-ab`` rows."""
    with env("GDNVIZ_FLA_CONV", "all"):
        t = timeit(plain, dev, repeats=repeats)
    emit(what="plain_prefill_fla_conv", seconds=t, baseline="plain_prefill", ratio=t / t_plain, **base)
    return t


def second_baselines(fla_conv: bool, plain, dev, repeats: int, t_plain: float, base: dict):
    """The second baselines a bench divides every row by, as a function ``ratios(seconds) -> {name: ratio}``: with
    ``fla_conv`` (``--fla-conv-ab``) the plain prefill with fla's convolution (:func:`plain_prefill_fla_conv`, timed
    and emitted now), else none."""
    others = {}
    if fla_conv:
        others["ratio_to_plain_prefill_fla_conv"] = plain_prefill_fla_conv(plain, dev, repeats, t_plain, base)
    return lambda t: {k: t / v for k, v in others.items()}
