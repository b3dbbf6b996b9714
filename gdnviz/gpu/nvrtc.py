"""CUDA kernels compiled at run time with NVRTC (``torch.cuda._compile_kernel``: no ``nvcc``), cached per key.

One ``Kernels`` per module of hand-written kernels (``gdnviz.truncation.cuda``, ``cuda_tridiag``):
``get(key, device, source, name, shared_mem=0)`` compiles ``source``'s entry ``name`` on first use for ``key`` (call
it outside a CUDA-graph capture) and returns the launchable kernel, or None once a compilation has failed (no
NVRTC, an unsupported GPU, too little shared memory) — then ``available`` is False, ``reason`` says why, and the
module's callers keep their fallback. ``usable()``: available and an NVIDIA build (the kernels assume 32-lane warps).

Compiled binaries are also kept on disk (:func:`cache_dir`: ``$GDNVIZ_KERNEL_CACHE``, else
``$XDG_CACHE_HOME/gdnviz/cuda_kernels`` or ``~/.cache/gdnviz/cuda_kernels``; ``GDNVIZ_KERNEL_CACHE=0`` turns it off),
keyed by a SHA-256 of the source, the GPU's compute capability and the CUDA / NVRTC / torch versions (a
source's entries — ``gdnviz_gram``, ``gdnviz_truncate``, ``gdnviz_project`` — share one compilation).
NVRTC takes 7–45 s per build of the truncation kernel on this project's CPUs (``tests/test_cuda_truncate.py``
compiles several), so without it every process paid that again at its first truncation; with it only the first
process on a machine does, as with fla's and Triton's own on-disk caches. A cache file that cannot be read or
loaded is compiled again and rewritten; writes are atomic (a temporary file, then ``os.replace``).
"""
from __future__ import annotations

import functools
import hashlib
import os
import tempfile
import threading

import torch

from gdnviz import settings

#: Bump when the file layout below changes.
_FORMAT = b"gdnviz-cubin-1\n"


def cache_dir() -> str | None:
    """The on-disk kernel cache's folder, or None when ``GDNVIZ_KERNEL_CACHE=0``."""
    folder = settings.get("GDNVIZ_KERNEL_CACHE")
    if folder is False:
        return None
    if folder:
        return str(folder)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gdnviz", "cuda_kernels")


@functools.lru_cache(maxsize=1)
def _nvrtc_version() -> str:
    try:
        import ctypes

        from torch.cuda._utils import _get_gpu_rtc_library

        lib = _get_gpu_rtc_library()
        major, minor = ctypes.c_int(), ctypes.c_int()
        lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        return f"{major.value}.{minor.value}"
    except Exception:  # noqa: BLE001 - only part of a cache key
        return "?"


def cache_key(source: str, capability: str) -> str:
    """Hex SHA-256 naming the binary of ``source`` for compute capability ``capability`` (e.g. "90") with this
    process's CUDA, NVRTC and torch."""
    h = hashlib.sha256()
    for part in (_FORMAT.decode(), capability, str(torch.version.cuda), _nvrtc_version(), torch.__version__, source):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def cache_path(source: str, capability: str) -> str | None:
    """The cache file of ``source``'s binary for ``capability``, or None when the disk cache is off."""
    folder = cache_dir()
    return os.path.join(folder, cache_key(source, capability) + ".cubin") if folder else None


def read_cached(path: str) -> bytes | None:
    """The binary in a cache file, or None if it is missing, empty or not one of ours."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if not data.startswith(_FORMAT) or len(data) == len(_FORMAT):
        return None
    return data[len(_FORMAT):]


def write_cached(path: str, binary: bytes) -> None:
    """Write a cache file atomically; a failure (read-only or full disk) only loses the cache."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_FORMAT + binary)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass


_BINARIES: dict = {}  # cache_key -> cubin compiled or read in this process (a source's entries share one binary)
_BIN_LOCK = threading.Lock()


def _binary(source: str, name: str, cap: str, compile_fn) -> tuple[bytes, str]:
    """``(cubin of source, origin)``: this process's copy ("memory"), the disk cache ("disk") or NVRTC ("nvrtc")."""
    key = cache_key(source, cap)
    with _BIN_LOCK:
        if key in _BINARIES:
            return _BINARIES[key], "memory"
        path = cache_path(source, cap)
        binary = read_cached(path) if path else None
        origin = "disk"
        if binary is None:
            binary, _ = compile_fn(source, name, cap)
            origin = "nvrtc"
            if path:
                write_cached(path, binary)
        _BINARIES[key] = binary
        return binary, origin


def compile_cached(source: str, name: str, device: torch.device):
    """The launchable ``extern "C"`` kernel ``name`` of ``source`` on ``device`` (its current CUDA context):
    ``(kernel, origin)`` with origin "memory" (another entry of the same source, this process), "disk" (the on-disk
    cache) or "nvrtc" (compiled now, and stored).

    Uses torch's two halves of ``torch.cuda._compile_kernel`` (``_nvrtc_compile``: source → cubin;
    ``_cuda_load_module``: cubin → kernel); with a torch without them it compiles through ``_compile_kernel`` and
    caches nothing. A cached binary that does not load is dropped and compiled again."""
    try:
        from torch.cuda._utils import _cuda_load_module, _nvrtc_compile
    except ImportError:
        return torch.cuda._compile_kernel(source, name), "nvrtc"
    props = torch.cuda.get_device_properties(device)
    cap = f"{props.major}{props.minor}"
    binary, origin = _binary(source, name, cap, _nvrtc_compile)
    try:
        return _cuda_load_module(binary, [name])[name], origin
    except Exception:  # noqa: BLE001 - a damaged or foreign file: compile it again
        if origin == "nvrtc":
            raise
        with _BIN_LOCK:
            _BINARIES.pop(cache_key(source, cap), None)
        path = cache_path(source, cap)
        if path:
            try:
                os.unlink(path)
            except OSError:
                pass
        binary, origin = _binary(source, name, cap, _nvrtc_compile)
        return _cuda_load_module(binary, [name])[name], origin


def precompile(sources, capability: str, workers: int | None = None, compile_fn=None) -> list[tuple[str, str]]:
    """Compile ``sources`` (``[(source, name)]``) for ``capability`` into the disk cache in parallel processes, without
    a GPU (NVRTC needs none): ``[(name, origin)]``. For a machine's first process (``scripts/gpu/precompile.py``):
    NVRTC is single-threaded and the truncation kernel's builds take 7–45 s each. ``compile_fn(source, name, cap)
    -> (cubin, lowered name)``: torch's ``_nvrtc_compile`` when None (another picklable function for tests)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    if cache_dir() is None:
        raise ValueError("GDNVIZ_KERNEL_CACHE=0: no disk cache to fill")
    todo = list(dict.fromkeys(sources))
    n = workers or min(len(todo), os.cpu_count() or 1) or 1
    with ProcessPoolExecutor(max_workers=n, mp_context=multiprocessing.get_context("spawn")) as ex:  # no CUDA fork
        return list(ex.map(_precompile_one, todo, [capability] * len(todo), [compile_fn] * len(todo)))


def _precompile_one(item: tuple[str, str], capability: str, compile_fn=None) -> tuple[str, str]:
    if compile_fn is None:
        from torch.cuda._utils import _nvrtc_compile as compile_fn

    source, name = item
    return name, _binary(source, name, capability, compile_fn)[1]


class Kernels:
    def __init__(self) -> None:
        self._cache: dict = {}
        self._lock = threading.Lock()
        self.available = True
        self.reason = ""
        self.origins: dict = {}  # key -> "memory", "disk" or "nvrtc" (compile_cached)

    def usable(self) -> bool:
        return self.available and torch.version.hip is None

    def get(self, key, device: torch.device, source: str, name: str, shared_mem: int = 0):
        k = self._cache.get(key)
        if k is not None or not self.available:
            return k
        with self._lock:
            k = self._cache.get(key)
            if k is None and self.available:
                try:
                    with torch.cuda.device(device):
                        k, origin = compile_cached(source, name, torch.device(device))
                        if shared_mem:
                            k.set_shared_memory_config(shared_mem)
                except Exception as e:  # noqa: BLE001 - the caller falls back
                    self.available = False
                    self.reason = f"{type(e).__name__}: {str(e)[:300]}"
                    return None
                self._cache[key] = k
                self.origins[key] = origin
        return k
