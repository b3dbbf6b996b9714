"""Test states for truncation (tests and benchmarks import them from here).

* ``gdn_like_spectra`` / ``gdn_like_states``: random states with decaying spectra like measured GDN heads (effective
  rank 3–40, heads differing in norm by 100×).
* ``hard_states(r)``: a battery of hard states for rank r (clustered and repeated singular values at the cut,
  rank-deficient and zero states, condition numbers to 1e16, GDN-like and toy gated-delta-rule states, states scaled
  by 1e±30, low rank plus noise), with their battery names.
* ``slow_states(r)``: nearly flat and slowly decaying spectra (Gaussian matrices, σᵢ = exp(−0.01 i), a cluster at
  the cut, zero states): where the subspace algorithm's default step counts alone miss 1e-5.
"""
from __future__ import annotations

import functools
import math

import torch

F64 = torch.float64


def gdn_like_spectra(n: int, m: int, gen: torch.Generator) -> torch.Tensor:
    """Decaying singular-value profiles with effective rank 3..40: exp, power law, two scales, small noise floor."""
    i = torch.arange(m, dtype=F64)
    out = []
    while len(out) < n:
        u = torch.rand(4, generator=gen, dtype=F64)
        kind = len(out) % 3
        if kind == 0:
            s = torch.exp(-math.exp(math.log(0.06) + u[0].item() * math.log(1.2 / 0.06)) * i)
        elif kind == 1:
            s = (i + 1) ** -(0.9 + 2.1 * u[0].item())
        else:
            s = torch.exp(-(0.2 + 1.8 * u[0].item()) * i) + 10 ** (-3 + 2.5 * u[1].item()) * torch.exp(
                -(0.02 + 0.18 * u[2].item()) * i
            )
        s = (s + 10 ** (-8 + 5 * u[3].item()) * torch.rand(m, generator=gen, dtype=F64)).sort(descending=True).values
        p = s / s.sum()
        if 3 <= math.exp(-(p * p.clamp_min(1e-300).log()).sum().item()) <= 40:
            out.append(s)
    return torch.stack(out)


def haar(n: int, k: int, m: int, gen: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(n, k, m, generator=gen, dtype=F64))
    return q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]


def gdn_like_states(n: int, K: int, V: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    m = min(K, V)
    sig = gdn_like_spectra(n, m, gen)
    scale = 10 ** (2 * torch.rand(n, generator=gen, dtype=F64) - 1)  # heads differ in norm by 100×
    return (haar(n, K, m, gen) * (sig * scale[:, None])[:, None, :]) @ haar(n, V, m, gen).mT


def from_spectra(sig: torch.Tensor, K: int, V: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n, m = sig.shape
    return (haar(n, K, m, g) * sig[:, None, :]) @ haar(n, V, m, g).mT


def seeded_gdn_like_spectra(n: int, m: int, seed: int) -> torch.Tensor:
    """``gdn_like_spectra`` from a generator seeded with ``seed``."""
    return gdn_like_spectra(n, m, torch.Generator().manual_seed(seed))


@functools.lru_cache(maxsize=None)
def toy_gdn_states(n: int, K: int, V: int, seed: int, tokens: int = 256) -> torch.Tensor:
    """States of a toy gated delta rule S ← a(I − b k kᵀ)S + b k vᵀ with narrow key cones (effective rank 10..95).

    Cached: the 256 sequential steps dominate the battery's cost on a small CPU."""
    g = torch.Generator().manual_seed(seed)
    a = (1 - 1 / torch.exp(torch.empty(n, dtype=F64).uniform_(2.0, 9.0, generator=g)))[:, None, None]
    mean = torch.nn.functional.normalize(torch.randn(n, K, generator=g, dtype=F64), dim=-1)
    cone = torch.empty(n, 1, dtype=F64).uniform_(0.3, 1.5, generator=g)
    S = torch.zeros(n, K, V, dtype=F64)
    for _ in range(tokens):
        k = torch.nn.functional.normalize(mean + cone * torch.randn(n, K, generator=g, dtype=F64) / K**0.5, dim=-1)
        v = torch.randn(n, V, generator=g, dtype=F64)
        b = (0.05 + 0.9 * torch.rand(n, generator=g, dtype=F64))[:, None, None]
        kS = k[:, None, :] @ S  # [n, 1, V]
        S = a * (S - b * k[:, :, None] * kS) + b * k[:, :, None] * v[:, None, :]
    return S.clone()


def hard_states(r: int, K: int = 128, V: int = 128, seed: int = 0) -> tuple[torch.Tensor, list[str]]:
    """A battery of hard states for rank r: returns ([N, K, V] float64, names)."""
    m = min(K, V)
    i = torch.arange(m, dtype=F64)
    spectra: dict[str, list[torch.Tensor]] = {"clustered": [], "rankdef": [], "illcond": []}
    # clustered / repeated singular values around the cut
    for w in (2, 6):
        s = torch.exp(-0.05 * i)
        s[max(r - w, 0) : min(r + w, m)] = s[max(r - w, 0)]
        spectra["clustered"].append(s)
    s = torch.exp(-0.05 * i)
    s[r] = s[r - 1]  # σ_r = σ_{r+1} exactly
    spectra["clustered"].append(s)
    s = torch.exp(-0.05 * i)
    s[r:] = s[r:] / s[r] * s[r - 1] * (1 - 1e-6)  # gap 1e-6
    spectra["clustered"].append(s)
    spectra["clustered"].append(torch.ones(m))  # all equal
    s = torch.ones(m)
    s[: max(r - 1, 1)] = 10.0  # big head, σ_r on a flat tail
    spectra["clustered"].append(s)
    # rank-deficient: rank below, at and just above r
    for rk in sorted({1, max(r // 2, 1), max(r - 1, 1), r, r + 1}):
        s = torch.exp(-0.1 * i)
        s[rk:] = 0
        spectra["rankdef"].append(s)
        s = torch.ones(m)
        s[rk:] = 0
        spectra["rankdef"].append(s)
    # very ill-conditioned
    spectra["illcond"] += [10 ** (-16 * i / m), 10 ** (-8 * i / m)]
    s = torch.full((m,), 1e-8)
    s[0] = 1.0
    spectra["illcond"].append(s)
    s = torch.full((m,), 1e-6)
    s[:r] = torch.logspace(0, -4, r, dtype=F64)
    spectra["illcond"].append(s)

    mats, names = [], []
    for j, (name, ss) in enumerate(spectra.items()):
        mats.append(from_spectra(torch.stack(ss), K, V, seed * 101 + j))
        names += [name] * len(ss)
    mats.append(from_spectra(seeded_gdn_like_spectra(12, m, seed), K, V, seed * 101 + 7))
    names += ["gdn_like"] * 12
    mats.append(toy_gdn_states(6, K, V, 0).clone())
    names += ["toy_gdn"] * 6
    scaled = from_spectra(seeded_gdn_like_spectra(2, m, seed + 1), K, V, seed * 101 + 8)
    mats.append(scaled * torch.tensor([1e-30, 1e30], dtype=F64)[:, None, None])
    names += ["scaled"] * 2
    g = torch.Generator().manual_seed(seed + 3)
    lr = torch.randn(2, K, 3, generator=g, dtype=F64) @ torch.randn(2, 3, V, generator=g, dtype=F64)
    mats.append(lr + 1e-4 * torch.randn(2, K, V, generator=g, dtype=F64))
    names += ["lowrank_noise"] * 2
    mats.append(torch.zeros(1, K, V, dtype=F64))
    names += ["zero"]
    return torch.cat(mats), names


def slow_states(r: int, K: int = 128, V: int = 128, seed: int = 0) -> tuple[torch.Tensor, list[str]]:
    """Nearly flat and slowly decaying spectra for rank r: ([N, K, V] float64, names) — Gaussian matrices (effective
    rank ~100), σᵢ = exp(−c i) for c = 0.003, 0.005, 0.01, σᵢ = sqrt(1 − i/m), a small gap and a near-cluster at the
    cut on slow decays, and a zero state. The default step counts alone miss 1e-5 on several of them at every
    rank 1 … 32 (up to 2e-3 at r = 32)."""
    m = min(K, V)
    g = torch.Generator().manual_seed(1000 + seed)
    i = torch.arange(m, dtype=F64)
    mats, names = [torch.randn(4, K, V, generator=g, dtype=F64)], ["gaussian"] * 4
    sig = [torch.exp(-0.003 * i), torch.exp(-0.005 * i), torch.exp(-0.01 * i), (1 - i / m).sqrt()]
    s = torch.exp(-0.02 * i)
    s[r:] = s[r:] * (1 - 1e-3)  # a gap of 1e-3 at the cut on a slow decay
    sig.append(s)
    s = torch.exp(-0.01 * i)
    s[max(r - 3, 0): r + 3] = s[max(r - 3, 0)] * (1 - 1e-4 * torch.arange(min(r + 3, m) - max(r - 3, 0), dtype=F64))
    sig.append(s)  # a near-cluster around the cut
    mats.append(from_spectra(torch.stack(sig), K, V, seed * 101 + 11))
    names += ["exp_0.003", "exp_0.005", "exp_0.01", "sqrt_linear", "small_gap", "near_cluster"]
    mats.append(torch.zeros(1, K, V, dtype=F64))
    names.append("zero")
    return torch.cat(mats), names
