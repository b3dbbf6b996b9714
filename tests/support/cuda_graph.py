"""Capture a function of static CUDA tensors in a CUDA graph, the way ``torch.cuda.graphs`` recommends.

``capture(fn, *static_args, warmup=2)`` calls ``fn(*static_args)`` ``warmup`` times on a side stream (Triton
compilation and autotuning, lazy constants, allocator pools), then records one call and returns
``(graph, static_out)``: copy new inputs into ``static_args`` and ``graph.replay()`` to recompute ``static_out``.
Used by the tests and benchmarks that check that a path is capturable (``truncate_states``, ``truncate_fused``).
``gdnviz.gpu.scan_graph`` captures its windows itself: its warm-up is the first window's real run.
"""
from __future__ import annotations

from typing import Callable

import torch


def capture(fn: Callable, *static_args, warmup: int = 2):
    """(``torch.cuda.CUDAGraph``, output of the recorded call) for ``fn(*static_args)``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn(*static_args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static_args)
    return graph, out
