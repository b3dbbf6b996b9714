"""Whole-file sha256 of weight files, hashed once per version of the file.

A file's digest is remembered in a diskcache under ``<cache dir>/filehash`` (the store's directory,
``gdnviz.store.default_cache_dir``), keyed by (resolved path, size, st_mtime_ns, st_ctime_ns): a later call only
stats the file. Any write changes ctime (which, unlike mtime, cannot be set back), so a file overwritten in place
with its size and mtime restored is hashed again. Shared by the app, the worker and the CLI; safe across processes.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import diskcache

_CACHES: dict[str, diskcache.Cache] = {}


def sha256_of_file(path: str | os.PathLike) -> str:
    """sha256 (hex) of the whole file, read in 8 MiB blocks."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _cache() -> diskcache.Cache:
    from gdnviz.store import default_cache_dir

    d = str(default_cache_dir() / "filehash")
    if d not in _CACHES:
        _CACHES[d] = diskcache.Cache(d, eviction_policy="none", timeout=60)
    return _CACHES[d]


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 (hex) of the whole file at ``path``, from the remembered digest when the file is unchanged."""
    p = Path(path).resolve()
    st = p.stat()
    key = (str(p), st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    cache = _cache()
    digest = cache.get(key)
    if not isinstance(digest, str):
        digest = sha256_of_file(p)
        if p.stat().st_mtime_ns == st.st_mtime_ns and p.stat().st_ctime_ns == st.st_ctime_ns:  # not written meanwhile
            cache.set(key, digest)
    return digest
