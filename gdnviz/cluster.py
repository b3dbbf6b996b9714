"""Probes on a Dask cluster: one model per worker process, a unit of work (a batch of samples, a document under one
setting) per task.

``executor(client_or_address, model, device, dtype)`` returns a ``ClusterExecutor`` for the ``executor=`` of
``run_sweep``, ``run_scan``, ``find_budget`` and ``run_loss_sweep`` (with ``ex.model_view()`` as their ``lm``).
Every worker loads the model once (a worker plugin) and keeps it; each unit (``gdnviz.probes.sweep.Batch``,
``gdnviz.probes.loss_sweep.LossUnit``) is one Dask task answered by ``unit.answer(lm)`` on a worker; results come
back to this process, which alone writes the memo store, so a worker that dies loses at most its units in flight
(Dask reruns them elsewhere) and an interrupted probe resumes from the store. Units are formed exactly as in one
process, so the rows are the same.

Addresses: ``"local"`` (one worker process per visible GPU, each seeing only its own: ``gpu_worker_specs``;
without a GPU, ``workers`` CPU worker processes) or a scheduler's address (``tcp://HOST:PORT``, or a scheduler
file path ending in ``.json``).
Dask (``distributed``) is imported only here. Errors: ``ClusterError``.
"""
from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path

from gdnviz.errors import ClusterError, GDNVizError

PLUGIN = "gdnviz-model"
_MODELS: dict = {}  # in each worker process: model key -> LoadedModel
_WARM_UP: dict = {}  # in each worker process: model key -> gdnviz.warmup's seconds per step (CUDA only)


def code_hash() -> str:
    """sha256 (16 hex digits) of the gdnviz package's Python and CUDA sources: workers must run the same code."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for f in sorted(list(root.rglob("*.py")) + list(root.rglob("*.cu"))):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _dask():
    try:
        import distributed
    except ImportError:
        raise ClusterError("Dask is not installed: `pip install distributed` to run on a cluster; without --cluster "
                           "gdnviz runs in this process.") from None
    return distributed


def _model_plugin_class():
    distributed = _dask()

    class ModelPlugin(distributed.WorkerPlugin):
        """Loads the model into the worker process once, at registration (a failure is kept and reported)."""

        name = PLUGIN

        def __init__(self, key):
            self.key = key

        def setup(self, worker):
            # the module's own dict (this class travels by value, with copies of the globals it names)
            from gdnviz import cluster as here
            from gdnviz.models import load

            model, device, dtype, trust = self.key
            if self.key in here._MODELS and not isinstance(here._MODELS[self.key], Exception):
                return  # registered again by a later sweep: the model is loaded already
            try:
                lm = load(model, device=device, dtype=dtype, trust_remote_code=trust, load_tokenizer=True)
            except Exception as e:  # noqa: BLE001 - reported to the client by _identity
                here._MODELS[self.key] = e
                return
            from gdnviz.warmup import needs_warm_up, warm_up

            if needs_warm_up(lm):  # as the app's worker: compile and autotune now, not in the first batch
                here._WARM_UP[self.key] = warm_up(lm)
            here._MODELS[self.key] = lm

    return ModelPlugin


def _identity(key) -> dict:
    """Run on each worker: its gdnviz code hash and its model's info (or the load error's text)."""
    lm = _MODELS.get(key)
    out = dict(code=code_hash())
    if lm is None:
        out["error"] = "the model plugin did not run on this worker"
    elif isinstance(lm, Exception):
        out["error"] = f"{type(lm).__name__}: {lm}"
    else:
        out["info"] = lm.info
        out["warm_up"] = _WARM_UP.get(key)
    return out


def _answer_on_worker(key, unit):
    """A Dask task: one unit answered on this worker's model; returns (worker address, ``unit.answer(lm)``)."""
    from distributed import get_worker

    lm = _MODELS.get(key)
    if lm is None or isinstance(lm, Exception):
        raise ClusterError(f"worker {get_worker().address} has no model loaded ({lm!r})")
    return get_worker().address, unit.answer(lm)


def _rows_on_worker(key, n_tokens: int, new_tokens: int) -> int:
    """Run on each worker: ``auto_batch_size`` of its model (its own device's free memory)."""
    from gdnviz.probes.batch_size import auto_batch_size

    return auto_batch_size(_MODELS[key], n_tokens, new_tokens)


_CLIENTS: dict = {}  # address -> a running Client of this process (a local cluster and its models outlive a sweep)


def connect(address: str, workers: int = 2, timeout: float = 10.0):
    """A ``distributed.Client`` for ``address`` (module docstring), kept for later calls with the same address while
    it runs. ``workers``: CPU worker processes of a local cluster without GPUs. Raises ClusterError when no
    scheduler answers within ``timeout`` seconds."""
    c = _CLIENTS.get(address)
    if c is not None and c.status == "running":
        return c
    _CLIENTS[address] = c = _connect(address, workers, timeout)
    return c


def visible_gpus(count: int) -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` names them (indices or UUIDs; all ``count``
    devices when it is unset)."""
    import os

    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return [str(i) for i in range(count)]
    return [d.strip() for d in env.split(",") if d.strip()][:count]


def gpu_worker_specs(gpus: list[str]) -> dict:
    """{worker name: Nanny options} of a local GPU cluster: one single-threaded worker process per GPU, which sees
    only its GPU (``CUDA_VISIBLE_DEVICES`` set in the worker process before it starts: its ``cuda`` is that GPU)."""
    return {f"gpu-{g}": {"nthreads": 1, "env": {"CUDA_VISIBLE_DEVICES": g}} for g in gpus}


def _connect(address: str, workers: int, timeout: float):
    distributed = _dask()
    if address == "local":
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            specs = gpu_worker_specs(visible_gpus(torch.cuda.device_count()))
            cluster = distributed.SpecCluster(
                scheduler={"cls": distributed.Scheduler, "options": {"dashboard_address": None}},
                workers={name: {"cls": distributed.Nanny, "options": opts} for name, opts in specs.items()})
            return distributed.Client(cluster)
        if workers < 1:
            raise ClusterError(f"a local cluster needs at least one worker process, got {workers}")
        cluster = distributed.LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                           dashboard_address=None)
        return distributed.Client(cluster)
    try:
        if address.endswith(".json"):
            return distributed.Client(scheduler_file=address, timeout=timeout)
        return distributed.Client(address, timeout=timeout)
    except (OSError, TimeoutError, ValueError) as e:
        raise ClusterError(f"no Dask scheduler answers at {address!r} within {timeout:g} s ({type(e).__name__}). "
                           "Start one with `dask scheduler` (it prints its tcp:// address) and workers with "
                           "`dask worker ADDRESS` or `dask cuda worker ADDRESS`.") from None


class ModelView:
    """What a probe needs of a model in this process when workers answer: ``info`` (the workers') and the
    tokenizer (loaded here, without weights)."""

    def __init__(self, info, tokenizer):
        self.info, self.tokenizer = info, tokenizer


class ClusterExecutor:
    """A probe's executor on a Dask client (module docstring); one may serve several probes in turn.
    ``per_worker``: answers (``unit.size``: samples, or (document, setting) runs) per worker address so far;
    ``on_result(address, per_worker)`` is called after each unit; ``warm_up``: per worker address, the kernel
    warm-up's seconds per step when the worker loaded the model on CUDA (``gdnviz.warmup``)."""

    def __init__(self, client, model: str, device: str = "auto", dtype: str = "auto",
                 trust_remote_code: bool = False, on_result=None):
        self.client, self.key = client, (str(model), str(device), str(dtype), bool(trust_remote_code))
        self.on_result = on_result
        self.per_worker: Counter = Counter()
        self.client.register_plugin(_model_plugin_class()(self.key), name=PLUGIN)
        ident = self.client.run(_identity, self.key)
        if not ident:
            raise ClusterError("the Dask cluster has no workers: start at least one (`dask worker ADDRESS`)")
        mine = code_hash()
        other = {a: d["code"] for a, d in ident.items() if d["code"] != mine}
        if other:
            raise ClusterError(f"{len(other)} of {len(ident)} workers run other gdnviz code than this process "
                               f"(code {mine}; e.g. {next(iter(other))} has {next(iter(other.values()))}): install "
                               "the same gdnviz version on every worker.")
        failed = {a: d["error"] for a, d in ident.items() if "error" in d}
        if failed:
            a, e = next(iter(failed.items()))
            raise ClusterError(f"{len(failed)} of {len(ident)} workers could not load {model!r} on {device!r}: "
                               f"{a}: {e}")
        fps = {d["info"].fingerprint for d in ident.values()}
        if len(fps) > 1:
            raise ClusterError(f"the workers loaded different checkpoints for {model!r} (fingerprints "
                               f"{', '.join(sorted(fps))}): every worker must see the same files.")
        self.info = next(iter(ident.values()))["info"]
        self.workers = sorted(ident)
        self.warm_up = {a: d.get("warm_up") for a, d in ident.items() if d.get("warm_up")}  # per worker (CUDA)

    def model_view(self) -> ModelView:
        """The probe's ``lm`` in this process: the workers' ModelInfo and a tokenizer loaded here."""
        from gdnviz.models.loader import load_tokenizer_for, resolve

        try:
            tok = load_tokenizer_for(resolve(self.key[0]), self.key[3])
        except GDNVizError as e:
            raise ClusterError(f"this process needs {self.key[0]!r}'s tokenizer to build the prompts: {e}") from None
        if tok is None:
            raise ClusterError(f"{self.key[0]!r} has no tokenizer this process can load: it builds the prompts")
        return ModelView(self.info, tok)

    def batch_size(self, n_tokens: int, new_tokens: int) -> int:
        """Rows per batch for a sweep that leaves it open: the smallest ``auto_batch_size`` of the workers, each
        from its own device's free memory (``CPU_ROWS`` on CPU workers), so a batch fits every worker."""
        return min(self.client.run(_rows_on_worker, self.key, int(n_tokens), int(new_tokens)).values())

    def __call__(self, units):
        from distributed import as_completed

        pending = {}
        for u in units:
            pending[self.client.submit(_answer_on_worker, self.key, u, pure=False)] = u
        try:
            for fut in as_completed(list(pending)):
                addr, res = fut.result()
                u = pending.pop(fut)
                self.per_worker[addr] += u.size
                if self.on_result is not None:
                    self.on_result(addr, dict(self.per_worker))
                yield u, res
        finally:  # a cancel or an error here: nothing left running for a probe that stopped
            if pending:
                self.client.cancel(list(pending))


def executor(client_or_address, model: str, device: str = "auto", dtype: str = "auto",
             trust_remote_code: bool = False, workers: int = 2, on_result=None) -> ClusterExecutor:
    """A ``ClusterExecutor`` on a client or an address (``connect``)."""
    client = connect(client_or_address, workers) if isinstance(client_or_address, str) else client_or_address
    return ClusterExecutor(client, model, device, dtype, trust_remote_code, on_result)
