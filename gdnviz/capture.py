"""Capture: what one document does to every GDN head, recorded along the document within a memory budget.

``capture_document(lm, input_ids, segment_len=256)`` runs the document once (``gdnviz.runner``) and keeps, per
GDN layer l (ordinal among GDN layers) and value head h:

=====================  ==========================  ======================================================
field                  shape / dtype               meaning
=====================  ==========================  ======================================================
positions              [NB] int64                  token positions of the recorded states: L, 2L, ... and
                                                   the document end T when T is not a multiple of L
sv                     [NB, NL, H, n] float32      singular values (descending, n = min(d_k, d_v)) of the
                                                   carried state after ``positions[b]`` tokens (float64 SVD)
final_state            [NL, H, d_k, d_v] float32   the carried state after the whole document
g                      [NL, H, T] float32          log-decay per token (alpha = exp(g))
beta                   [NL, H, T] float16          write strength per token
key_mean               [NL, H, d_k] float32        mean of the unit keys over the document
keycone                dict of [NL, H] float64     mean_key_norm, key_cov_erank, decayed_P_erank_sqrt,
                                                   decayed_P_erank_eig, horizon (gdnviz.analysis.keycone)
key_sample             [NL, H, S, d_k] float16     S <= 256 unit keys at evenly spaced positions
key_sample_pos         [S] int64                   their token positions
=====================  ==========================  ======================================================

Nothing else is kept: no per-token keys, no activations, no logits. For a Qwen3.5-0.8B-sized model (18 GDN layers,
16 heads of 128x128) and 16,384 tokens that is about 9.4 MB of spectra + 18.9 MB final states + 18.9 MB g +
9.4 MB beta + 9.4 MB key samples ≈ 66 MB on disk (``save``).

Pipelining (CUDA): each layer's statistics (gates, key geometry, spectra of its boundary states) and their copies
to the host run on a background thread with its own CUDA stream, while the main thread launches the next layers
(``_Pipeline``); without it every layer's device→host copies wait for the GPU before the next layer is launched,
and host and GPU work never overlap. At most ``PIPELINE_DEPTH`` layers are in flight (so the GPU holds at most that
many layers' boundary states). The numbers are the same either way (the tests compare them); on CPU the
statistics run inline unless ``pipeline=True``. ``meta["statistics_seconds"]`` says where the statistics' time went
(per job kind, and how long the main thread waited for the pipeline): on an H200 a 16K-token capture took 0.98 s for
345 ms of GPU work, its host waiting in ~300 synchronous device→host copies (bench/RESULTS.md, sixth session).
"""
from __future__ import annotations

import io
import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from gdnviz import runner
from gdnviz.errors import EmptyDocument, JobCancelled

CAPTURE_VERSION = "capture-v1"
KEY_SAMPLE = 256
PIPELINE_DEPTH = 4  # layers whose statistics may be in flight on the background thread


class _Pipeline:
    """Runs jobs in order on background threads (one per job, each joining the one before, so at most one runs at a
    time); on CUDA each job runs on a side stream that first waits for
    the work the main stream had queued when the job was submitted. Tensors a job reads are kept alive by the job
    and marked with ``record_stream``, so the caching allocator does not hand their memory to the main stream
    before the side stream is done with it. ``drain()`` waits for every job and re-raises the first error."""

    def __init__(self, device: torch.device, depth: int = PIPELINE_DEPTH):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.depth = depth
        self._jobs: deque = deque()
        self._error: BaseException | None = None
        # wall seconds: "main_thread_waiting" (submit waiting for a free slot, and drain), and per job kind the time
        # its job ran (its host work, the device->host copies it waits for, and the final stream synchronisation)
        self.seconds: dict[str, float] = {"main_thread_waiting": 0.0}
        self._lock = threading.Lock()

    def _add(self, key: str, dt: float) -> None:
        with self._lock:
            self.seconds[key] = self.seconds.get(key, 0.0) + dt

    def submit(self, fn: Callable, *tensors: torch.Tensor, kind: str = "job") -> None:
        t0 = time.perf_counter()
        while len(self._jobs) >= self.depth:  # bound the memory held by jobs in flight
            self._jobs.popleft().join()
        self._add("main_thread_waiting", time.perf_counter() - t0)
        self._raise()
        ev = None
        if self.stream is not None:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            for t in tensors:
                if torch.is_tensor(t) and t.is_cuda:
                    t.record_stream(self.stream)
        prev = self._jobs[-1] if self._jobs else None

        def run():
            if prev is not None:
                prev.join()  # strict order (each job writes its own layer's slots; order keeps progress monotone)
            if self._error is not None:
                return
            t1 = time.perf_counter()
            try:
                if self.stream is None:
                    fn()
                else:
                    with torch.cuda.stream(self.stream):
                        self.stream.wait_event(ev)
                        fn()
                        self.stream.synchronize()
            except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
                self._error = e
            finally:
                self._add(kind, time.perf_counter() - t1)

        t = threading.Thread(target=run, name="gdnviz-capture-stats", daemon=True)
        t.start()
        self._jobs.append(t)

    def _raise(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def drain(self) -> None:
        t0 = time.perf_counter()
        while self._jobs:
            self._jobs.popleft().join()
        self._add("main_thread_waiting", time.perf_counter() - t0)
        self._raise()


def batched_svdvals(states: torch.Tensor) -> torch.Tensor:
    """Singular values [..., min(K, V)] float64, descending, of states [..., K, V], as the square roots of the
    eigenvalues of the float64 Gram matrix: Triton kernels (gdnviz.gpu.symeig) on CUDA, LAPACK ``eigvalsh`` on CPU
    (both 8-200× faster than ``torch.linalg.svdvals``, which tests keep as the reference; absolute error on σ
    ≈ sqrt(ε_f64)·σ_max, far below the numerical-rank threshold σ_max·128·ε_f32)."""
    from gdnviz.gpu import symeig

    shape = states.shape
    flat = states.reshape(-1, *shape[-2:])
    if flat.is_cuda:
        sv = symeig.svdvals(flat)
    else:
        sv = torch.linalg.eigvalsh(symeig.gram(flat)).clamp_min(0).sqrt().flip(-1)
    return sv.reshape(*shape[:-2], sv.shape[-1])


@dataclass
class CaptureResult:
    """One document's capture; see the module docstring for every field's shape and meaning."""

    meta: dict
    positions: np.ndarray
    sv: np.ndarray
    final_state: np.ndarray
    g: np.ndarray
    beta: np.ndarray
    key_mean: np.ndarray
    keycone: dict
    key_sample: np.ndarray
    key_sample_pos: np.ndarray

    # -- convenience -------------------------------------------------------------------------------
    @property
    def gdn_layers(self) -> list:
        return list(self.meta["gdn_layers"])

    def layer_ordinal(self, layer: int) -> int:
        return self.gdn_layers.index(layer)

    @property
    def n_tokens(self) -> int:
        return int(self.meta["n_tokens"])

    def nbytes(self) -> int:
        arrays = [self.positions, self.sv, self.final_state, self.g, self.beta, self.key_mean, self.key_sample,
                  self.key_sample_pos] + list(self.keycone.values())
        return int(sum(a.nbytes for a in arrays))

    # -- persistence -------------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        np.savez(buf, meta=np.frombuffer(json.dumps(self.meta).encode(), dtype=np.uint8), positions=self.positions,
                 sv=self.sv, final_state=self.final_state, g=self.g, beta=self.beta, key_mean=self.key_mean,
                 key_sample=self.key_sample, key_sample_pos=self.key_sample_pos,
                 **{f"keycone__{k}": v for k, v in self.keycone.items()})
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> "CaptureResult":
        z = np.load(io.BytesIO(data), allow_pickle=False)
        meta = json.loads(bytes(z["meta"]).decode())
        kc = {k.split("__", 1)[1]: z[k] for k in z.files if k.startswith("keycone__")}
        return cls(meta=meta, positions=z["positions"], sv=z["sv"], final_state=z["final_state"], g=z["g"],
                   beta=z["beta"], key_mean=z["key_mean"], keycone=kc, key_sample=z["key_sample"],
                   key_sample_pos=z["key_sample_pos"])

    def save(self, path) -> Path:
        path = Path(path)
        path.write_bytes(self.to_bytes())
        return path

    @classmethod
    def load(cls, path) -> "CaptureResult":
        return cls.from_bytes(Path(path).read_bytes())


class CaptureCallback:
    """Boundary callback that records states, gates and key statistics (batch size 1). It only reads states
    (``modifies_state = False``), so the runner may hand it every boundary of a layer at once (``on_boundaries``)."""

    modifies_state = False

    def __init__(self, info, n_tokens: int, segment_len: int, progress: Callable | None = None,
                 cancel: Callable | None = None, pipeline: bool | None = None):
        """pipeline: run each layer's statistics on a background thread (see the module docstring); None = on
        CUDA only."""
        from gdnviz.analysis import keycone as kc

        self._kc = kc
        self.info = info
        self.T = n_tokens
        self.L = segment_len
        self.layers = list(info.gdn_layers)
        self.progress = progress
        self.cancel = cancel
        self.positions = [p for p in range(segment_len, n_tokens + 1, segment_len)]
        if not self.positions or self.positions[-1] != n_tokens:
            self.positions.append(n_tokens)
        NL, H, K, V = len(self.layers), info.num_heads, info.d_k, info.d_v
        self.n = min(K, V)
        self.sv = np.zeros((len(self.positions), NL, H, self.n), np.float32)
        self.final_state = np.zeros((NL, H, K, V), np.float32)
        self.g = np.zeros((NL, H, n_tokens), np.float32)
        self.beta = np.zeros((NL, H, n_tokens), np.float16)
        self.key_mean = np.zeros((NL, H, K), np.float32)
        self.keycone: dict = {}
        S = min(KEY_SAMPLE, n_tokens)
        self.key_sample_pos = np.unique(np.linspace(0, n_tokens - 1, S).round().astype(np.int64))
        self.key_sample = np.zeros((NL, H, len(self.key_sample_pos), K), np.float16)
        self._states: list = []
        self._done = 0
        self._pipeline_flag = pipeline
        self._pipe: _Pipeline | bool | None = None  # None: not decided yet (first layer); False: inline
        self._inline_seconds: dict[str, float] = {}

    def _run(self, fn: Callable, *tensors, kind: str) -> None:
        """Run ``fn`` now, or queue it on the pipeline (created at the first layer, on the keys' device); ``kind``
        names it in ``statistics_seconds``."""
        if self._pipe is None:
            dev = next((t.device for t in tensors if torch.is_tensor(t)), torch.device("cpu"))
            use = (dev.type == "cuda") if self._pipeline_flag is None else bool(self._pipeline_flag)
            self._pipe = _Pipeline(dev) if use else False
        if self._pipe:
            self._pipe.submit(fn, *tensors, kind=kind)
        else:
            t0 = time.perf_counter()
            fn()
            self._inline_seconds[kind] = self._inline_seconds.get(kind, 0.0) + time.perf_counter() - t0

    @property
    def statistics_seconds(self) -> dict:
        """Wall seconds spent on the statistics, by job kind (``layer_input``: gates, key samples and key geometry;
        ``layer_end``: the boundary states' spectra and the final state, each with their device→host copies), plus
        ``main_thread_waiting`` when pipelined — where a capture's time beyond the forward goes."""
        src = self._pipe.seconds if self._pipe else self._inline_seconds
        return {k: round(v, 4) for k, v in src.items()}

    @property
    def pipelined(self) -> bool:
        """True when the statistics ran on the background pipeline."""
        return bool(self._pipe)

    def close(self) -> None:
        """Wait for the statistics still in flight (re-raising the first error)."""
        if self._pipe:
            self._pipe.drain()

    def on_layer_input(self, layer, offset, keys, g, beta):
        if offset != 0 or keys.shape[0] != 1 or keys.shape[1] != self.T:
            raise RuntimeError("capture expects one whole document (batch 1) in one call per layer")
        self._states = []
        li = self.layers.index(layer)
        k0, g0, b0 = keys[0], g[0], beta[0]  # [T, H, K], [T, H], [T, H]
        self._run(lambda: self._layer_input_stats(li, k0, g0, b0), k0, g0, b0, kind="layer_input")

    def _layer_input_stats(self, li, k0, g0, b0):
        self.g[li] = g0.float().T.cpu().numpy()
        self.beta[li] = b0.float().T.cpu().numpy().astype(np.float16)
        self.key_mean[li] = k0.mean(0).float().cpu().numpy()
        pos = torch.as_tensor(self.key_sample_pos, device=k0.device)
        self.key_sample[li] = k0[pos].transpose(0, 1).float().cpu().numpy().astype(np.float16)
        summary = self._kc.keycone_summary(k0, g0)
        for name, val in summary.items():
            arr = val.detach().cpu().numpy() if torch.is_tensor(val) else np.asarray(val)
            self.keycone.setdefault(name, np.zeros((len(self.layers), self.info.num_heads), np.float64))[li] = arr

    def on_boundary(self, layer, position, state):
        self._states.append(state.detach().clone())  # [1, H, K, V]
        return None

    def on_boundaries(self, layer, positions, states):
        self._states.append(states[:, 0])  # [n, H, K, V]: one block, concatenated once at the layer end

    def on_layer_end(self, layer, position, state):
        li = self.layers.index(layer)
        final = state.detach().clone()  # the runner hands this state on; the statistics may run later
        blocks = list(self._states)
        if position % self.L != 0:
            blocks.append(final)
        self._states = []
        self._run(lambda: self._layer_end_stats(li, blocks, final), final, *blocks, kind="layer_end")
        if self.cancel is not None and self.cancel():
            raise JobCancelled("capture cancelled")

    def _layer_end_stats(self, li, blocks, final):
        stack = torch.cat(blocks) if len(blocks) > 1 else blocks[0]  # [NB, H, K, V]
        sv = batched_svdvals(stack)
        self.sv[:, li] = sv.float().cpu().numpy()
        self.final_state[li] = final[0].float().cpu().numpy()
        self._done += 1
        if self.progress is not None:
            self.progress(self._done, len(self.layers))

    def result(self, meta: dict) -> CaptureResult:
        self.close()
        return CaptureResult(meta=meta, positions=np.asarray(self.positions, np.int64), sv=self.sv,
                             final_state=self.final_state, g=self.g, beta=self.beta, key_mean=self.key_mean,
                             keycone=self.keycone, key_sample=self.key_sample, key_sample_pos=self.key_sample_pos)


def capture_document(lm, input_ids, segment_len: int = runner.DEFAULT_SEGMENT_LEN, *, name: str = "",
                     progress: Callable | None = None, cancel: Callable | None = None,
                     fast_states: bool = True, pipeline: bool | None = None) -> CaptureResult:
    """Run one document (``input_ids``: list[int] or [T] / [1, T] tensor) and capture every GDN head.

    progress(done_layers, n_layers) is called after each GDN layer; cancel() -> True aborts with JobCancelled.
    fast_states=False forces the segment-by-segment scan on CUDA (the one-pass read-out is the default there).
    pipeline: overlap each layer's statistics with the next layers (module docstring); None = on CUDA only.
    """
    runner.check_segment_len(segment_len)
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.numel() == 0:
        raise EmptyDocument("the document has no tokens")
    T = ids.shape[1]
    cb = CaptureCallback(lm.info, T, segment_len, progress=progress, cancel=cancel, pipeline=pipeline)
    t0 = time.perf_counter()
    try:
        out = runner.forward(lm, ids, segment_len=segment_len, callbacks=[cb], keep_hidden=False,
                             fast_states=fast_states)
    except BaseException:
        try:
            cb.close()  # let the statistics in flight finish before the error leaves (no thread left running)
        except Exception:  # noqa: BLE001 - the forward's own error is the one to report
            pass
        raise
    cb.close()
    meta = dict(version=CAPTURE_VERSION, name=name, n_tokens=T, segment_len=segment_len,
                model=lm.info.to_dict(), gdn_layers=list(lm.info.gdn_layers), num_heads=lm.info.num_heads,
                d_k=lm.info.d_k, d_v=lm.info.d_v, backends=sorted(out.backends), readouts=sorted(out.readouts),
                pipelined=cb.pipelined, seconds=round(time.perf_counter() - t0, 4),
                statistics_seconds=cb.statistics_seconds)
    return cb.result(meta)
