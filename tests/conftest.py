import os
import sys
import warnings

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore", message="Triton is not supported on current platform")
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="module")
def one_thread():
    """torch on one intra-op thread for a module: thousands of tiny ops / small batched LAPACK calls, where
    OpenMP threads only add overhead and spin-wait on a shared 2-core box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA (run on the H200 through the device tool)")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
