"""Shared checks for the NVRTC-compiled CUDA kernels' tests (tests/test_cuda_truncate.py, tests/test_cuda_tridiag.py,
tests/test_cuda_bisect.py).

``compile_log(source)``: compile a kernel for sm_90 with an NVRTC library found here (a CUDA build of torch or the
nvidia-cuda-nvrtc wheel) and return (return code, ptxas log), or None without one. ``needs_gxx``: skip a test that
runs a kernel's source through ``tests.support.cuda_emul`` where g++ is missing.
"""
import ctypes
import glob
import os

import pytest
import torch


def _gxx():
    from tests.support import cuda_emul

    return cuda_emul.available()


# tests that run a kernel's CUDA source on the CPU through tests.support.cuda_emul (g++)
needs_gxx = pytest.mark.skipif(not _gxx(), reason="g++ not installed")


def nvrtc():
    """An NVRTC library from a CUDA torch or the nvidia-cuda-nvrtc wheel, else None."""
    import site

    roots = [os.path.dirname(torch.__file__)] + site.getsitepackages() + [site.getusersitepackages()]
    for root in roots:
        for path in sorted(glob.glob(os.path.join(root, "**", "libnvrtc.so*"), recursive=True)):
            if "builtins" not in path:
                try:
                    return ctypes.CDLL(path)
                except OSError:
                    continue
    return None


def compile_log(source: str):
    """(NVRTC return code, log with ptxas's resource report) for ``source`` on sm_90, or None without NVRTC."""
    lib = nvrtc()
    if lib is None:
        return None
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"k.cu", 0, None, None) == 0
    opts = [b"--gpu-architecture=sm_90", b"--ptxas-options=-v"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    return rc, log.value.decode()


def fake_nvrtc(source: str, name: str, cap: str):
    """A stand-in for torch's ``_nvrtc_compile`` (a CPU build of torch has no NVRTC to call), importable by the
    processes ``gdnviz.gpu.nvrtc.precompile`` spawns: ``(bytes naming source and capability, name)``."""
    return f"cubin of {source} for sm_{cap}".encode(), name
