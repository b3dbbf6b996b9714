# Two entry points (README):  `make app`  starts the app on the bundled demo model;  `make test`  runs every test.
# Both create .venv on first use and install everything (CPU torch, Python packages, Debian chromium for browser tests).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): requirements.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch: the CPU build (2.13.0). On a GPU machine install your CUDA build of torch first; pip keeps it.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	# triton is imported by fla at module load even on CPU (fla's kernels are never called on CPU tensors by gdnviz).
	$(BIN)/python -c "import triton" 2>/dev/null || $(BIN)/pip install -q triton==3.6.0
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

setup: $(STAMP)

# tests only, and only beside a CPU torch (a CUDA torch brings its own NVRTC, which must stay): NVRTC needs no GPU,
# so the CPU test run compiles the CUDA kernels' sources for sm_90 (tests/cuda_kernel_checks.py)
nvrtc: $(STAMP)
	@if $(BIN)/python -c "import sys, torch; sys.exit(torch.version.cuda is not None)" && \
		! $(BIN)/python -c "import nvidia.cu13" 2>/dev/null; then $(BIN)/pip install -q nvidia-cuda-nvrtc==13.5.37; fi

chromium:
	@command -v chromium >/dev/null 2>&1 || (apt-get install -y -q chromium >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q chromium))

app: $(STAMP)
	$(BIN)/python -m streamlit run app.py

test: $(STAMP) chromium nvrtc
	$(BIN)/python -m pytest -q

.PHONY: setup chromium nvrtc app test
