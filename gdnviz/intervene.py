"""Truncated runs: chosen heads cut to rank r at every segment boundary, compounding along the document.

A ``TruncationSpec`` maps (layer, head) -> r (the model's own layer index, value-head index); heads not in it are
untouched, and attention layers are never touched. ``TruncateCallback`` applies it inside a ``gdnviz.runner``
run: at every boundary (absolute positions L, 2L, ...) the state the next segment reads is replaced by its
projection onto its top-r left singular directions (``gdnviz.truncate.truncate_states``), so the cut compounds:
the truncated state is what the next segment reads and writes into.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Iterable

import torch

from gdnviz.errors import RankOutOfRange


@dataclass(frozen=True)
class TruncationSpec:
    """Ranks per head: ``ranks`` is a tuple of ((layer, head), r) pairs (hashable, JSON-friendly via to_dict)."""

    ranks: tuple = field(default_factory=tuple)

    def __post_init__(self):
        # TruncationSpec({(layer, head): r}) and lists of ((layer, head), r) / (layer, head, r) work too
        items = self.ranks.items() if isinstance(self.ranks, Mapping) else self.ranks
        try:
            pairs = [((int(e[0]), int(e[1])), int(e[2])) if len(e) == 3 else ((int(e[0][0]), int(e[0][1])), int(e[1]))
                     for e in items]
        except (TypeError, ValueError, IndexError):
            raise ValueError("ranks must be {(layer, head): r} or pairs ((layer, head), r) or triples (layer, head, "
                             f"r); got {self.ranks!r:.200}") from None
        object.__setattr__(self, "ranks", tuple(sorted(pairs)))

    @classmethod
    def from_dict(cls, mapping: dict) -> "TruncationSpec":
        return cls(mapping)  # __post_init__ normalises it

    @classmethod
    def uniform(cls, heads: Iterable, r: int) -> "TruncationSpec":
        return cls.from_dict({(l, h): r for l, h in heads})

    @classmethod
    def all_heads(cls, info, r: int) -> "TruncationSpec":
        return cls.uniform([(l, h) for l in info.gdn_layers for h in range(info.num_heads)], r)

    @classmethod
    def layers(cls, info, layers: Iterable[int], r: int) -> "TruncationSpec":
        return cls.uniform([(l, h) for l in layers for h in range(info.num_heads)], r)

    def as_dict(self) -> dict:
        return {lh: r for lh, r in self.ranks}

    def to_list(self) -> list:
        return [[l, h, r] for (l, h), r in self.ranks]

    def __len__(self) -> int:
        return len(self.ranks)

    def validate(self, info) -> None:
        """Raise RankOutOfRange / ValueError naming the first bad entry."""
        rmax = min(info.d_k, info.d_v)
        for (l, h), r in self.ranks:
            if l not in info.gdn_layers:
                raise ValueError(f"layer {l} is not a Gated DeltaNet layer (GDN layers: {list(info.gdn_layers)})")
            if not 0 <= h < info.num_heads:
                raise ValueError(f"head {h} out of range: GDN layers have {info.num_heads} heads (0..{info.num_heads - 1})")
            if not 1 <= r <= rmax:
                raise RankOutOfRange(f"rank {r} for layer {l} head {h} is outside 1..{rmax} (min(d_k, d_v)); "
                                     f"r = {rmax} keeps the state untouched")


def _graph_truncation(heads_d: torch.Tensor, ranks, fused: bool):
    """A capture-safe boundary function ``fn(state [B, H, K, V], rows=None)``: heads ``heads_d`` (device index
    tensor) of the batch rows ``rows`` (device index tensor; None = all) cut to their ranks (≤ 32).

    ``fused``: ``gdnviz.gpu.fused_truncate.truncate_fused`` (the CUDA kernel, or one Triton launch; ``ranks`` one int,
    or a device tensor [len(heads)] repeated over the batch inside); else ``truncate_states``'s subspace path (``ranks``
    one int: no host→device copy inside it)."""
    from gdnviz.truncate import truncate_states

    if fused:
        from gdnviz.gpu.fused_truncate import truncate_fused

    every_head = heads_d.tolist() == list(range(int(heads_d.max()) + 1)) if len(heads_d) else False

    def cut(x: torch.Tensor, B: int) -> torch.Tensor:  # x [B·len(heads), K, V], heads repeated over B rows
        if fused:
            return truncate_fused(x, ranks if B == 1 or isinstance(ranks, int) else ranks.repeat(B))
        return truncate_states(x, ranks, method="subspace")

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


def fused_truncation_mode(device) -> str:
    """How CUDA-graph windows use the fused kernel (``gdnviz.gpu.fused_truncate``), from the environment variable
    ``GDNVIZ_FUSED_TRUNCATE``: ``"mixed"`` (only for layers whose heads have different ranks, which the subspace
    path cannot capture), ``"always"`` (``1``) or ``"never"`` (``0``).

    Default (unset): ``"always"`` where the fused kernel runs as one CUDA kernel (``gdnviz.gpu.cuda_truncate``) with
    its certified attempts — a 16K-token run with every head at r = 4 took 3.25× the prefill instead of 5.98× with
    the subspace path (H200, eighth session, bench/RESULTS.md) — ``"mixed"`` where the kernel runs without its
    attempts, else ``"never"``. In ``"always"`` the eager segment loop truncates with the same kernel
    (``TruncateCallback.on_boundary``): graph windows and the loop then give the same answers (with different
    algorithms they differed by rounding, amplified through the layers, and ``test_left_padded_batch_graphs_on_gpu``
    failed). In ``"mixed"`` the loop keeps ``truncate_states``; without the fused kernel a layer with mixed ranks
    sends the whole run to the eager loop (28.7× the prefill at r = 4, fourth session)."""
    env = os.environ.get("GDNVIZ_FUSED_TRUNCATE", "").strip().lower()
    if torch.device(device).type != "cuda":
        return "never"
    if env == "":
        from gdnviz.gpu import cuda_truncate

        if not cuda_truncate.enabled():
            return "never"
        return "always" if cuda_truncate.attempts_on() else "mixed"
    mode = {"1": "always", "always": "always", "mixed": "mixed"}.get(env, "never")
    if mode == "never":
        return "never"
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover
        return "never"
    return mode


class TruncateCallback:
    """Runner callback that projects the chosen heads onto their top-r directions at every boundary."""

    def __init__(self, info, spec: TruncationSpec, warm_start: bool = True):
        spec.validate(info)
        self.rmax = min(info.d_k, info.d_v)
        per_layer: dict = {}
        for (l, h), r in spec.ranks:
            if r < self.rmax:  # r = min(d_k, d_v) is the identity: skip the work
                per_layer.setdefault(l, []).append((h, r))
        self.per_layer = {l: (torch.tensor([h for h, _ in v]), torch.tensor([r for _, r in v]))
                          for l, v in per_layer.items()}
        self.warm_start = warm_start
        self._basis: dict = {}
        self._graph_fns: dict = {}
        self.n_calls = 0
        self.d_k, self.d_v = info.d_k, info.d_v

    def graph_boundary(self, layer, device):
        """For ``gdnviz.runner``'s CUDA-graph windows: ``"noop"`` when no head of ``layer`` is truncated; else
        ``(fn, key)`` with ``fn(state [B, H, K, V], rows=None) -> state`` free of host syncs — the fused kernel
        (``gdnviz.gpu.fused_truncate``, ranks ≤ 32, K and V in {64, 128}) when ``fused_truncation_mode`` allows it
        (by default every such layer on CUDA; a shared rank is passed as an int, so the kernel's certified attempts
        run), else the subspace path of ``truncate_states`` when the layer's heads share one rank ≤ 32 —
        from a cold start (a warm start keeps host-side state per call); ``key`` names what it does so that layers
        doing the same share a graph. None when the layer's truncation cannot be captured (r > 32, small K, mixed
        ranks without the fused kernel: exact paths sync)."""
        sel = self.per_layer.get(layer)
        if sel is None:
            return "noop"
        from gdnviz.truncate import SUBSPACE_MAX_RANK, _MIN_K_SUBSPACE

        heads, ranks = sel
        rl = ranks.tolist()
        dev = torch.device(device)
        mode = fused_truncation_mode(dev)
        uniform = len(set(rl)) == 1 and rl[0] <= SUBSPACE_MAX_RANK and self.d_k >= _MIN_K_SUBSPACE
        if self._fusable(rl) and (mode == "always" or (mode == "mixed" and not uniform)):
            key = ("truncate-fused", tuple(heads.tolist()), tuple(rl), str(dev))
            # one rank for every head: a host-side int, so the CUDA kernel may try its certified attempts first
            rk = rl[0] if len(set(rl)) == 1 else ranks.to(dev, torch.int32)
            make = lambda: _graph_truncation(heads.to(dev), rk, fused=True)  # noqa: E731
        elif uniform:
            key = ("truncate-subspace", tuple(heads.tolist()), rl[0], str(dev))
            make = lambda: _graph_truncation(heads.to(dev), rl[0], fused=False)  # noqa: E731
        else:
            return None
        fn = self._graph_fns.get(key)
        if fn is None:
            fn = self._graph_fns[key] = make()
        return fn, key

    def _fusable(self, ranks: list) -> bool:
        """Whether the fused kernel takes these ranks and the model's head shape."""
        from gdnviz.gpu.fused_truncate import DIMS, MAX_RANK

        return max(ranks) <= MAX_RANK and self.d_k in DIMS and self.d_v in DIMS

    def note_graph_boundaries(self, layer, n: int) -> None:
        """``n`` boundaries of ``layer`` ran inside a CUDA graph: count them; the warm start is stale now."""
        self.n_calls += n
        for k in [k for k in self._basis if k == layer or (isinstance(k, tuple) and k[0] == layer)]:
            del self._basis[k]  # per-layer and per-(layer, row) warm starts

    def on_boundary(self, layer, position, state, rows=None):
        """``rows``: batch indices of ``state``'s rows in a left-padded batch (``gdnviz.runner`` passes them when
        rows reach their own boundaries at different times); the warm start is then kept per row."""
        sel = self.per_layer.get(layer)
        if sel is None:
            return None
        from gdnviz.truncate import truncate_states

        heads, ranks = sel
        B = state.shape[0]
        heads_d = heads.to(state.device)
        x = state[:, heads_d].reshape(-1, *state.shape[-2:])  # [B * h, K, V]
        rl = ranks.tolist()
        if fused_truncation_mode(state.device) == "always" and self._fusable(rl):
            # what graph windows run (no warm start): the same answers in both
            from gdnviz.gpu.fused_truncate import truncate_fused

            y = truncate_fused(x, rl[0] if len(set(rl)) == 1 else rl * B)
        else:
            r = ranks.to(state.device).repeat(B)
            warm = None
            if self.warm_start and rows is None:
                warm = self._basis.get(layer)
            elif self.warm_start:
                parts = [self._basis.get((layer, int(b))) for b in rows.tolist()]
                warm = None if any(w is None for w in parts) or len({w.shape for w in parts}) != 1 else torch.cat(parts)
            if warm is not None and warm.shape[0] != x.shape[0]:
                warm = None
            y, basis = truncate_states(x, r, warm_start=warm, return_basis=True)
            if self.warm_start and rows is None:
                self._basis[layer] = basis
            elif self.warm_start:
                for b, part in zip(rows.tolist(), basis.split(len(heads))):
                    self._basis[(layer, int(b))] = part
        out = state.clone()
        out[:, heads_d] = y.reshape(B, len(heads), *state.shape[-2:]).to(state.dtype)
        self.n_calls += 1
        return out
