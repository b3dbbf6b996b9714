"""The NVRTC builds a GDN model's runs will need, compiled ahead in parallel into the on-disk cache.

NVRTC is single-threaded and the truncation kernel's builds take 7–45 s each on this project's CPUs. A process
compiles a build at its first use of it (``gdnviz.gpu.nvrtc.Kernels``), one after another; :func:`prebuild` compiles
every missing one at once in separate processes (no GPU needed for that) so the first process on a machine waits for
the slowest build, not for their sum, and every later process reads them from disk.

Used by the worker's warm-up (``gdnviz.warmup``) and by ``scripts/gpu/precompile.py`` (GPU sessions, benchmarks).
"""
from __future__ import annotations

from gdnviz.gpu import nvrtc
from gdnviz.truncation import constants as tc, cuda as ct


def default_sources(K: int = 128, V: int = 128, profile: bool = False, dtypes: tuple = ("float",),
                    spectra: bool = True) -> list[tuple[str, str]]:
    """``[(source, entry)]`` of the builds runs on ``[K, V]`` states select with this process's switches: the
    truncation kernel's two block widths (its Gram and projection entries share each source) for ``dtypes``
    ("float", "double"), optionally their ``GDNVIZ_PROFILE`` builds; the spectra's Gram matrices (for ``dtypes``),
    tridiagonalisation and bisection for ``K`` (``spectra``). Shapes the kernels do not support are left out."""
    from gdnviz.gpu import cuda_bisect, cuda_gram, cuda_tridiag

    out = []
    if K in tc.DIMS and V in tc.DIMS:
        for ctype in dtypes:
            for qb in ct.BLOCKS:
                src = ct.source(K, V, ctype, qb)
                out.append((src, "gdnviz_truncate"))
                if profile:
                    out.append(("#define GDNVIZ_PROFILE\n" + src, "gdnviz_truncate"))
    if spectra:
        if K in cuda_gram.DIMS and V in cuda_gram.DIMS:
            out += [(cuda_gram.source(K, V, ctype), "gdnviz_gram") for ctype in dtypes]
        if K in cuda_tridiag.SIZES:
            out.append((cuda_tridiag.source(K), "gdnviz_tridiag"))
        if K in cuda_bisect.SIZES:
            out.append((cuda_bisect.source(K), "gdnviz_bisect"))
    return out


def missing(sources, capability: str) -> list[tuple[str, str]]:
    """The builds of ``sources`` neither in this process's memory nor on disk."""
    out = []
    for src, name in dict.fromkeys(sources):
        if nvrtc.cache_key(src, capability) in nvrtc._BINARIES:
            continue
        path = nvrtc.cache_path(src, capability)
        if path is None or nvrtc.read_cached(path) is None:
            out.append((src, name))
    return out


def prebuild(sources, capability: str, workers: int | None = None, compile_fn=None) -> list[tuple[str, str]]:
    """Compile the :func:`missing` builds of ``sources`` in parallel processes: ``[(entry, origin)]`` of those
    (empty when nothing is missing or the disk cache is off). ``compile_fn``: as in ``nvrtc.precompile``."""
    todo = missing(sources, capability)
    if not todo or nvrtc.cache_dir() is None:
        return []
    return nvrtc.precompile(todo, capability, workers, compile_fn)
