"""The 1e-5 contract for the CUDA kernel's answers: every state it truncates is certified or checked exactly.

The kernel's certified attempts bound their own error, but its full algorithm is not certified: on nearly flat or
slowly decaying spectra it can miss the exact top-r energy by more than 1e-5 (docs/kernels-truncation.md). So each
answer ``Y`` of a state ``S`` at rank ``r`` that no attempt certified is checked exactly:

    e = (Σ_{i≤r} λᵢ − ‖Y‖²_F) / ‖S‖²_F,   λ the eigenvalues of S Sᵀ (float64, ``gdnviz.gpu.symeig``),

and ``|e| ≤ CONTRACT`` (1e-5) must hold (a zero state counts as e = 0; a non-finite e is not a breach: NaN states
have no top-r energy). A state whose ``done`` flag (``cuda.Launched.done``) is exactly 1 was written by a certified
attempt whose energy-error bound is ≤ ``CERT_TOL`` (5e-6 < 1e-5): the bound is the proof, so it is not checked
(:func:`certified`; e = 0 in :func:`exact_errors`, and the spectra kernels skip its matrix). A state with any other
flag, and every state of a call that ran no attempts (per-state device ranks, r > 16, 5 ≤ r ≤ 16 on more states
than multiprocessors, ``iters`` given), is checked. Two ways, chosen by where the kernel runs:

* **Immediate** (outside a window: ``truncate_states``, the eager segment loop, decode boundaries): the caller
  (``dispatch.kernel_truncate``) checks the call's uncertified states at once with :func:`exact_errors` and answers
  the ones over the bound again on the certified torch path. One host sync (also when every state is certified).
* **Deferred** (inside :func:`window`, the runner's CUDA-graph windows, ``gdnviz.gpu.scan_graph``): the call only
  copies ``S``, its ``done`` flags and ``‖Y‖`` into the window's :class:`Slots` (small kernels, capture-safe). After
  each run of the window (a replay or an eager run, never a recording) :func:`check_window` copies the slots once and
  checks the uncertified states of the copy on a side stream, overlapping the next window; states over the bound are
  counted per device, and so are the states checked and the states certified (:func:`counts`).
  A run takes a :func:`mark` before and asks :func:`breached` after (one host sync each): on a breach the run is
  answered again without windows, where every call is immediate (:func:`run_checked`). The counters are per
  device and never reset, so runs in several threads of one process can only cause extra re-answers, never hide a
  breach.
"""
from __future__ import annotations

import contextlib
import logging
import threading

import torch

from gdnviz.gpu import symeig
from gdnviz.truncation import constants as C

F64 = torch.float64
log = logging.getLogger(__name__)
CHUNK = 1024  # states per exact check on the side stream (float64 Gram matrices of 128 × 128: 128 MiB)


def exact_errors(X: torch.Tensor, kept2: torch.Tensor, ranks: torch.Tensor,
                 skip: torch.Tensor | None = None) -> torch.Tensor:
    """``e [N]`` float64 (module docstring) of answers with energies ``kept2 [N]`` (``‖Y‖²_F``, float64) for states
    ``X [N, K, V]`` at ``ranks`` (``[N]`` integer tensor on X's device; ≥ min(K, V) means every direction).
    ``skip`` (bool ``[N]`` on X's device, or None): states not checked — e = 0, and the spectra kernels do no work
    for them. No host sync where ``symeig.eigvalsh`` runs its CUDA kernels (float64 CUDA, min(K, V) in
    {64, 128})."""
    G, bad = symeig.finite_gram(X, skip=skip)  # skipped rows unwritten on the kernel path: never read below
    n = G.shape[-1]
    if skip is not None:
        bad = bad | skip
    lam = symeig.eigvalsh(G, skip=skip)  # ascending; zeros in the skipped rows (the kernels)
    keep = torch.arange(n, device=X.device)[None, :] >= (n - ranks.to(torch.long)[:, None])
    top = (lam * keep).sum(-1)
    total = G.diagonal(dim1=-2, dim2=-1).sum(-1)  # garbage in the skipped rows: their e is replaced below
    e = torch.where(total > 0, (top - kept2) / torch.where(total > 0, total, torch.ones_like(total)),
                    torch.zeros_like(total))
    return torch.where(bad | ~torch.isfinite(e), torch.zeros_like(e), e)


def rank_tensor(ranks, n: int, device) -> torch.Tensor:
    """long ``[n]`` ranks on ``device`` from the kernel's ranks (an int, or an integer tensor ``[n]`` on the device;
    no host sync)."""
    if isinstance(ranks, int):
        return torch.full((n,), ranks, dtype=torch.long, device=device)
    return ranks.to(torch.long)


def certified(done: torch.Tensor, n: int) -> torch.Tensor | None:
    """bool ``[n]``: the states a kernel call's ``done`` flags (``cuda.Launched.done``, int32) mark as written by a
    certified attempt (flag exactly 1: its energy-error bound is ≤ ``CERT_TOL`` < ``CONTRACT``, a proof that needs no
    exact check); None when the call ran no attempts (``done`` empty). No host sync."""
    return done == 1 if done.numel() == n and n else None


def over(e: torch.Tensor) -> torch.Tensor:
    """bool ``[N]``: the errors ``e`` that break the contract."""
    return e.abs() > C.CONTRACT


def kept_energy(Y: torch.Tensor) -> torch.Tensor:
    """``‖Y‖²_F`` per state, float64 ``[N]`` (one kernel)."""
    return torch.linalg.vector_norm(Y, dim=(-2, -1), dtype=F64).square()


# --------------------------------------------------------------------------------------------- deferred
class Slots:
    """A window's record of the states its kernel calls truncated, in call order: slot i holds the i-th call's input
    ``X [N, K, V]`` copied into a stage buffer, ``‖Y‖_F`` of its answer (``[N]`` float64), its ranks (``[N]``
    long) and its ``done`` flags (``[N]`` int32; zeros when the call ran no attempts). Buffers are made on the first
    run of the window body (which runs eagerly before the capture) and written by every replay. Stage buffers are
    shared by the windows of one device with the same state shape (``_stage``), so cached graphs do not each hold a
    window of states: runs on one device must not overlap in time (one run at a time per device, as the app's
    worker, a sweep and a Dask worker run them)."""

    def __init__(self):
        self.x: list[torch.Tensor] = []
        self.kept: list[torch.Tensor] = []
        self.ranks: list[torch.Tensor] = []
        self.done: list[torch.Tensor] = []
        self.flagged: list[bool] = []  # whether done[i] may hold nonzero flags (else it holds zeros)
        self.used = 0  # calls recorded in the last run of the body

    def record(self, X: torch.Tensor, Y: torch.Tensor, ranks, done: torch.Tensor | None = None) -> None:
        """Record a kernel call: its input ``X``, answer ``Y``, ranks and ``done`` flags (``cuda.Launched.done``;
        None or empty: no attempts ran, nothing certified). Capture-safe: fixed shapes, no host sync."""
        i = self.used
        N = X.shape[0]
        if i == len(self.x) or self.x[i].shape != X.shape or self.x[i].dtype != X.dtype:
            buf = (_stage(X, i), torch.empty(N, dtype=F64, device=X.device), rank_tensor(ranks, N, X.device),
                   torch.zeros(N, dtype=torch.int32, device=X.device))
            if i == len(self.x):
                self.x.append(buf[0]), self.kept.append(buf[1]), self.ranks.append(buf[2])
                self.done.append(buf[3]), self.flagged.append(False)
            else:
                self.x[i], self.kept[i], self.ranks[i], self.done[i], self.flagged[i] = (*buf, False)
        self.x[i].copy_(X)
        torch.linalg.vector_norm(Y, dim=(-2, -1), dtype=F64, out=self.kept[i])  # ‖Y‖, squared by the check
        if done is not None and done.numel() == N and N:
            self.done[i].copy_(done)
            self.flagged[i] = True
        elif self.flagged[i]:
            self.done[i].zero_()
            self.flagged[i] = False
        self.used = i + 1


_STAGES: dict = {}  # (device, dtype, shape, slot index) -> buffer; a buffer lives on while a Slots holds it
_STAGES_LOCK = threading.Lock()


def _stage(X: torch.Tensor, i: int) -> torch.Tensor:
    """The shared stage buffer of slot ``i`` for states shaped like ``X``. Only the last shape per device is kept
    here (a batch size change replaces it); graphs made for an earlier shape keep theirs alive through their slots."""
    key = (str(X.device), X.dtype, tuple(X.shape), i)
    with _STAGES_LOCK:
        buf = _STAGES.get(key)
        if buf is None:
            for k in [k for k in _STAGES if k[0] == key[0] and k[1:3] != key[1:3]]:
                del _STAGES[k]
            # made on the device's default stream (the runs' stream), not on a capture's side stream
            ctx = (torch.cuda.stream(torch.cuda.default_stream(X.device)) if X.is_cuda
                   else contextlib.nullcontext())
            with ctx:
                buf = _STAGES[key] = torch.empty_like(X, memory_format=torch.contiguous_format)
    return buf


_LOCAL = threading.local()


def active() -> Slots | None:
    """The slots of the window body running in this thread, or None (immediate checks)."""
    return getattr(_LOCAL, "slots", None)


@contextlib.contextmanager
def window(slots: Slots):
    """Run a window body with the kernel's checks deferred into ``slots`` (restarted at slot 0)."""
    prev = active()
    slots.used = 0
    _LOCAL.slots = slots
    try:
        yield slots
    finally:
        _LOCAL.slots = prev


class _Device:
    """One device's side stream and counters (float64 / int64 scalars on the device)."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self.breaches = torch.zeros((), dtype=torch.long, device=device)
        self.checked = torch.zeros((), dtype=torch.long, device=device)
        self.certified = torch.zeros((), dtype=torch.long, device=device)
        self.worst = torch.zeros((), dtype=F64, device=device)


_DEVICES: dict[str, _Device] = {}
_DEVICES_LOCK = threading.Lock()


def _device(device: torch.device) -> _Device:
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = str(device)
    with _DEVICES_LOCK:
        d = _DEVICES.get(key)
        if d is None:
            d = _DEVICES[key] = _Device(device)
    return d


_BROKEN: list = []  # the first failure of a deferred check in this process (then every run checks at once)
_HOST_BREACHES = [0]  # windows whose check could not run: counted as breaches, so that their runs are answered again


def check_window(slots: Slots) -> None:
    """:func:`_check_window`, or, if it fails (anything but running out of memory), a logged fallback: the window
    counts as breached (its run is answered again) and from then on runs check at once (:func:`deferring` False)."""
    try:
        _check_window(slots)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # a device or driver failure (tests: a stand-in that raises)
        _fail(e)


def _fail(e: Exception) -> None:
    if not _BROKEN:
        log.warning("the deferred check of truncated states failed (%r); truncated runs now check every boundary "
                    "at once, without graph windows", e)
    _BROKEN.append(repr(e))
    _HOST_BREACHES[0] += 1


def _check_window(slots: Slots) -> None:
    """Check the states the last run of a window body recorded: call it after a replay or an eager run of the body,
    never after a recording (recorded calls have not run yet), and not during a capture. The slots are copied on a
    side stream that the current stream then waits for, so that the next replay may overwrite them; the check itself
    runs on the side stream. No host sync."""
    n = slots.used
    if n == 0 or all(x.shape[0] == 0 for x in slots.x[:n]):
        return
    dev = slots.x[0].device
    d = _device(dev)
    cur = torch.cuda.current_stream(dev) if d.stream is not None else None
    ctx = torch.cuda.stream(d.stream) if d.stream is not None else contextlib.nullcontext()
    if d.stream is not None:
        d.stream.wait_stream(cur)
        for t in (*slots.x[:n], *slots.kept[:n], *slots.ranks[:n], *slots.done[:n]):
            t.record_stream(d.stream)  # not reused by the allocator before the side stream has read it
    with ctx:
        X = torch.cat(slots.x[:n]) if n > 1 else slots.x[0].clone()
        kept = torch.cat(slots.kept[:n]) if n > 1 else slots.kept[0].clone()
        kept.square_()
        skip = certified(torch.cat(slots.done[:n]) if n > 1 else slots.done[0], X.shape[0])
        if d.stream is not None:
            cur.wait_stream(d.stream)  # the copies are done before anything on the current stream writes the slots
        ranks = torch.cat(slots.ranks[:n]) if n > 1 else slots.ranks[0]
        for a in range(0, X.shape[0], CHUNK):  # bounded float64 working memory (the Gram matrices)
            sk = skip[a:a + CHUNK]
            e = exact_errors(X[a:a + CHUNK], kept[a:a + CHUNK], ranks[a:a + CHUNK], skip=sk)
            d.breaches.add_(over(e).sum())
            n_cert = sk.sum()
            d.certified.add_(n_cert)
            d.checked.add_(e.numel() - n_cert)
            torch.maximum(d.worst, e.abs().max(), out=d.worst)


def _join(d: _Device, device: torch.device) -> None:
    if d.stream is not None:
        torch.cuda.current_stream(device).wait_stream(d.stream)


def counts(device) -> dict:
    """``{"breaches", "checked", "certified", "worst"}`` of deferred checks on ``device`` so far (host values; one
    sync): states over the bound, states checked exactly, states not checked because the kernel certified them,
    the largest |e| checked."""
    d = _device(torch.device(device))
    _join(d, d.breaches.device)
    return {"breaches": int(d.breaches), "checked": int(d.checked), "certified": int(d.certified),
            "worst": float(d.worst)}


def mark() -> dict:
    """The breach count of every device with deferred checks (one sync each): pass it to :func:`breached`."""
    with _DEVICES_LOCK:
        devs = list(_DEVICES.items())
    out = {"host": _HOST_BREACHES[0]}
    for key, d in devs:
        _join(d, torch.device(key))
        out[key] = int(d.breaches)
    return out


def breached(since: dict) -> bool:
    """Whether a deferred check found a state over the bound on any device after ``since`` (a :func:`mark`)."""
    now = mark()
    return any(n > since.get(key, 0) for key, n in now.items())


# ------------------------------------------------------------------------------------------- runs
def deferring() -> bool:
    """Whether truncated runs in this thread may use graph windows (deferred checks): False inside
    :func:`immediate` and after a deferred check failed (:func:`check_window`)."""
    return not getattr(_LOCAL, "immediate", False) and not _BROKEN


@contextlib.contextmanager
def immediate():
    """Within it, ``TruncateCallback`` runs no graph windows: every kernel answer is checked (and mended) at once."""
    prev = getattr(_LOCAL, "immediate", False)
    _LOCAL.immediate = True
    try:
        yield
    finally:
        _LOCAL.immediate = prev


def run_checked(run, spec):
    """``run()`` (a truncated run with ``spec``, e.g. a generation or a forward) held to the contract: if a deferred
    check found a state over the bound while it ran (:func:`breached`), ``run()`` is called again inside
    :func:`immediate` and that result returned (logged as a warning; callbacks the run carries see it twice). A
    None or empty ``spec``, a call nested in another ``run_checked`` or inside :func:`immediate`: just ``run()``.
    One host sync before and after."""
    if spec is None or not len(spec) or not deferring() or getattr(_LOCAL, "checking", False):
        return run()
    since = mark()
    _LOCAL.checking = True
    try:
        out = run()
    finally:
        _LOCAL.checking = False
    if not breached(since):
        return out
    log.warning("a truncated state missed the exact top-r energy by more than %g of its energy in a CUDA-graph "
                "window; answering the run again with every boundary checked at once", C.CONTRACT)
    with immediate():
        return run()
