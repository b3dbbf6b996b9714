#!/usr/bin/env bash
# One H200 call: the GPU-marked tests + the benchmarks, outputs under $OUT. Each step has its own time limit (env
# var, seconds; 0 skips the step) so that one slow step cannot starve the others and the sum fits the device tool's
# 600 s per call. fla's first call at a new shape autotunes for seconds. A step whose script is missing is skipped.
# Device tool: command `[STEP_SECONDS...] bash scripts/gpu/session.sh [TESTS...]`, carry [".whl"], timeout_s 600.
# Same-run A/B of the guard benchmarks (before / after a change): bench/guard.sh BEFORE_DIR, in one device call.
# .whl holds flash_linear_attention-0.6.0 and fla_core-0.6.0 (pure-Python wheels; README "GPU"), diskcache (the worker's
# store, tests/test_warmup.py) and wonderwords (RULER's word lists, bench_sweep.py): `pip download diskcache wonderwords
# --no-deps -d .whl` (both pure-Python wheels). The fla wheels fill the same fla/ package, so they are unpacked with
# zipfile rather than `pip --target --upgrade`.
#
# Steps and their limits (defaults add up to more than 600 s: pick what a call should measure). The guard benchmarks
# of bench/RESULTS.md are TRUNC, TRUNCRUN (with TRUNCRUN_ARGS="--ranks 4,12,32 --eager-rank 0"), CAPTURE and SPECTRA.
#   PRECOMPILE_SECONDS (90)     scripts/gpu/precompile.py: gdnviz's NVRTC builds into the on-disk kernel cache, in
#                               parallel processes (PRECOMPILE_ARGS: extra arguments), so that the steps below read
#                               them instead of compiling one after another (7-45 s each)
#   GPU_TEST_SECONDS (150)      pytest -m gpu on TESTS (default: the GPU test files below); GPU_TEST_TIMEOUT (100) is
#                               pytest's limit per test (tests/test_fla_adapter.py is not in the default list: it
#                               has its own step, FLA_TEST_SECONDS)
#   FLA_TEST_SECONDS (0)        pytest -m gpu tests/test_fla_adapter.py alone (fla's own GatedDeltaNet models, 16-dim
#                               heads: fla compiles and autotunes its kernels for them in a cold process; the two fp32
#                               tests alone can take most of 290 s on a fresh machine)
#   TRUNC_SECONDS (100)         bench_truncate.py --quick: one boundary of 288 states truncated at r = 1/4/12/32
#   PHASES_SECONDS (0)          bench_truncate_phases.py: cycles per phase of the CUDA truncation kernel
#                               (PHASES_ARGS: extra arguments)
#   SPECTRA_SECONDS (0)         bench_spectra.py: singular values of 288 and 18,432 states (a 16K capture's spectra)
#   TRUNCRUN_SECONDS (150)      bench_truncated_run.py: 16K tokens, every head truncated at every boundary
#                               (TRUNCRUN_ARGS: extra arguments, e.g. "--ranks 4 --eager-rank 0 --mixed-ranks 1,4,12,32";
#                               TRUNCRUN_PROFILE=25 adds a profiler table, which can take the step past 70 s)
#   CAPTURE_SECONDS (170)       bench_capture.py 16K (pipelined vs inline statistics, segment loop), new lengths
#                               (110 s can run out after the baseline rows on a fresh machine; the capture alone,
#                               CAPTURE_ARGS="", fits in about 107 s with the precompile)
#   CAPTURE128K_SECONDS (90)    bench_capture.py 128K, time and memory only
#   CAPTURE_STATS_SECONDS (0)   bench_capture_stats.py 16K: the capture's statistics per component, without the model
#   SWEEP_SECONDS (0)           the demo model's CLI sweep, batch 8 vs 1 (rows compared)
#   BENCH_SWEEP_SECONDS (90)    bench_sweep.py: prompts/s batched vs one at a time, 0.8B shape, 4K and 16K
#                               (BENCH_SWEEP_ARGS replaces "--lengths 4096,16384 --n 8 --batch 8")
#   DEMO_SECONDS (0)            the demo model's capture in two consecutive processes (autotune cache check)
#   DECODE_SECONDS (0)          bench_decode.py: ms per greedy decode step, gdnviz's runner vs its StaticCache decoder,
#                               eager and replayed from a CUDA graph (DECODE_ARGS replaces "--prompt 4096 --batch 1,4
#                               --steps 64")
set -x
mkdir -p /tmp/site && for w in .whl/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers, triton, fla; print(torch.__version__, transformers.__version__, triton.__version__, fla.__version__)"
on() { [ "${1:-0}" != 0 ]; }
# a step runs when its limit is not 0 and its script exists (bench scripts come and go; the call goes on)
has() { [ -e "$1" ] || { echo "skipped: $1 is missing"; false; }; }
# the default GPU test files; the globs pick up the truncation package's test files, whatever their names
TESTS=${*:-tests/test_truncation*.py tests/test_cuda_truncate.py tests/test_fused_truncate.py tests/test_truncate.py tests/test_cuda_tridiag.py tests/test_cuda_bisect.py tests/test_symeig.py tests/test_scan_graph.py tests/test_gpu_runner.py tests/test_qk_norm.py tests/test_fla_conv.py tests/test_analysis.py tests/test_capture.py tests/test_static_decode.py tests/test_kernels_vs_reference.py}
TESTS=$(for t in $TESTS; do [ -e "${t%%::*}" ] && echo "$t"; done)  # in the order given (pytest keeps it); missing files dropped
if on ${PRECOMPILE_SECONDS:-90}; then
  timeout ${PRECOMPILE_SECONDS:-90} python3 scripts/gpu/precompile.py ${PRECOMPILE_ARGS:-} 2>&1 | tail -3
fi
if on ${GPU_TEST_SECONDS:-150}; then
  timeout ${GPU_TEST_SECONDS:-150} python3 -m pytest -v -m gpu -p no:cacheprovider --timeout ${GPU_TEST_TIMEOUT:-100} --tb=short --durations=15 \
      $TESTS > $OUT/gpu_tests.log 2>&1; echo "pytest rc=$?" >> $OUT/gpu_tests.log
  grep -E "PASSED|FAILED|ERROR|SKIPPED|rc=|Error|assert" $OUT/gpu_tests.log | tail -40
fi
if on ${FLA_TEST_SECONDS:-0}; then
  timeout ${FLA_TEST_SECONDS} python3 -m pytest -v -s -m gpu -p no:cacheprovider --timeout ${FLA_TEST_SECONDS} --tb=short \
      tests/test_fla_adapter.py > $OUT/gpu_tests_fla.log 2>&1; echo "pytest rc=$?" >> $OUT/gpu_tests_fla.log
  grep -E "PASSED|FAILED|ERROR|rc=|cuda-vs-cpu|bf16 hybrid" $OUT/gpu_tests_fla.log | cut -c1-300
fi
if on ${TRUNC_SECONDS:-100} && has bench/bench_truncate.py; then
  timeout ${TRUNC_SECONDS:-100} python3 bench/bench_truncate.py --device cuda --quick > $OUT/bench_truncate.log 2>&1
  grep "^{" $OUT/bench_truncate.log | cut -c1-400
fi
if on ${PHASES_SECONDS:-0} && has bench/bench_truncate_phases.py; then
  timeout ${PHASES_SECONDS} python3 bench/bench_truncate_phases.py --device cuda ${PHASES_ARGS:-} > $OUT/bench_truncate_phases.log 2>&1
  grep '^{' $OUT/bench_truncate_phases.log | cut -c1-420
fi
if on ${SPECTRA_SECONDS:-0} && has bench/bench_spectra.py; then
  timeout ${SPECTRA_SECONDS} python3 bench/bench_spectra.py --device cuda 2>&1 | tee $OUT/bench_spectra.jsonl
fi
if on ${TRUNCRUN_SECONDS:-150}; then
  timeout ${TRUNCRUN_SECONDS:-150} python3 bench/bench_truncated_run.py --device cuda --tokens 16384 --profile ${TRUNCRUN_PROFILE:-0} ${TRUNCRUN_ARGS:-} \
      > $OUT/bench_truncated_run.log 2>&1; grep '^{' $OUT/bench_truncated_run.log | cut -c1-400
fi
if on ${CAPTURE_SECONDS:-170}; then
  timeout ${CAPTURE_SECONDS:-170} python3 bench/bench_capture.py --device cuda --tokens 16384 --repeats 3 \
      ${CAPTURE_ARGS---profile 25 --new-lengths 3000,7777,20000} > $OUT/bench_capture.log 2>&1; grep '^{' $OUT/bench_capture.log | cut -c1-400
fi
if on ${CAPTURE_STATS_SECONDS:-0} && has bench/bench_capture_stats.py; then
  timeout ${CAPTURE_STATS_SECONDS} python3 bench/bench_capture_stats.py --device cuda --tokens 16384 \
      > $OUT/bench_capture_stats.log 2>&1; grep '^{' $OUT/bench_capture_stats.log | cut -c1-300
fi
# scale (issue #6 target 4): one 128K-token capture, peak GPU memory and stored size
if on ${CAPTURE128K_SECONDS:-90}; then
  timeout ${CAPTURE128K_SECONDS:-90} python3 bench/bench_capture.py --device cuda --tokens 131072 --repeats 1 --no-compare \
      > $OUT/bench_capture_128k.log 2>&1; grep '^{' $OUT/bench_capture_128k.log | cut -c1-400
fi
# one retrieval sweep on the GPU (issue #4): batched greedy answers with fla, demo model, bf16; batch 8 vs 1
if on ${SWEEP_SECONDS:-0}; then
  for b in 8 1; do
    rm -rf /tmp/sweep_b$b; t0=$(date +%s%N)
    timeout ${SWEEP_SECONDS} python3 -m gdnviz.cli sweep demo --tasks niah_single_1,vt --lengths 2048 --ranks 1,4,128 \
        --n 8 --batch $b --device cuda --dtype bfloat16 --chat off --out /tmp/sweep_b$b > /tmp/sweep_b$b.log 2>&1
    echo "sweep batch $b rc=$? wall $(( ($(date +%s%N) - t0) / 1000000 )) ms (process start and model load included)" \
         "$(grep -c . /tmp/sweep_b$b/rows.csv 2>/dev/null) lines in rows.csv"; tail -3 /tmp/sweep_b$b.log
  done
  cp /tmp/sweep_b8/table.csv $OUT/sweep_table_b8.csv 2>/dev/null
  cmp /tmp/sweep_b8/rows.csv /tmp/sweep_b1/rows.csv && echo "sweep rows: batch 8 == batch 1"
fi
# prompts per second, batched vs one at a time, on the 0.8B shape at 4K and 16K (issue #6 target 5), warm
if on ${BENCH_SWEEP_SECONDS:-90}; then
  timeout ${BENCH_SWEEP_SECONDS:-90} python3 bench/bench_sweep.py --device cuda --model 0.8b \
      ${BENCH_SWEEP_ARGS:---lengths 4096,16384 --n 8 --batch 8} > $OUT/bench_sweep.log 2>&1; grep '^{' $OUT/bench_sweep.log | cut -c1-400
fi
# ms per greedy decode step (sweeps are decode-bound)
if on ${DECODE_SECONDS:-0}; then
  timeout ${DECODE_SECONDS} python3 bench/bench_decode.py --device cuda ${DECODE_ARGS:---prompt 4096 --batch 1,4 --steps 64} \
      > $OUT/bench_decode.log 2>&1; grep '^{' $OUT/bench_decode.log | cut -c1-400
fi
# the bundled demo model on the GPU: load, capture 4K tokens of a sample document (bf16, fla), time it -- in two
# processes one after the other: the second shows whether fla's on-disk autotune cache (FLA_CACHE_RESULTS=1) and
# Triton's kernel cache remove the first-call stall for every later process on the same machine
if on ${DEMO_SECONDS:-0}; then
for proc in first second; do echo "demo capture, $proc process"
timeout ${DEMO_SECONDS} python3 - <<'PY' 2>&1 | grep -v Warn | tail -5
import time, torch
from gdnviz.models import load
from gdnviz.capture import capture_document
from gdnviz.documents import sample_documents, tokenize
lm = load("demo", device="cuda", dtype="bfloat16")
doc = max(sample_documents(), key=lambda d: len(d.text))
ids = tokenize(lm.tokenizer, doc.text)[:4096]
for i in range(2):
    t = time.perf_counter(); c = capture_document(lm, ids, 256); torch.cuda.synchronize()
    print("demo capture", len(ids), "tokens", round(time.perf_counter() - t, 3), "s", c.meta["readouts"], c.meta["backends"])
PY
done
fi
exit 0
