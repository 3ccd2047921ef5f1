#!/usr/bin/env bash
# Issue 13 on the H200 (device tool): scheduler tests on CUDA (retraction, mixed batches,
# deterministic mode), offline throughput with mixed batches on and off, the deterministic
# mode's cost. Logs in $OUT.   bash benchmark/h200_sched.sh [parts...]   parts: tests mixed det
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RECIPE="--num-requests 256 --max-input 1024 --max-output 1024 --model benchmark/models/qwen3-0.6b --dummy-weights --peer none"
for part in ${*:-tests mixed det}; do
  echo "=== $part $(date +%T)"
  case $part in
    tests) MINISGL_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -x tests/test_retraction.py tests/test_deterministic.py \
             tests/test_scheduler.py tests/test_step_failure.py tests/test_llm.py -k "not embedded" 2>&1 | tail -25 | tee "$OUT/tests13_cuda.log" ;;
    mixed) for v in "" "--disable-mixed-batches"; do
             timeout 120 python3 benchmark/offline.py $RECIPE $v 2>&1 | grep -v Warn | tail -2 | tee -a "$OUT/mixed.log"; done ;;
    det) timeout 120 python3 benchmark/deterministic_check.py 2>&1 | tee "$OUT/det_kernels.log"
         # a smaller recipe: the deterministic mode runs eagerly through a gather-based attention
         for v in "" "--deterministic"; do
           timeout 150 python3 benchmark/offline.py --num-requests 64 --max-input 512 --max-output 256 \
             --model benchmark/models/qwen3-0.6b --dummy-weights --peer none $v 2>&1 | grep -v Warn | tail -2 | tee -a "$OUT/det.log"; done ;;
  esac
done
echo "=== done $(date +%T)"
