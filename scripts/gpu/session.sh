#!/usr/bin/env bash
# One H200 call: GPU tests + benchmarks, outputs under $OUT. Run from the repo root through the device tool with
# carry [".whl"] (fla 0.6.0 wheels: see README "GPU").
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"
python3 bench/bench_spectra.py --device cuda 2>&1 | tee $OUT/bench_spectra.jsonl
python3 bench/bench_capture.py --device cuda --tokens 16384 --naive --repeats 3 2>&1 | grep -v Warning | tee $OUT/bench_capture.jsonl
timeout 240 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_gpu_runner.py tests/test_symeig.py 2>&1 | tail -15 | tee $OUT/gpu_tests.log
