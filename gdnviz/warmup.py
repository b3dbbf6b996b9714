"""Kernel warm-up right after a model is loaded on CUDA, so that the user's first document does not pay it.

On an H200 the first capture in a process on a fresh machine took 15.7 s for the bundled demo model (2,261 tokens),
the next 0.1 s (bench/RESULTS.md): Triton compiles fla's kernels and autotunes them for the model's
head shapes. Later documents of other lengths cost at most ~1.2 s more than warm (the autotune keys are the head
shapes, not the length), and later processes on the same machine start in ~1 s (fla's and Triton's on-disk caches).
So the worker runs every kernel family a user's jobs will need once, at load time, on a short dummy input:

* the NVRTC builds of gdnviz's own CUDA kernels (truncation, tridiagonalisation, bisection) that are not yet in the
  on-disk cache, compiled in parallel processes (``gdnviz.gpu.prebuild``; 7–45 s each, one after another otherwise);
* a capture (fla's short convolution and one chunk pass per GDN layer with the state read-out, the spectra kernels
  — the NVRTC-compiled CUDA tridiagonalisation and bisection — the statistics);
* a truncated run with every head at rank 4 over 16 segments (fla's chunk kernels inside the CUDA-graph window of
  ``gdnviz.gpu.scan_graph`` for this model's layers, and the CUDA truncation kernel ``gdnviz.truncation.cuda`` in
  its split launches when a layer has at most 64 heads);
* two greedy decoding steps (fla's fused recurrent kernel);
* the truncation of two states with different ranks (one of them two-pass), what graph windows run for layers
  whose heads have different ranks (the kernel's full algorithm; its constants cached on the device).

On CPU nothing is compiled or tuned, so ``needs_warm_up`` is False and loading stays as fast as it was;
``GDNVIZ_WARMUP=0`` turns it off on CUDA too.
"""
from __future__ import annotations

import logging
import time

import torch

from gdnviz import settings
from gdnviz.gpu.prebuild import default_sources, prebuild
from gdnviz.truncation import TruncationSpec, cuda, truncate_states
from gdnviz.truncation.dispatch import kernel_runs

log = logging.getLogger(__name__)
SEGMENT = 256
SEGMENTS = 16  # one CUDA-graph window at L = 256


def needs_warm_up(lm) -> bool:
    """True for models whose GDN layers run fla's Triton kernels (CUDA): their first calls compile and autotune.
    ``GDNVIZ_WARMUP=0`` in the environment turns the warm-up off."""
    if not settings.get("GDNVIZ_WARMUP"):
        return False
    return lm.info.kernel_path == "fla" and torch.device(lm.device).type == "cuda"


def warm_up(lm, tokens: int = SEGMENT * SEGMENTS, segment_len: int = SEGMENT) -> dict:
    """Run a capture, a truncated run and two decoding steps on ``tokens`` dummy tokens; returns seconds per step.

    Failures are logged and reported in the result (``{"error": ...}``), never raised: a model that loads but
    cannot warm up still gets to run the user's job, which then reports its own error.
    """
    from gdnviz.capture import capture_document
    from gdnviz.generate import greedy_generate

    vocab = int(getattr(lm.info, "vocab_size", 0) or 1000)
    ids = torch.randint(0, max(2, min(vocab, 1000)), (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    out: dict = {}
    steps = [
        ("kernel_builds", lambda: _prebuild(lm)),
        ("capture", lambda: capture_document(lm, ids, segment_len)),
        ("truncated_run", lambda: greedy_generate(lm, ids, 2, segment_len=segment_len,
                                                  spec=TruncationSpec.all_heads(lm.info, 4), stop_ids=set())),
        ("fused_truncation", lambda: _fused_truncation(lm)),
    ]
    for name, fn in steps:
        t = time.perf_counter()
        try:
            fn()
            if torch.device(lm.device).type == "cuda":
                torch.cuda.synchronize(lm.device)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - reported, not raised (see docstring)
            log.warning("kernel warm-up step %s failed: %r", name, e)
            out["error"] = f"{name}: {e!r}"[:300]
            break
        out[name] = round(time.perf_counter() - t, 3)
    return out


def _prebuild(lm) -> None:
    """The NVRTC builds this model's runs use, compiled in parallel processes into the on-disk cache when missing
    (``gdnviz.gpu.prebuild``): the first process on a machine waits for the slowest build instead of their sum."""
    if torch.device(lm.device).type != "cuda" or not cuda.available():
        return
    cap = "%d%d" % torch.cuda.get_device_capability(lm.device)
    prebuild(default_sources(lm.info.d_k, lm.info.d_v), cap)


def _fused_truncation(lm) -> None:
    """Two random states of the model's head shape truncated at ranks 4 and 20 (when the CUDA kernel takes the
    shape): compiles its full-algorithm build and caches its constants on the device."""
    K, V = lm.info.d_k, lm.info.d_v
    if kernel_runs(lm.device, K, V) and min(K, V) > 20:
        x = torch.randn(2, K, V, generator=torch.Generator().manual_seed(0)).to(lm.device)
        truncate_states(x, [4, 20])
