#!/usr/bin/env bash
# One H200 call: every GPU-marked test + the benchmarks, outputs under $OUT.
# Device tool: command `bash scripts/gpu/session.sh`, carry [".whl"], timeout_s 600.
# .whl holds flash_linear_attention-0.6.0 and fla_core-0.6.0 (pure-Python wheels; README "GPU"). Both wheels
# fill the same fla/ package, so they are unpacked with zipfile rather than `pip --target --upgrade`.
set -x
mkdir -p /tmp/site && for w in .whl/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers, triton, fla; print(torch.__version__, transformers.__version__, triton.__version__, fla.__version__)"
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_runner.py tests/test_symeig.py \
    tests/test_truncate.py tests/test_kernels_vs_reference.py tests/test_fla_adapter.py 2>&1 | tail -25 | tee $OUT/gpu_tests.log
python3 bench/bench_truncate.py --device cuda 2>&1 | grep '^{' | tee $OUT/bench_truncate.jsonl
python3 bench/bench_spectra.py --device cuda 2>&1 | tee $OUT/bench_spectra.jsonl
python3 bench/bench_capture.py --device cuda --tokens 16384 --repeats 3 2>&1 | grep '^{' | tee $OUT/bench_capture.jsonl
