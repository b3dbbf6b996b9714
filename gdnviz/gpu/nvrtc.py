"""CUDA kernels compiled at run time with NVRTC (``torch.cuda._compile_kernel``: no ``nvcc``), cached per key.

One ``Kernels`` per module of hand-written kernels (``cuda_cholqr``, ``cuda_tridiag``):
``get(key, device, source, name, shared_mem=0)`` compiles ``source``'s entry ``name`` on first use for ``key`` (call
it outside a CUDA-graph capture) and returns the launchable kernel, or None once a compilation has failed (no
NVRTC, an unsupported GPU, too little shared memory) — then ``available`` is False, ``reason`` says why, and the
module's callers keep their fallback. ``usable()``: available and an NVIDIA build (the kernels assume 32-lane warps).
"""
from __future__ import annotations

import os
import threading

import torch


def env_switch(env_name: str, default_on: bool) -> bool:
    """An on/off switch in environment variable ``env_name``: unset → ``default_on``, ``0`` → off, any other value →
    on (a module may read further values, e.g. a form)."""
    env = os.environ.get(env_name, "").strip()
    return default_on if env == "" else env != "0"


class Kernels:
    def __init__(self) -> None:
        self._cache: dict = {}
        self._lock = threading.Lock()
        self.available = True
        self.reason = ""

    def usable(self) -> bool:
        return self.available and torch.version.hip is None

    def switched_on(self, env_name: str, default_on: bool) -> bool:
        """A kernel module's on/off switch (:func:`env_switch`), and only while ``usable()``."""
        return env_switch(env_name, default_on) and self.usable()

    def get(self, key, device: torch.device, source: str, name: str, shared_mem: int = 0):
        k = self._cache.get(key)
        if k is not None or not self.available:
            return k
        with self._lock:
            k = self._cache.get(key)
            if k is None and self.available:
                try:
                    with torch.cuda.device(device):
                        k = torch.cuda._compile_kernel(source, name)
                        if shared_mem:
                            k.set_shared_memory_config(shared_mem)
                except Exception as e:  # noqa: BLE001 - the caller falls back
                    self.available = False
                    self.reason = f"{type(e).__name__}: {str(e)[:300]}"
                    return None
                self._cache[key] = k
        return k
