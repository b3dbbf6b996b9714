#!/usr/bin/env bash
# The guard benchmarks (bench/README.md) on an earlier tree and on this one, one after the other in one device call,
# so that "the same numbers within noise" is a same-machine comparison.
#   usage (repository root, on the GPU machine):  [GUARDS="truncate spectra truncrun capture"] bash bench/guard.sh BEFORE_DIR
# BEFORE_DIR: the earlier tree (`git archive <commit> | tar -x -C BEFORE_DIR`, git-ignored, carried to the device).
# Each benchmark runs on BEFORE_DIR, then on this tree, limited to GUARD_SECONDS (default 150) each; the JSON lines
# go to $OUT/guard_<name>.jsonl with a "tree" key (before / after), stderr to $OUT/guard_stderr.log. .whl as in
# scripts/gpu/session.sh.
set -u
before=$1
mkdir -p /tmp/site && for w in .whl/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done
declare -A CMD=(
  [truncate]="bench/bench_truncate.py --device cuda --quick"
  [spectra]="bench/bench_spectra.py --device cuda"
  [truncrun]="bench/bench_truncated_run.py --device cuda --tokens 16384 --ranks 4,12,32 --eager-rank 0"
  [capture]="bench/bench_capture.py --device cuda --tokens 16384 --repeats 3"
)
for tree in "$before" .; do  # the kernels of both trees, compiled in parallel processes before anything is timed
  (cd "$tree" && PYTHONPATH=/tmp/site:$PWD python3 scripts/gpu/precompile.py 2>&1 | tail -1) &
done; wait
for g in ${GUARDS:-truncate spectra truncrun capture}; do
  for tree in "$before" .; do
    label=$([ "$tree" = . ] && echo after || echo before)
    (cd "$tree" && PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 timeout ${GUARD_SECONDS:-150} python3 ${CMD[$g]}) \
      2>>"$OUT/guard_stderr.log" | grep '^{' | sed "s/^{/{\"tree\": \"$label\", /" | tee -a "$OUT/guard_$g.jsonl" | cut -c1-300
  done
done
