#!/usr/bin/env bash
# One H200 device call of demo training (scripts/demo/README.md §4), optionally with the GPU test suite running
# beside it. Usage (device tool, timeout_s 600, carry ["out/demo_carry"], plus ".whl" with --tests):
#   [TOTAL_STEPS=N] bash scripts/demo/h200_call.sh MINUTES [--resume] [--tests] [train.py args...]
# TOTAL_STEPS: planned steps, default 2300 (v2's); 'auto' = planned from a throughput benchmark over --plan-minutes
# (v3's), which a resumed run replaces with its checkpoint's plan.
# --resume continues from out/demo_carry/resume (the previous call's returned run folder, copied there).
# --tests runs `pytest -m gpu` (fla from the carried wheels) in the background during training; its log is
# $OUT/gpu_tests.log. Training itself never imports fla (transformers' PyTorch GDN kernels).
set -u
MIN=$1; shift
RESUME=""; TESTS=0
EXTRA=()  # any other argument goes to train.py (e.g. --attn-drop 0.35 --attn-drop-mode all)
for a in "$@"; do case $a in --resume) RESUME="--resume out/demo_carry/resume";; --tests) TESTS=1;; *) EXTRA+=("$a");; esac; done
export PYTHONUNBUFFERED=1
mkdir -p "$OUT/run"
if [ $TESTS = 1 ]; then
  mkdir -p /tmp/site && for w in .whl/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done
  (PYTHONPATH=/tmp/site:$PWD timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_runner.py tests/test_symeig.py \
      tests/test_truncate.py tests/test_kernels_vs_reference.py tests/test_fla_adapter.py \
      > "$OUT/gpu_tests.log" 2>&1; echo "rc=$?" >> "$OUT/gpu_tests.log") &
fi
python3 scripts/demo/train.py $RESUME --out "$OUT/run" --corpus out/demo_carry/corpus \
    --tokenizer out/demo_carry/tokenizer --pylib out/demo_carry/pylib --cache-dir /tmp/demo_cache \
    --total-steps "${TOTAL_STEPS:-2300}" --early-stop-step 800 --minutes "$MIN" "${EXTRA[@]}" 2>&1 \
  | grep -v "falling back\|UserWarning\|x = torch.tensor" | tee "$OUT/run/train.log" | grep -v '"event": "train"'
wait
tail -5 "$OUT/gpu_tests.log" 2>/dev/null
exit 0
