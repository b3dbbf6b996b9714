"""Find an NVRTC library for the CPU-side compile checks of the CUDA kernels (tests/test_cuda_*.py)."""
import ctypes
import glob
import os

import torch


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
