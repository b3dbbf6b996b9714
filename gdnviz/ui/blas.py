"""The Streamlit process's BLAS on one thread.

The app's own linear algebra is small (one head's key cone: an SVD of a few hundred × d_k keys), and it shares the
machine with the worker and the browser. OpenBLAS runs such a call on all cores and its threads spin-wait for each
other: on a busy 2-core machine the Head page's *Decay α & key cone* tab took 0.8 s of script on a first visit with
two BLAS threads and 0.14 s with one (AppTest, 288-head run, 2026-12-07). The worker is another process and keeps its
threads. The limit is set with threadpoolctl, which finds the BLAS libraries loaded in the process (numpy's
OpenBLAS, MKL, BLIS).
"""
from __future__ import annotations

import functools


def blas_threads() -> int | None:
    """The largest thread count of the BLAS libraries loaded in this process (None: no BLAS found)."""
    import numpy  # noqa: F401  (loads its BLAS)
    from threadpoolctl import threadpool_info

    counts = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
    return max(counts) if counts else None


@functools.cache
def one_blas_thread() -> int | None:
    """Run this process's BLAS on one thread (once; app.py calls it on every run); returns ``blas_threads()``
    afterwards (None where no BLAS was found: nothing is changed)."""
    import numpy  # noqa: F401
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")  # stays set: the returned object's restore is never called
    return blas_threads()
