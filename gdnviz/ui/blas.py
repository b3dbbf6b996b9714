"""The Streamlit process's BLAS on one thread.

The app's own linear algebra is small (one head's key cone: an SVD of a few hundred × d_k keys), and it shares the
machine with the worker and the browser. OpenBLAS runs such a call on all cores and its threads spin-wait for each
other: on a busy 2-core machine the Head page's *Decay α & key cone* tab took 0.8 s of script on a first visit with
two BLAS threads and 0.14 s with one (AppTest, 288-head run, 2026-12-07). The worker is another process and keeps its
threads.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

#: OpenBLAS's "set the number of threads" under the names its builds export (numpy's wheels: scipy_openblas64_).
SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads64_",
           "openblas_set_num_threads")
GETTERS = ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads", "openblas_get_num_threads64_",
           "openblas_get_num_threads")


def _openblas() -> ctypes.CDLL | None:
    """numpy's OpenBLAS as loaded in this process (found in /proc/self/maps), or None (another BLAS, or not Linux)."""
    import numpy  # noqa: F401  (loads its BLAS)

    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps.splitlines() if "openblas" in line.rsplit("/", 1)[-1]}
    for p in sorted(paths):
        lib = ctypes.CDLL(p)
        if any(hasattr(lib, s) for s in SETTERS):
            return lib
    return None


def _call(lib: ctypes.CDLL, names: tuple[str, ...], *args) -> int | None:
    for s in names:
        f = getattr(lib, s, None)
        if f is not None:
            return f(*args)
    return None


def blas_threads() -> int | None:
    """The thread count of numpy's OpenBLAS in this process (None: another BLAS)."""
    lib = _openblas()
    return None if lib is None else _call(lib, GETTERS)


@functools.cache
def one_blas_thread() -> int | None:
    """Run numpy's OpenBLAS on one thread in this process (once; app.py calls it on every run); returns its thread
    count afterwards, or None where numpy uses another BLAS (nothing is changed there)."""
    lib = _openblas()
    if lib is None:
        return None
    _call(lib, SETTERS, 1)
    return _call(lib, GETTERS)
