"""Eigenvalues of many small symmetric float64 matrices, and singular values of many head states through them.

One fast path and its fallback, chosen per call by :func:`uses_kernels`:

* fast path (CUDA, NVIDIA build, n in {64, 128}, both kernels compiled): Householder tridiagonalisation
  (``gdnviz.gpu.cuda_tridiag``) then bisection on Sturm counts (``gdnviz.gpu.cuda_bisect``), one thread block per
  matrix, no host sync; a skip mask leaves out the matrices whose eigenvalues a caller does not need;
* fallback (CPU, other n, no NVRTC, a failed compilation, a ROCm build): ``torch.linalg.eigvalsh`` in float64 on the
  matrices' device (LAPACK on the CPU; on CUDA it loops over the batch and may sync the host).

The reference is float64 ``torch.linalg.svdvals``; tests pin both paths to it. Design notes and timings:
docs/kernels-spectra.md.
"""
from __future__ import annotations

import torch

from gdnviz.gpu import cuda_bisect, cuda_gram, cuda_tridiag


def gram(states: torch.Tensor) -> torch.Tensor:
    """``[..., n, n]`` float64 Gram matrix on the smaller side of each state ``[..., K, V]`` (n = min(K, V)): S Sᵀ if
    K ≤ V, else SᵀS. Products of float32 entries are exact in float64. The reference of :func:`finite_gram`."""
    s = states.double()
    K, V = s.shape[-2:]
    return s @ s.transpose(-1, -2) if K <= V else s.transpose(-1, -2) @ s


def finite_gram(states: torch.Tensor, skip: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G [N, n, n], bad [N])``: the float64 :func:`gram` of states ``[N, K, V]`` (any float dtype) and the states
    whose ``G`` has a non-finite entry (a NaN/inf state entry; for float64 states also an overflow), bool. A flagged
    ``G`` holds zeros where :func:`eigvalsh` would raise on it (its fallback); on its kernel path its entries are
    unspecified. Callers replace the flagged rows' results.

    * With a ``skip`` mask (bool or integer ``[N]`` on the states' device, nonzero = not needed) on CUDA, K and V
      in {64, 128}, NVIDIA build, the kernel compiled: ``gdnviz.gpu.cuda_gram`` (half precisions through float32,
      exactly), work only for the matrices needed, the skipped ones left unwritten (``bad`` False): callers must
      not read their rows. No host sync.
    * Otherwise :func:`gram` in torch, every row computed (on CUDA cuBLAS's batched float64 product, faster than the
      kernel when every matrix is needed: 3.5 vs 7.4 ms for 18,432 states of 128 × 128 on an H100, 2026-12-07);
      ``bad`` from the diagonal for states of float32 and narrower (a NaN/inf entry makes its sum of squares
      non-finite; finite entries cannot overflow float64), from every entry for float64 states.

    Both agree to float64 rounding; the kernel's sums are fused multiply-adds in index order and its ``G`` is
    exactly symmetric."""
    if skip is not None:
        X = states if states.dtype in cuda_gram.CTYPES or not states.is_floating_point() else states.float()
        if cuda_gram.supports(X) and cuda_gram.kernel(X.shape[-2], X.shape[-1], cuda_gram.CTYPES[X.dtype],
                                                      X.device) is not None:
            return cuda_gram.gram(X, skip)
    G = gram(states)
    if states.dtype == torch.float64:
        bad = ~torch.isfinite(G).all(dim=-1).all(dim=-1)
    else:
        bad = ~torch.isfinite(G.diagonal(dim1=-2, dim2=-1)).all(dim=-1)
    if not uses_kernels(G):
        G = torch.where(bad[:, None, None], torch.zeros((), dtype=G.dtype, device=G.device), G)
    return G, bad


def uses_kernels(G: torch.Tensor) -> bool:
    """Whether :func:`eigvalsh` runs the CUDA kernels on ``G [N, n, n]`` (compiling them on first use; no host sync):
    float64 CUDA on an NVIDIA build, n in {64, 128}, both kernels available. Else it runs the fallback."""
    if not cuda_tridiag.supports(G):
        return False
    n, dev = G.shape[-1], G.device
    return cuda_tridiag.kernel(n, dev) is not None and cuda_bisect.kernel(n, dev) is not None


def eigvalsh(G: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
    """Ascending eigenvalues ``[N, n]`` float64 of symmetric float64 ``G [N, n, n]`` on its device: the CUDA kernels
    where :func:`uses_kernels` (no host sync), else ``torch.linalg.eigvalsh`` (which raises on NaN/inf on the CPU:
    see :func:`finite_symmetric`). ``skip`` (bool or integer ``[N]`` on G's device, nonzero = not needed): the
    kernels do no work for those matrices and leave zeros in their rows (the other rows are the same bits as
    without ``skip``); the fallback computes every row. Callers must not read the skipped rows."""
    if uses_kernels(G):
        sk = None if skip is None else skip.to(torch.int32)
        D, E = cuda_tridiag.tridiag(G, sk)
        return cuda_bisect.bisect(D, E, skip=sk)
    return torch.linalg.eigvalsh(G.double())


def finite_symmetric(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(0.5 (A + Aᵀ), bad)`` for ``A [N, n, n]``, the matrices with a NaN/inf entry (``bad [N]``, bool) replaced by
    zeros, so that :func:`eigvalsh` can take them; their eigenvalues are then replaced by NaN. No host sync."""
    A = 0.5 * (A + A.transpose(-1, -2))
    bad = ~torch.isfinite(A).all(dim=-1).all(dim=-1)
    return torch.where(bad[:, None, None], torch.zeros((), dtype=A.dtype, device=A.device), A), bad


def svdvals(states: torch.Tensor) -> torch.Tensor:
    """Singular values ``[N, min(K, V)]`` float64, descending, of finite states ``[N, K, V]``: the square roots of
    :func:`eigvalsh` of their :func:`gram` matrices. Error ≈ sqrt(ε_f64)·σ_max absolute on the smallest values, far
    below the numerical-rank threshold σ_max·128·ε_f32."""
    lam = eigvalsh(gram(states))
    return lam.clamp_min(0).sqrt().flip(-1)
