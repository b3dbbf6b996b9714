"""The one place that chooses how states are truncated.

Per state, by its rank r, the state shape [K, V] and the device:

* r ≥ min(K, V): the state unchanged (bit for bit).
* r ≤ 32, CUDA, K and V in {64, 128}, the kernel compiled: the CUDA kernel
  (``gdnviz.truncation.cuda``; float32 and float64 states as they are, bfloat16 / float16 through float32), every
  answer that the kernel's certified attempts did not certify checked exactly against the 1e-5 contract
  (``gdnviz.truncation.contract``): at once outside the runner's CUDA-graph windows (the states over the bound
  answered again on the certified torch path; one host sync), after each window on a side stream inside them (a
  breach makes the run answer again without windows). Certified answers are the same bits in graph windows, the
  eager loop and ``truncate_states``.
* r ≤ 32 and K ≥ 64 otherwise (CPU; CUDA without NVRTC or another shape): the same algorithm in float64 torch
  (``reference.subspace_truncate``), then each state's energy error is bounded (``reference.certificate``) and the
  states whose bound exceeds ``CERT_TOL`` get the exact answer: the 1e-5 contract holds for every state. Syncs.
* r > 32 (below min(K, V)) or K < 64: exact, float64 ``eigh`` of ``S Sᵀ``. Syncs.
"""
from __future__ import annotations

import operator

import torch

from gdnviz.truncation import constants as C
from gdnviz.truncation import contract, cuda
from gdnviz.truncation.ranks import state_ranks
from gdnviz.truncation.reference import (as_batch, certificate, eigh_truncate, subspace_truncate, exact_truncate)

METHODS = ("auto", "subspace", "eigh", "svd")


def kernel_runs(device, K: int, V: int) -> bool:
    """Whether states ``[K, V]`` on ``device`` are truncated by the CUDA kernel at ranks ≤ 32 (no compile here)."""
    return torch.device(device).type == "cuda" and K in C.DIMS and V in C.DIMS and cuda.available()


def _kernel_ready(X: torch.Tensor) -> bool:
    """The kernel runs for ``X`` and compiles (a compile failure makes ``cuda.available()`` False from then on)."""
    N, K, V = X.shape
    if not kernel_runs(X.device, K, V):
        return False
    dtype = X.dtype if X.dtype in cuda.CTYPES else torch.float32
    return cuda.kernel(K, V, dtype, X.device) is not None


def kernel_truncate(X: torch.Tensor, ranks, iters: int | None = None) -> torch.Tensor:
    """The CUDA kernel on ``X [N, K, V]`` (any float dtype; bfloat16 / float16 through float32), output in X's dtype.
    ``ranks``: an int (1 … 32 or ≥ min(K, V); the certified attempts run) or an int32 CUDA tensor ``[N]`` read only by
    the kernel. With the default steps (``iters`` None) every answer the kernel did not certify (its ``done`` flags,
    ``contract.certified``) is checked against the contract (``contract``): inside a window (``contract.window``)
    deferred — capture-safe, no host sync, no allocation that depends on data —, elsewhere at once, the states over
    the bound answered again by the certified torch path (one host sync). ``iters`` given (benchmarks, tests): the
    kernel alone, unchecked."""
    Xc = (X if X.dtype in cuda.CTYPES else X.float()).contiguous()
    res = cuda.launch(Xc, ranks, iters)
    Y = res.out
    if iters is None:
        slots = contract.active()
        if slots is not None:
            slots.record(Xc, Y, ranks, res.done)
        else:
            Y = _enforce(Xc, Y, ranks, res.done)
    return Y.to(X.dtype)


def _enforce(X: torch.Tensor, Y: torch.Tensor, ranks, done: torch.Tensor | None = None) -> torch.Tensor:
    """``Y`` with the states whose exact error breaks the contract answered again on the certified torch path; the
    states ``done`` certifies (``contract.certified``: flag 1) are kept unchecked. One host sync."""
    rt = contract.rank_tensor(ranks, X.shape[0], X.device)
    skip = None if done is None else contract.certified(done, X.shape[0])
    e = contract.exact_errors(X, contract.kept_energy(Y), rt, skip=skip)
    bad = torch.nonzero(contract.over(e)).flatten()
    if bad.numel() == 0:  # the host sync
        return Y
    # a state over the bound has r < min(K, V) (a kept state is copied: error 0) and r ≤ 32
    fixed = _subspace(X.index_select(0, bad), rt.index_select(0, bad).tolist(), None, use_kernel=False)
    return Y.index_copy(0, bad, fixed.to(Y.dtype))


def _path(method: str, r: int, m: int, K: int) -> str:
    """'keep', 'subspace' or 'eigh' / 'svd' for one rank (host values only)."""
    if r >= m:
        return "keep"
    if method == "subspace":
        if r > C.MAX_RANK:
            raise ValueError(f"method='subspace' supports ranks ≤ {C.MAX_RANK}; got {r}. Use 'auto'.")
        if K <= C.BLOCK:
            raise ValueError(f"method='subspace' needs K > {C.BLOCK}; got K={K}. Use 'auto'.")
        return "subspace"
    if method == "auto":
        return "subspace" if (r <= C.MAX_RANK and K >= C.MIN_K) else "eigh"
    return method


def _subspace(S: torch.Tensor, ranks: list[int], iters: int | None, use_kernel: bool) -> torch.Tensor:
    """Truncate ``S [n, K, V]`` (ranks ≤ 32, each < min(K, V)) by the kernel or by the certified torch path."""
    if use_kernel:
        uniform = all(r == ranks[0] for r in ranks)
        rk = ranks[0] if uniform else torch.tensor(ranks, dtype=torch.int32).to(S.device, non_blocking=True)
        return kernel_truncate(S, rk, iters)
    X = S.to(torch.float64)
    rt = torch.tensor(ranks, dtype=torch.long).to(S.device)
    res = subspace_truncate(X, rt, iters=iters)
    out = res.out
    if iters is None:  # the default steps: certify, and answer the uncertified states exactly
        bound = certificate(X, res, ranks)
        bad = torch.nonzero(~(bound <= C.CERT_TOL)).flatten()
        if bad.numel():
            out = out.index_copy(0, bad, eigh_truncate(X.index_select(0, bad), rt.index_select(0, bad)))
    return out.to(S.dtype)


@torch.no_grad()
def truncate_states(states: torch.Tensor, rank, *, method: str = "auto", iters: int | None = None) -> torch.Tensor:
    """Project each state onto its top-``rank`` left singular directions, ``U_r U_rᵀ S``.

    Args:
        states: ``[N, K, V]`` head states (key × value), any floating dtype, any device; leading dims ``[..., K, V]``
            are flattened and restored.
        rank: an int (every state) or N integers (list, tuple, numpy array, integer tensor; a CUDA tensor costs one
            device→host copy). A rank ≥ min(K, V) returns that state unchanged (bit for bit).
        method: ``"auto"`` (module docstring), ``"subspace"`` (the subspace algorithm, r ≤ 32, K > 32: the kernel
            where ``auto`` would run it, else the certified torch path), ``"eigh"`` (exact, eigh of ``S Sᵀ``),
            ``"svd"`` (exact, ``exact_truncate``).
        iters: filter steps of every pass of the subspace algorithm (benchmarks and tests; default
            ``iterations_for(r, p)``). With ``iters`` given the torch path does not certify.

    Returns the truncated states: same shape, dtype and device (computed in float64).

    Raises RankOutOfRange for a rank < 1 or not an integer; ValueError / TypeError for malformed ``states``,
    ``method``, ``iters``, or a per-state rank list of the wrong length.

    Host syncs: one on the CUDA kernel path (its exact check against the contract, ``kernel_truncate``; a rank list
    is also copied host→device); the torch and exact paths sync. With ``iters`` given the kernel's answers are not
    checked.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}.")
    if iters is not None and (isinstance(iters, bool) or operator.index(iters) < 0):
        raise ValueError(f"iters must be a non-negative integer; got {iters!r}.")
    S = as_batch(states)
    N, K, V = S.shape
    m = min(K, V)
    ranks = state_ranks(rank, N)
    if N == 0 or m == 0 or all(r >= m for r in ranks):
        return states.clone()
    if method == "svd":
        return exact_truncate(states, ranks)
    paths = [_path(method, r, m, K) for r in ranks]
    use_kernel = "subspace" in paths and _kernel_ready(S)
    if use_kernel:  # the kernel copies kept states itself: one launch for all of them
        paths = ["subspace" if p == "keep" else p for p in paths]
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(paths):
        groups.setdefault(p, []).append(i)
    if len(groups) == 1 and "keep" not in groups:
        (p,) = groups
        if p == "subspace":
            return _subspace(S, ranks, iters, use_kernel).reshape(states.shape)
        rt = torch.tensor(ranks, dtype=torch.long).to(S.device)
        return eigh_truncate(S.to(torch.float64), rt).to(S.dtype).reshape(states.shape)
    out = S.clone()  # kept states are copied, never recomputed
    for p, idx in groups.items():
        if p == "keep":
            continue
        it = torch.tensor(idx, dtype=torch.long).to(S.device)
        sub = S.index_select(0, it)
        rs = [ranks[i] for i in idx]
        if p == "subspace":
            y = _subspace(sub, rs, iters, use_kernel)
        else:
            y = eigh_truncate(sub.to(torch.float64), torch.tensor(rs, dtype=torch.long).to(S.device)).to(S.dtype)
        out.index_copy_(0, it, y)
    return out.reshape(states.shape)
