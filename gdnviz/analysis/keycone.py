"""Key geometry of Gated DeltaNet heads: how narrow the cone of keys is (seed 000 §2 and its footnote).

Inputs everywhere: L2-normalised keys ``k [T, H, K]`` (unit rows, the keys the GDN core writes along; for
models whose key heads are repeated to value heads pass the repeated ``[T, H_v, K]``) and log-decays
``g [T, H]`` (natural log of the per-token decay ``α_t = exp(g_t) ≤ 1``). Keys are dimensionless unit vectors,
so every covariance below is dimensionless; decays enter only through the weights.

Definitions:

* mean key norm ``‖(1/T) Σ_t k_t‖`` per head: 1 for identical keys, ``≈ 0`` for isotropic ones.
* window covariance ``C = (1/w) Σ_{t > T−w} (k_t − μ)(k_t − μ)ᵀ`` with ``μ = (1/w) Σ_{t > T−w} k_t``: the
  centred (population, divide-by-``w``) covariance of the last ``w`` keys. The key-covariance effective rank
  uses ``w = ⌈horizon⌉`` clamped to ``[2, T]`` ("the plain covariance of the keys written inside the horizon"),
  with ``p = λ/Σλ`` (eigenvalue scale).
* decayed key covariance ``P = Σ_t w_t k_t k_tᵀ`` with ``w_t = exp(2 Σ_{s>t} g_s) = Π_{s>t} α_s²``: token
  ``t``'s write as seen at the end of the sequence, decayed by every later token (its own decay acts before its
  write), squared so that ``P`` is on the scale of ``S Sᵀ``. Equivalently ``P = Mᵀ M`` with rows
  ``M_t = √w_t k_t``, so ``√eig(P)`` are the singular values of ``M``. Not normalised (``α = 1`` gives
  ``T`` times the second moment) and not centred.

Memory: nothing of size ``[T, H, K, K]`` is ever formed. Sums over tokens run in chunks of ``chunk`` tokens
(float64 copies of one chunk at a time, ``chunk · H · K · 8`` bytes) with a batched GEMM over the token axis into
``[H, K, K]`` accumulators, on the device of the input tensor (CPU for numpy; CPU for MPS, which has no
float64). ``T = 16384, H = 16, K = 128`` needs a few tens of MB beyond the input with the CPU's 2048-token
chunks; :func:`keycone_sums` on CUDA uses 16,384-token chunks (fewer launches; about 1 GB of float64
temporaries). :class:`DecayedKeyCovariance` computes ``P`` incrementally, segment by segment, for inputs that never
exist as one tensor.

Returned arrays are float64 numpy, whatever the input type.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from .horizons import decay_horizon
from .spectra import _as_f64, effective_rank_from_eigenvalues

__all__ = [
    "mean_key_norm",
    "window_key_covariance",
    "covariance_window",
    "key_covariance_erank",
    "decayed_key_covariance",
    "decayed_key_erank",
    "DecayedKeyCovariance",
    "keycone_summary",
    "keycone_sums",
    "keycone_finish",
]

#: Tokens per float64 chunk in the sums over T.
CHUNK = 2048
#: Tokens per chunk of :func:`keycone_sums` on CUDA: each chunk costs ~30 kernel launches of host time
#: (docs/kernels-spectra.md); a float64 chunk of 16 heads × 128 is 268 MB, and a few live at once.
CUDA_CHUNK = 16384
#: Tokens per partial product of :func:`keycone_sums`' sums over tokens on CUDA (0: one product per chunk). A sum
#: ``Σ_t x_t x_tᵀ`` over a 16K-token chunk is 16 float64 GEMMs of 128 × 128 outputs, each reducing over 16K tokens:
#: too few thread blocks for the GPU. Cut into 1,024-token parts it is 256 GEMMs, then a sum over the parts.
CUDA_SPLIT_TOKENS = 1024
#: Relative tolerance when rounding a horizon up to a window: 1/(1−0.9) = 10.000000000000002 is 10 tokens.
_CEIL_RTOL = 1e-9


def _tensor(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach()
    a = np.asarray(x)
    if a.dtype.kind not in "fiub":
        a = a.astype(np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # non-writable numpy arrays: never written to
        return torch.as_tensor(a)


def _device(t: torch.Tensor) -> torch.device:
    return torch.device("cpu") if t.device.type == "mps" else t.device


def _keys(k: Any) -> torch.Tensor:
    kt = _tensor(k)
    if kt.dim() != 3 or kt.shape[0] < 1:
        raise ValueError(f"keys must be [T, H, K] with T ≥ 1; got shape {tuple(kt.shape)}")
    return kt


def _keys_and_g(k: Any, g: Any) -> tuple[torch.Tensor, torch.Tensor]:
    kt = _keys(k)
    gt = _tensor(g)
    T, H, _ = kt.shape
    if tuple(gt.shape) != (T, H):
        raise ValueError(f"g must be [T={T}, H={H}] to match keys {tuple(kt.shape)}; got {tuple(gt.shape)}")
    return kt, gt.to(_device(kt), torch.float64)


def _f64(x: torch.Tensor, dev: torch.device) -> torch.Tensor:
    return x.to(dev, torch.float64)


def _np(x: torch.Tensor) -> np.ndarray:
    return x.to("cpu").numpy()


def _eigvalsh(A: np.ndarray) -> np.ndarray:
    """Eigenvalues of symmetric ``[..., n, n]`` (symmetrised first), NaN where the matrix has NaN/inf."""
    A = 0.5 * (A + np.swapaxes(A, -1, -2))
    bad = ~np.all(np.isfinite(A), axis=(-1, -2))
    lam = np.linalg.eigvalsh(np.where(bad[..., None, None], 0.0, A))
    lam[bad] = np.nan
    return lam


def mean_key_norm(k: Any, chunk: int = CHUNK) -> np.ndarray:
    """Norm of the mean key ``‖(1/T) Σ_t k_t‖₂`` per head.

    Args:
        k: unit keys ``[T, H, K]``.
    Returns:
        ``[H]`` float64 in ``[0, 1]`` for unit keys: 1 when every key is the same, ``1/√K`` for ``K``
        orthonormal keys, ``≈ 0`` for isotropic keys. Seed 000 reports 0.8-0.94 for the long-horizon heads.
    """
    kt = _keys(k)
    T, H, K = kt.shape
    dev = _device(kt)
    s = torch.zeros(H, K, dtype=torch.float64, device=dev)
    for i in range(0, T, chunk):
        s += _f64(kt[i : i + chunk], dev).sum(0)
    return _np(torch.linalg.vector_norm(s / T, dim=-1))


def window_key_covariance(k: Any, window: Any, chunk: int = CHUNK) -> np.ndarray:
    """Centred covariance of the last ``window`` keys of each head.

    ``C_h = (1/w_h) Σ_{t=T−w_h}^{T−1} (k_t − μ_h)(k_t − μ_h)ᵀ`` with ``μ_h`` the mean of those ``w_h`` keys
    (population covariance, divide by ``w``; ``w = 1`` gives the zero matrix).

    Args:
        k: unit keys ``[T, H, K]``.
        window: tokens, an int for every head or an int array ``[H]``; clamped to ``[1, T]``.
        chunk: tokens per float64 chunk (two passes over the window: mean, then centred sum).
    Returns:
        ``[H, K, K]`` float64, symmetric positive semi-definite (dimensionless).
    """
    kt = _keys(k)
    T, H, K = kt.shape
    dev = _device(kt)
    w = np.broadcast_to(np.asarray(window), (H,))
    if w.dtype.kind == "f" and not np.all(w == np.round(w)):
        raise ValueError(f"window must be integer tokens; got {window!r}")
    w = np.clip(w.astype(np.int64), 1, T)
    C = torch.zeros(H, K, K, dtype=torch.float64, device=dev)
    for wi in np.unique(w):  # heads sharing a window are done together
        heads = torch.as_tensor(np.flatnonzero(w == wi), device=kt.device)
        start = T - int(wi)
        mu = torch.zeros(len(heads), K, dtype=torch.float64, device=dev)
        for i in range(start, T, chunk):  # pass 1: mean of the window
            mu += _f64(kt[i : i + chunk].index_select(1, heads), dev).sum(0)
        mu /= float(wi)
        acc = torch.zeros(len(heads), K, K, dtype=torch.float64, device=dev)
        for i in range(start, T, chunk):  # pass 2: centred second moment (no E[kkᵀ] − μμᵀ cancellation)
            Xc = _f64(kt[i : i + chunk].index_select(1, heads), dev) - mu
            acc += _gram_over_tokens(Xc)
        C[heads.to(dev)] = acc / float(wi)
    return _np(C)


def covariance_window(horizon: Any, T: int) -> np.ndarray:
    """Window in tokens used by :func:`key_covariance_erank`: ``⌈horizon⌉`` clamped to ``[2, T]``.

    The ceiling allows a relative slack of 1e-9 so float noise does not add a token (``1/(1−0.9)`` is
    ``10.000000000000002``, which gives 10). ``inf`` → ``T``. NaN horizons give ``-1`` (no window).
    Returns int64 of the shape of ``horizon``.
    """
    h = _as_f64(horizon)
    nan = np.isnan(h)
    hh = np.where(np.isfinite(h), h * (1.0 - _CEIL_RTOL), float(T))  # inf -> T
    hh = np.where(nan, 2.0, hh)
    w = np.minimum(np.maximum(np.ceil(hh), 2.0), float(T)).astype(np.int64)  # [2, T] (T when T < 2)
    return np.where(nan, -1, w)


def key_covariance_erank(k: Any, g: Any, horizon: Any = None, chunk: int = CHUNK) -> np.ndarray:
    """Effective rank of the plain covariance of the keys written inside each head's decay horizon.

    ``C`` = :func:`window_key_covariance` over the last ``w = ⌈1/(1−ᾱ)⌉`` tokens (``ᾱ`` the mean decay, see
    :func:`gdnviz.analysis.horizons.decay_horizon`), ``w`` clamped to ``[2, T]``; then
    ``exp(−Σ p log p)`` with ``p = λ/Σλ`` over the eigenvalues ``λ`` of ``C`` (eigenvalue scale). Seed 000:
    3-6 for the long-horizon heads. Keys drawn from a ``d``-dimensional subspace give at most ``d``.

    Args:
        k: unit keys ``[T, H, K]``. g: log-decays ``[T, H]``.
        horizon: optional precomputed ``[H]`` horizons in tokens (default: ``decay_horizon(g)``).
        chunk: tokens per float64 chunk.
    Returns:
        ``[H]`` float64 (directions). 0 when all keys in the window are equal; NaN for a NaN horizon.
    """
    kt, gt = _keys_and_g(k, g)
    T = kt.shape[0]
    h = decay_horizon(gt) if horizon is None else _as_f64(horizon)
    w = np.atleast_1d(covariance_window(h, T))
    nan = w < 0
    C = window_key_covariance(kt, np.where(nan, T, w), chunk=chunk)
    er = np.atleast_1d(effective_rank_from_eigenvalues(_eigvalsh(C), scale="eig"))
    er[nan] = np.nan
    return er


def _suffix_log_decay(g64: torch.Tensor) -> torch.Tensor:
    """``c_t = Σ_{s>t} g_s`` for ``g [T, H]`` (exclusive suffix sums, summed from the end; ``c_{T−1} = 0``)."""
    # Scanned along the last (contiguous) axis of [H, T]: CUDA's scan along the outer axis of [T, H] (H = 16
    # columns) is several times slower (docs/kernels-spectra.md); the sums are the same.
    inclusive = torch.flip(torch.cumsum(torch.flip(g64.T.contiguous(), [1]), 1), [1]).T  # Σ_{s≥t} g_s
    return torch.cat([inclusive[1:], torch.zeros_like(inclusive[:1])], 0)


def _gram_over_tokens(X: torch.Tensor) -> torch.Tensor:
    """``Σ_t x_t x_tᵀ`` per head of ``X [t, H, K]``: ``[H, K, K]``, one batched GEMM on strided views of X (the
    einsum ``"thi,thj->hij"`` without its copies of the operands)."""
    return torch.bmm(X.permute(1, 2, 0), X.permute(1, 0, 2))


def _decayed_sum(kt: torch.Tensor, amp: torch.Tensor, chunk: int) -> torch.Tensor:
    """``Σ_t (amp_t k_t)(amp_t k_t)ᵀ`` per head, chunked over T: ``[H, K, K]`` float64 on ``amp``'s device."""
    T, H, K = kt.shape
    dev = amp.device
    P = torch.zeros(H, K, K, dtype=torch.float64, device=dev)
    for i in range(0, T, chunk):
        M = _f64(kt[i : i + chunk], dev) * amp[i : i + chunk, :, None]  # rows √w_t k_t
        P += _gram_over_tokens(M)
    return P


def decayed_key_covariance(k: Any, g: Any, chunk: int = CHUNK) -> np.ndarray:
    """Decayed key second moment ``P = Σ_t w_t k_t k_tᵀ``, ``w_t = exp(2 Σ_{s>t} g_s)``, per head.

    ``√w_t = Π_{s>t} α_s`` is how much of token ``t``'s write survives to the end ``T`` (the last token has
    ``w = 1``; ``g_0`` never enters, since a token's own decay acts before its write). The square puts ``P``
    on the scale of ``S Sᵀ``. Computed as ``Mᵀ M`` with ``M_t = exp(Σ_{s>t} g_s) k_t``: the exponent is an
    exclusive suffix sum of ``g`` (float64, summed from the end, ``≤ 0`` for valid ``g``), so nothing
    overflows; weights of very old tokens underflow to 0, which is their value to float64 precision.

    Args:
        k: unit keys ``[T, H, K]``. g: log-decays ``[T, H]``. chunk: tokens per float64 chunk.
    Returns:
        ``[H, K, K]`` float64, symmetric PSD. ``g = 0`` gives ``Σ_t k_t k_tᵀ`` (``T`` × the second moment);
        very fast decay gives ``≈ k_T k_Tᵀ``.
    """
    kt, gt = _keys_and_g(k, g)
    return _np(_decayed_sum(kt, torch.exp(_suffix_log_decay(gt)), chunk))


def decayed_key_erank(k: Any, g: Any, scale: str = "sqrt", chunk: int = CHUNK) -> np.ndarray:
    """Effective rank of the decayed key covariance ``P`` (:func:`decayed_key_covariance`) per head.

    ``scale="sqrt"`` (default): ``p = √λ / Σ√λ`` over the eigenvalues ``λ`` of ``P`` -- equal to the effective
    rank of the singular values of ``M = [√w_t k_t]_t``, the scale of the state's singular values.
    ``scale="eig"``: ``p = λ / Σλ`` -- the squared-amplitude scale (seed 000's footnote: 2-6 for long heads,
    not comparable with the state's 35-47). Negative round-off eigenvalues are clipped to 0.

    Returns ``[H]`` float64 (directions).
    """
    P = decayed_key_covariance(k, g, chunk=chunk)
    return np.atleast_1d(effective_rank_from_eigenvalues(_eigvalsh(P), scale=scale))


class DecayedKeyCovariance:
    """Incremental :func:`decayed_key_covariance`: feed segments in order, read ``P`` at any point.

    After segments with ``T`` tokens in total, :attr:`P` equals ``decayed_key_covariance`` of their
    concatenation: every update first decays the running ``P`` by ``exp(2 Σ g)`` over the new segment (the
    decay of every token after the old ones), then adds the segment's own decayed sum. Works on the device of
    the first segment (CPU for numpy/MPS) in float64.

    Example::

        acc = DecayedKeyCovariance()
        for k_seg, g_seg in segments:  # k_seg [t, H, K], g_seg [t, H]
            acc.update(k_seg, g_seg)
        acc.P, acc.erank("sqrt")
    """

    def __init__(self, chunk: int = CHUNK) -> None:
        self.chunk = chunk
        self.T = 0
        self._P: torch.Tensor | None = None

    def update(self, k: Any, g: Any) -> "DecayedKeyCovariance":
        """Add a segment ``k [t, H, K]`` (unit keys), ``g [t, H]`` (log-decays) at the end of the sequence."""
        kt, gt = _keys_and_g(k, g)
        if self._P is not None:
            if self._P.shape != (kt.shape[1], kt.shape[2], kt.shape[2]):
                raise ValueError(f"segment [t, H, K] = {tuple(kt.shape)} does not match earlier segments")
            gt = gt.to(self._P.device)
        seg = _decayed_sum(kt, torch.exp(_suffix_log_decay(gt)), self.chunk)
        if self._P is None:
            self._P = seg
        else:
            self._P = torch.exp(2.0 * gt.sum(0))[:, None, None] * self._P + seg.to(self._P.device)
        self.T += kt.shape[0]
        return self

    @property
    def P(self) -> np.ndarray:
        """``[H, K, K]`` float64 numpy: the decayed key covariance of everything fed so far."""
        if self._P is None:
            raise ValueError("no segment has been added yet")
        return _np(self._P)

    def erank(self, scale: str = "sqrt") -> np.ndarray:
        """``[H]`` effective rank of :attr:`P` on the ``"sqrt"`` or ``"eig"`` scale."""
        return np.atleast_1d(effective_rank_from_eigenvalues(_eigvalsh(self.P), scale=scale))


def _gram_head_major(x: torch.Tensor, p: int | None = None) -> torch.Tensor:
    """``Σ_t x_t x_tᵀ`` per head of head-major ``x [H, n, K]`` (float64): ``[H, K, K]``. The tokens are cut into parts
    of ``p`` (default: :data:`CUDA_SPLIT_TOKENS` on CUDA, no cut elsewhere): one batched GEMM over heads × parts, then
    a sum over the parts."""
    H, n, K = x.shape
    p = (CUDA_SPLIT_TOKENS if x.is_cuda else 0) if p is None else p
    if p <= 0 or n < 2 * p:
        return torch.bmm(x.transpose(1, 2), x)
    c = n // p
    xs = x[:, : c * p].reshape(H, c, p, K)
    out = torch.matmul(xs.transpose(-1, -2), xs).sum(1)
    if c * p < n:
        r = x[:, c * p:]
        out = out + torch.bmm(r.transpose(1, 2), r)
    return out


def keycone_sums(k: Any, g: Any, chunk: int | None = None) -> dict[str, torch.Tensor]:
    """The key cone's sums over tokens, before any eigenvalue: float64 tensors on the keys' device, **without a host
    synchronisation** on CUDA. :func:`keycone_summary` takes their eigenvalues on the host; a capture
    (``gdnviz.capture``) solves them on the device with the layer's boundary states' spectra.

    The key-covariance window of each head (``⌈horizon⌉`` clamped to ``[2, T]``, :func:`covariance_window`) is
    applied as a token mask ``t ≥ T − w_h`` over all ``T`` tokens, so no window size has to reach the host; rows
    outside a head's window are replaced by exact zeros (``torch.where``, so a NaN key outside the window stays
    outside, as in :func:`window_key_covariance`). The window's second moment is accumulated uncentred,
    ``Σ k kᵀ − w μμᵀ``, in the same single pass over the keys as the mean and the decayed covariance: each chunk is
    copied to float64 head-major (``[H, t, K]``) once, and the sums over tokens are batched GEMMs.

    chunk: tokens per float64 chunk; None = :data:`CUDA_CHUNK` on CUDA, :data:`CHUNK` elsewhere.
    Returns ``{"horizon": [H], "mean_key_norm": [H], "C": [H, K, K], "P": [H, K, K]}``: ``C`` the window covariance
    (:func:`window_key_covariance`), ``P`` the decayed key covariance (:func:`decayed_key_covariance`).
    """
    kt, gt = _keys_and_g(k, g)
    T, H, K = kt.shape
    dev = _device(kt)
    if chunk is None:
        chunk = CUDA_CHUNK if dev.type == "cuda" else CHUNK
    g64 = gt.to(dev)
    abar = torch.exp(g64).mean(0)  # mean_alpha
    horizon = torch.where(abar >= 1.0, torch.full_like(abar, float("inf")), 1.0 / (1.0 - abar))  # decay_horizon
    nan = torch.isnan(horizon)
    hh = torch.where(torch.isfinite(horizon), horizon * (1.0 - _CEIL_RTOL), torch.full_like(horizon, float(T)))
    hh = torch.where(nan, torch.full_like(hh, float(T)), hh)  # covariance_window; NaN: window T, erank NaN later
    w = torch.clamp(torch.ceil(hh), min=2.0).clamp(max=float(T))
    start = float(T) - w  # [H]: token t is in head h's window iff t >= start[h]
    ampT = torch.exp(_suffix_log_decay(g64)).T  # [H, T]: √w_t of the decayed covariance
    # chunks wholly before every window add exact zeros: skipped where knowing that costs no synchronisation (CPU)
    first = 0 if dev.type == "cuda" else max(0, (T - int(w.max().item())) // chunk * chunk)
    s = torch.zeros(H, K, dtype=torch.float64, device=dev)
    sw = torch.zeros(H, K, dtype=torch.float64, device=dev)  # Σ over each head's window of k_t
    Gw = torch.zeros(H, K, K, dtype=torch.float64, device=dev)  # Σ over each head's window of k_t k_tᵀ
    P = torch.zeros(H, K, K, dtype=torch.float64, device=dev)
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    for i in range(0, T, chunk):  # one pass: each chunk converted to float64 once
        n = min(chunk, T - i)
        x = torch.empty(H, n, K, dtype=torch.float64, device=dev)  # head-major: the GEMMs below read it as is
        x.copy_(kt[i : i + n].transpose(0, 1))
        s += x.sum(1)
        if i >= first:
            m = (torch.arange(i, i + n, device=dev, dtype=torch.float64) >= start[:, None])[..., None]
            xm = torch.where(m, x, zero)
            sw += xm.sum(1)
            Gw += _gram_head_major(xm)
        y = x.mul_(ampT[:, i : i + n, None])  # rows √w_t k_t, in place: x is this chunk's own copy
        P += _gram_head_major(y)
    # centred second moment of the window, Σ (k − μ)(k − μ)ᵀ = Σ k kᵀ − w μ μᵀ with μ = Σ k / w: float64, so the
    # cancellation costs ~1e-16 / (1 − ‖μ‖²) relative (unit keys); a cone with 1 − ‖μ‖² < 1e-8 would lose digits
    C = (Gw - sw[:, :, None] * sw[:, None, :] / w[:, None, None]) / w[:, None, None]
    return {"horizon": horizon, "mean_key_norm": torch.linalg.vector_norm(s / T, dim=-1), "C": C, "P": P}


def keycone_finish(parts: dict) -> dict[str, np.ndarray]:
    """:func:`keycone_summary`'s numbers from the horizons, mean key norms and ascending eigenvalues of ``C`` and
    ``P``: ``parts = {"horizon": [H], "mean_key_norm": [H], "cov_eigvals": [H, K], "P_eigvals": [H, K]}`` (tensors
    or numpy arrays). Returns the summary's dict of ``[H]`` float64 arrays."""
    p = {name: _as_np64(v) for name, v in parts.items()}
    h = np.atleast_1d(p["horizon"])
    cov = np.atleast_1d(effective_rank_from_eigenvalues(p["cov_eigvals"], scale="eig"))
    cov = np.where(np.isnan(h), np.nan, cov)
    return {
        "mean_key_norm": np.atleast_1d(p["mean_key_norm"]),
        "key_cov_erank": cov,
        "decayed_P_erank_sqrt": np.atleast_1d(effective_rank_from_eigenvalues(p["P_eigvals"], scale="sqrt")),
        "decayed_P_erank_eig": np.atleast_1d(effective_rank_from_eigenvalues(p["P_eigvals"], scale="eig")),
        "horizon": h,
    }


def _as_np64(v: Any) -> np.ndarray:
    return _np(v.to(torch.float64)) if isinstance(v, torch.Tensor) else np.asarray(v, np.float64)


def keycone_summary(k: Any, g: Any, chunk: int | None = None) -> dict[str, np.ndarray]:
    """Every per-head key-geometry statistic at once (``P`` is built once): :func:`keycone_sums` on the keys'
    device, then the eigenvalues of ``C`` and ``P`` (float64 LAPACK, NaN rows for NaN/inf) and :func:`keycone_finish`
    on the host.

    Args:
        k: unit keys ``[T, H, K]``. g: log-decays ``[T, H]``.
    Returns:
        dict of ``[H]`` float64 arrays:
        ``mean_key_norm`` (:func:`mean_key_norm`), ``key_cov_erank`` (:func:`key_covariance_erank`, eig scale,
        window ``⌈horizon⌉`` in ``[2, T]``), ``decayed_P_erank_sqrt`` and ``decayed_P_erank_eig``
        (:func:`decayed_key_erank` on both scales), ``horizon`` (tokens, :func:`decay_horizon`). Tests pin each
        to those reference functions.
    """
    sums = keycone_sums(k, g, chunk=chunk)
    return keycone_finish({"horizon": sums["horizon"], "mean_key_norm": sums["mean_key_norm"],
                           "cov_eigvals": _eigvalsh(_np(sums["C"])), "P_eigvals": _eigvalsh(_np(sums["P"]))})
