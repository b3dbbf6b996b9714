"""``TruncateCallback``: a ``gdnviz.runner`` callback that cuts a ``TruncationSpec``'s heads at every boundary.

At every boundary (absolute positions L, 2L, …) the state the next segment reads is replaced by its projection onto
its top-r left singular directions, so the cut compounds along the document. The truncation is
``gdnviz.truncation.dispatch``'s: the CUDA kernel where it runs (in the runner's CUDA-graph windows through
``graph_boundary``, in its eager loop through ``on_boundary``: the same launches, the same bits), else the certified
torch path or the exact one. The kernel's answers are held to the 1e-5 contract by ``gdnviz.truncation.contract``;
a run in graph windows must be made through ``contract.run_checked`` to be answered again on a breach (the probes,
``generate`` and attribution do so).
"""
from __future__ import annotations

import torch

from gdnviz.truncation import constants as C
from gdnviz.truncation import contract
from gdnviz.truncation.dispatch import kernel_runs, kernel_truncate, truncate_states
from gdnviz.truncation.spec import TruncationSpec


def graph_truncation(heads_d: torch.Tensor, ranks, kernel: bool = True):
    """A boundary function ``fn(state [B, H, K, V], rows=None)``: heads ``heads_d`` (device index tensor) of the
    batch rows ``rows`` (device index tensor; None = all) cut to ``ranks`` — one int for every head (the kernel's
    certified attempts run), or per head (``kernel``: an int32 device tensor ``[len(heads)]``; else a list), repeated
    over the rows inside. ``kernel``: the CUDA kernel (capture-safe: no host sync); else ``truncate_states`` (the
    torch path: CPU windows run uncaptured)."""
    every_head = heads_d.tolist() == list(range(int(heads_d.max()) + 1)) if len(heads_d) else False

    def cut(x: torch.Tensor, B: int) -> torch.Tensor:  # x [B·len(heads), K, V], heads repeated over B rows
        if isinstance(ranks, int):
            return kernel_truncate(x, ranks) if kernel else truncate_states(x, ranks)
        if kernel:
            return kernel_truncate(x, ranks if B == 1 else ranks.repeat(B))
        return truncate_states(x, list(ranks) * B)

    def fn(state: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        if every_head and rows is None and state.shape[1] == len(heads_d):
            # every head of every row: no gather / scatter (two kernels fewer per boundary)
            return cut(state.reshape(-1, *state.shape[-2:]), state.shape[0]).reshape(state.shape).to(state.dtype)
        sub = state if rows is None else state.index_select(0, rows)
        B, _, K, V = sub.shape
        y = cut(sub.index_select(1, heads_d).reshape(-1, K, V), B)
        sub = sub.index_copy(1, heads_d, y.reshape(B, -1, K, V).to(state.dtype))
        return sub if rows is None else state.index_copy(0, rows, sub)

    return fn


class TruncateCallback:
    """Runner callback that projects ``spec``'s heads onto their top-r directions at every boundary.

    ``info``: the model's ``ModelInfo`` (``spec`` is validated against it: ValueError / RankOutOfRange). Heads at
    r = min(d_k, d_v) are the identity and skipped. ``n_calls`` counts the boundaries truncated."""

    def __init__(self, info, spec: TruncationSpec):
        spec.validate(info)
        self.rmax = min(info.d_k, info.d_v)
        per_layer: dict = {}
        for (l, h), r in spec.ranks:
            if r < self.rmax:
                per_layer.setdefault(l, []).append((h, r))
        self.per_layer = {l: (torch.tensor([h for h, _ in v]), [r for _, r in v]) for l, v in per_layer.items()}
        self._graph_fns: dict = {}
        self.n_calls = 0
        self.d_k, self.d_v = info.d_k, info.d_v

    def _fn(self, layer, dev: torch.device, kernel: bool):
        """The layer's boundary function (``graph_truncation``), cached per (heads, ranks, device, kernel)."""
        heads, rl = self.per_layer[layer]
        key = ("truncate", tuple(heads.tolist()), tuple(rl), str(dev), kernel)
        fn = self._graph_fns.get(key)
        if fn is None:
            rk = rl[0] if len(set(rl)) == 1 else (torch.tensor(rl, dtype=torch.int32, device=dev) if kernel else rl)
            fn = self._graph_fns[key] = graph_truncation(heads.to(dev), rk, kernel)
        return fn, key

    def _kernel(self, layer, dev: torch.device) -> bool:
        """Whether the CUDA kernel truncates every head of ``layer`` on ``dev``."""
        return (dev.type == "cuda" and max(self.per_layer[layer][1]) <= C.MAX_RANK
                and kernel_runs(dev, self.d_k, self.d_v))

    def graph_boundary(self, layer, device):
        """For the runner's graph windows: ``"noop"`` when no head of ``layer`` is truncated; else ``(fn, key)`` with
        ``fn(state [B, H, K, V], rows=None) -> state`` the eager loop's truncation and ``key`` naming what it does (so
        that layers doing the same share a graph). On CUDA only where the CUDA kernel truncates the layer (ranks ≤ 32,
        K and V in {64, 128}, NVRTC available): then ``fn`` has no host sync and its answers are checked after each
        window (``contract``); elsewhere on CUDA None (the runner runs its eager loop for the layer, every answer
        checked at once). Off CUDA (uncaptured windows) ``fn`` runs ``truncate_states``. None inside
        ``contract.immediate``."""
        if layer not in self.per_layer:
            return "noop"
        dev = torch.device(device)
        kernel = self._kernel(layer, dev)
        if not contract.deferring() or (dev.type == "cuda" and not kernel):
            return None
        return self._fn(layer, dev, kernel)

    def note_graph_boundaries(self, layer, n: int) -> None:
        """``n`` boundaries of ``layer`` ran inside a CUDA graph: counted in ``n_calls``."""
        self.n_calls += n

    def on_boundary(self, layer, position, state, rows=None):
        """The eager loop's boundary: ``state [B, H, K, V]`` with the layer's heads truncated (a new tensor), or None
        when the layer has none. ``position`` and ``rows`` (the batch rows of a left-padded batch that reached this
        boundary) do not change the answer: each row's heads are cut on their own."""
        if layer not in self.per_layer:
            return None
        fn, _ = self._fn(layer, state.device, self._kernel(layer, state.device))
        self.n_calls += 1
        return fn(state)
