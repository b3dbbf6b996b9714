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

Statistics on the device, copied once (CUDA): every per-layer statistic (gates, key samples, the key cone's sums and
eigenvalues, the boundary states' spectra, the final state) is computed by kernels launched right after the layer,
without a single host synchronisation, and copied asynchronously into pinned host buffers. A layer has two jobs: at
its input the gates, key samples and the key cone's sums (``gdnviz.analysis.keycone.keycone_sums``); at its end the
boundary states' spectra together with the eigenvalues of the key cone's two matrices per head, in the same kernel
launches (``gdnviz.statistics.batched_svdvals(extra=...)``), and the final state. As each job finishes, its results
are copied out of the pinned buffers into the result's arrays by the host while later layers still run; only the key
cone's effective ranks (a few numbers per head) are finished on the host after the forward. By default
(``pipeline=None``) the statistics run on a side CUDA stream that waits for the layer's inputs, so they overlap the
next layers' forward on the GPU; ``pipeline=False`` queues them on the main stream. At most ``PIPELINE_DEPTH`` layers'
statistics are in flight (the host waits for the oldest beyond that), which bounds the boundary states held on the
GPU. The numbers are the same either way (the tests compare them). On CPU everything runs inline. A model spread over
several GPUs (``device_map``) runs each layer's statistics on that layer's GPU, with its own side stream and bound.
``meta["statistics_seconds"]`` says where the host's time went: launching each job kind, waiting for the GPU
(``waiting``) and filling the host arrays (``results``: the copies out of the pinned buffers, mostly during the
forward, and the key cone's effective ranks at the end). Timings: docs/kernels-spectra.md.
"""
from __future__ import annotations

import io
import json
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from gdnviz import runner
from gdnviz.analysis.keycone import keycone_finish, keycone_sums
from gdnviz.errors import EmptyDocument, JobCancelled
from gdnviz.statistics import batched_svdvals, symmetric_eigvals

CAPTURE_VERSION = "capture-v1"
KEY_SAMPLE = 256
PIPELINE_DEPTH = 4  # layers whose statistics may be in flight on the GPU (bounds the boundary states held)
# host buffers written by a layer's first job (gates, keys, the key cone's sums) and by its second (the spectra of the
# boundary states and of the key cone's matrices, solved together, and the final state)
_INPUT_FIELDS = ("g", "beta", "key_mean", "key_sample", "kc_horizon", "kc_mean_key_norm")
_END_FIELDS = ("sv", "final_state", "kc_cov_eigvals", "kc_P_eigvals")


class _DeviceJobs:
    """Where a capture's statistics run (module docstring): inline on CPU; on CUDA on a side stream (``side=True``)
    or on the current stream, with at most ``depth`` jobs in flight (the host waits for the oldest beyond that). A
    job is a function launching device work; the tensors it reads are marked with ``record_stream`` for the side
    stream, so the caching allocator does not hand their memory to the main stream before the side stream is done
    with them. A job's ``after`` (host work on its results, e.g. copying them out of pinned buffers) runs once its
    device work is done: at a later ``submit`` that finds it done (while the GPU is still busy with the forward) or at
    ``finish`` — on CPU right away. Host seconds: ``seconds[kind]`` to launch each job kind,
    ``seconds["waiting"]`` for the GPU (the in-flight bound and the final ``finish``), ``seconds["results"]`` in the
    ``after`` functions."""

    def __init__(self, device: torch.device, side: bool, depth: int = PIPELINE_DEPTH):
        self.cuda = device.type == "cuda"
        self.device = device
        self.stream = torch.cuda.Stream(device) if self.cuda and side else None
        self.depth = depth
        self._events: deque = deque()  # (event, after) in submission order
        self.seconds: dict[str, float] = {"waiting": 0.0} if self.cuda else {}

    def _add(self, key: str, dt: float) -> None:
        self.seconds[key] = self.seconds.get(key, 0.0) + dt

    def _retire(self, after: Callable | None) -> None:
        if after is not None:
            t0 = time.perf_counter()
            after()
            self._add("results", time.perf_counter() - t0)

    def _drain(self, keep: int) -> None:
        """Retire the oldest jobs: every one whose event has completed, and then (waiting) until ≤ ``keep`` remain."""
        while self._events and self._events[0][0].query():
            self._retire(self._events.popleft()[1])
        t0 = time.perf_counter()
        while len(self._events) > keep:
            ev, after = self._events.popleft()
            ev.synchronize()
            self._add("waiting", time.perf_counter() - t0)
            self._retire(after)
            t0 = time.perf_counter()
        self._add("waiting", time.perf_counter() - t0)

    def submit(self, fn: Callable, *tensors: torch.Tensor, kind: str, after: Callable | None = None) -> None:
        if self.cuda:
            self._drain(self.depth - 1)
        t1 = time.perf_counter()
        if self.stream is None:
            fn()
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            for t in tensors:
                if torch.is_tensor(t) and t.is_cuda:
                    t.record_stream(self.stream)
            with torch.cuda.stream(self.stream):
                fn()
        self._add(kind, time.perf_counter() - t1)
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(self.stream if self.stream is not None else torch.cuda.current_stream(self.device))
            self._events.append((ev, after))
        else:
            self._retire(after)

    def finish(self) -> None:
        """Wait for every job's device work (and so for the copies into the pinned host buffers); run their
        ``after`` functions."""
        if self.cuda:
            self._drain(0)


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
    (``modifies_state = False``), so the runner may hand it every boundary of a layer at once (``on_boundaries``).
    Results land in host buffers (pinned on CUDA) by asynchronous copies; read them after :meth:`close`."""

    modifies_state = False

    def __init__(self, info, n_tokens: int, segment_len: int, progress: Callable | None = None,
                 cancel: Callable | None = None, pipeline: bool | None = None):
        """pipeline: run each layer's statistics on a side CUDA stream (module docstring); None = yes on CUDA.
        Ignored on CPU, where the statistics run inline."""
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
        S = min(KEY_SAMPLE, n_tokens)
        self.key_sample_pos = np.unique(np.linspace(0, n_tokens - 1, S).round().astype(np.int64))
        # host buffers, one contiguous slot per GDN layer (so each layer's copy is one contiguous transfer)
        self._shapes = {
            "sv": ((NL, len(self.positions), H, self.n), torch.float32),  # [NL, NB, ...]: transposed in result()
            "final_state": ((NL, H, K, V), torch.float32),
            "g": ((NL, H, n_tokens), torch.float32),
            "beta": ((NL, H, n_tokens), torch.float16),
            "key_mean": ((NL, H, K), torch.float32),
            "key_sample": ((NL, H, len(self.key_sample_pos), K), torch.float16),
            "kc_horizon": ((NL, H), torch.float64),
            "kc_mean_key_norm": ((NL, H), torch.float64),
            "kc_cov_eigvals": ((NL, H, K), torch.float64),
            "kc_P_eigvals": ((NL, H, K), torch.float64),
        }
        self._host: dict[str, torch.Tensor] = {}
        self._out: dict[str, np.ndarray] = {}
        self._kc_mats: dict[int, torch.Tensor] = {}  # layer ordinal -> its key cone's C and P until its layer end
        self._states: list = []
        self._done = 0
        self._pipeline_flag = pipeline
        self._jobs: dict = {}  # device -> its _DeviceJobs, created at the first layer there (a spread model: several)
        self._pos: dict = {}  # device -> key_sample_pos there

    def _run(self, fn: Callable, *tensors, kind: str, after: Callable | None = None) -> None:
        """Launch ``fn`` (device work ending in copies to the host buffers) where :class:`_DeviceJobs` says; ``kind``
        names it in ``statistics_seconds``; ``after`` runs on the host once that work is done."""
        dev = next((t.device for t in tensors if torch.is_tensor(t)), torch.device("cpu"))
        if not self._host:
            pin = dev.type == "cuda"
            # pinned on CUDA (asynchronous copies), from torch's caching host allocator (kept for the next capture);
            # not zeroed there: a finished forward writes every layer's slot, and result() is only read after one
            new = (lambda shape, dt: torch.empty(shape, dtype=dt, pin_memory=True)) if pin else \
                (lambda shape, dt: torch.zeros(shape, dtype=dt))
            self._host = {k: new(shape, dt) for k, (shape, dt) in self._shapes.items()}
            self._out = self._result_arrays()
        jobs = self._jobs.get(dev)
        if jobs is None:  # each device's statistics on its own streams, bounded on their own
            side = self._pipeline_flag is None or bool(self._pipeline_flag)  # a side stream exists on CUDA only
            jobs = self._jobs[dev] = _DeviceJobs(dev, side, depth=2 * PIPELINE_DEPTH)  # two jobs per layer
        jobs.submit(fn, *tensors, kind=kind, after=after)

    def _result_arrays(self) -> dict:
        """The result's numpy arrays, one per host buffer (``sv`` in the result's ``[NB, NL, H, n]`` layout); filled
        layer by layer by :meth:`_copy_out` (a finished forward writes every layer's slot)."""
        out = {k: np.empty(shape, dtype=torch.empty(0, dtype=dt).numpy().dtype) for k, (shape, dt) in self._shapes.items()}
        out["sv"] = np.empty(tuple(np.asarray(self._shapes["sv"][0])[[1, 0, 2, 3]]), np.float32)
        return out

    def _copy_out(self, li: int, names: tuple) -> None:
        """Copy layer ``li``'s slots of the host buffers ``names`` into the result arrays (their device work is
        done). On CUDA this runs while later layers are still on the GPU, so the copies out of the pinned buffers
        (which the next capture reuses) cost no time after the forward."""
        for name in names:
            src = self._host[name][li].numpy()
            if name == "sv":
                self._out["sv"][:, li] = src
            else:
                self._out[name][li] = src

    def _put(self, name: str, li: int, value: torch.Tensor) -> None:
        """Copy a device result into layer ``li``'s slot of a host buffer (asynchronous on CUDA: pinned memory)."""
        self._host[name][li].copy_(value, non_blocking=True)

    @property
    def statistics_seconds(self) -> dict:
        """Host wall seconds of the statistics: launching each job kind (``layer_input``: gates, key samples and the
        key cone; ``layer_end``: the boundary states' spectra and the final state), on CUDA ``waiting`` for the GPU
        to finish them (the in-flight bound and the end of the capture), and ``results``: assembling the host arrays
        once they are in (copies out of the pinned buffers, the key cone's effective ranks)."""
        src: dict = {}
        for jobs in self._jobs.values():  # summed over the devices of a spread model
            for k, v in jobs.seconds.items():
                src[k] = src.get(k, 0.0) + v
        return {k: round(v, 4) for k, v in src.items()}

    @property
    def pipelined(self) -> bool:
        """True when the statistics ran on a side CUDA stream."""
        return any(jobs.stream is not None for jobs in self._jobs.values())

    def close(self) -> None:
        """Wait for the statistics still in flight on the GPU."""
        for jobs in self._jobs.values():
            jobs.finish()

    def on_layer_input(self, layer, offset, keys, g, beta):
        if offset != 0 or keys.shape[0] != 1 or keys.shape[1] != self.T:
            raise RuntimeError("capture expects one whole document (batch 1) in one call per layer")
        self._states = []
        li = self.layers.index(layer)
        k0, g0, b0 = keys[0], g[0], beta[0]  # [T, H, K], [T, H], [T, H]
        self._run(lambda: self._layer_input_stats(li, k0, g0, b0), k0, g0, b0, kind="layer_input",
                  after=lambda: self._copy_out(li, _INPUT_FIELDS))

    def _layer_input_stats(self, li, k0, g0, b0):
        self._put("g", li, g0.float().T)
        self._put("beta", li, b0.T.to(torch.float16))
        self._put("key_mean", li, k0.mean(0, dtype=torch.float32))  # no float32 copy of the keys
        pos = self._pos.get(k0.device)
        if pos is None:  # once per device: a host→device copy waits for the stream
            pos = self._pos[k0.device] = torch.as_tensor(self.key_sample_pos, device=k0.device)
        self._put("key_sample", li, k0[pos].transpose(0, 1).to(torch.float16))
        sums = keycone_sums(k0, g0)  # C and P's eigenvalues join the layer's spectra (_layer_end_stats)
        self._put("kc_horizon", li, sums["horizon"])
        self._put("kc_mean_key_norm", li, sums["mean_key_norm"])
        self._kc_mats[li] = torch.cat([sums["C"], sums["P"]])

    def on_boundary(self, layer, position, state, rows=None):
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
        self._run(lambda: self._layer_end_stats(li, blocks, final), final, *blocks, kind="layer_end",
                  after=lambda: self._copy_out(li, _END_FIELDS))
        self._done += 1
        if self.progress is not None:
            self.progress(self._done, len(self.layers))
        if self.cancel is not None and self.cancel():
            raise JobCancelled("capture cancelled")

    def _layer_end_stats(self, li, blocks, final):
        stack = torch.cat(blocks) if len(blocks) > 1 else blocks[0]  # [NB, H, K, V]
        mats = self._kc_mats.pop(li)  # [2H, K, K]: the key cone's C and P from this layer's first job
        H = mats.shape[0] // 2
        if mats.shape[-1] == self.n:  # one solve for the states' spectra and the key cone (K = min(K, V))
            sv, lam = batched_svdvals(stack, extra=mats)
        else:
            sv, lam = batched_svdvals(stack), symmetric_eigvals(mats)
        self._put("sv", li, sv.float())
        self._put("kc_cov_eigvals", li, lam[:H])
        self._put("kc_P_eigvals", li, lam[H:])
        self._put("final_state", li, final[0].float())

    def result(self, meta: dict) -> CaptureResult:
        """The capture (waits for the GPU first). The copies out of the pinned buffers ran layer by layer as the
        statistics finished (:meth:`_copy_out`); what is left here is the key cone's effective ranks. Both are
        timed as ``statistics_seconds["results"]``."""
        self.close()
        t0 = time.perf_counter()
        if not self._host:  # no GDN layer ran (nothing was launched): zeros
            self._out = {k: np.zeros_like(v) for k, v in self._result_arrays().items()}
        h = self._out
        keycone = keycone_finish({name[3:]: h[name] for name in h if name.startswith("kc_")})
        res = CaptureResult(meta=meta, positions=np.asarray(self.positions, np.int64), sv=h["sv"],
                            final_state=h["final_state"], g=h["g"], beta=h["beta"], key_mean=h["key_mean"],
                            keycone=keycone, key_sample=h["key_sample"], key_sample_pos=self.key_sample_pos)
        if self._jobs:
            first = next(iter(self._jobs.values()))
            first.seconds["results"] = first.seconds.get("results", 0.0) + time.perf_counter() - t0
        return res


def capture_document(lm, input_ids, segment_len: int = runner.DEFAULT_SEGMENT_LEN, *, name: str = "",
                     progress: Callable | None = None, cancel: Callable | None = None,
                     fast_states: bool = True, pipeline: bool | None = None) -> CaptureResult:
    """Run one document (``input_ids``: list[int] or [T] / [1, T] tensor) and capture every GDN head.

    progress(done_layers, n_layers) is called after each GDN layer; cancel() -> True aborts with JobCancelled.
    fast_states=False forces the segment-by-segment scan on CUDA (the one-pass read-out is the default there).
    pipeline: run each layer's statistics on a side CUDA stream, overlapping the next layers (module docstring);
    None = yes on CUDA; ignored on CPU.
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
            cb.close()  # let the statistics in flight on the GPU finish before the error leaves
        except Exception:  # noqa: BLE001 - the forward's own error is the one to report
            pass
        raise
    meta = dict(version=CAPTURE_VERSION, name=name, n_tokens=T, segment_len=segment_len,
                model=lm.info.to_dict(), gdn_layers=list(lm.info.gdn_layers), num_heads=lm.info.num_heads,
                d_k=lm.info.d_k, d_v=lm.info.d_v, backends=sorted(out.backends), readouts=sorted(out.readouts),
                pipelined=cb.pipelined)
    res = cb.result(meta)  # waits for the GPU's statistics, then assembles the host arrays
    meta.update(seconds=round(time.perf_counter() - t0, 4), statistics_seconds=cb.statistics_seconds)
    return res
