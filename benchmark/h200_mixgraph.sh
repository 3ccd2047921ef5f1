#!/usr/bin/env bash
# Issue 13's ITL bar on the H200 (device tool): CUDA graphs for prefill/mixed steps. Logs in $OUT.
#   bash benchmark/h200_mixgraph.sh [parts...]       carry: .whl .whl-serve
# parts: check (benchmark/gpu_check.py kernels + engine: graph replay == eager, fp32 == HF),
#        timing (decode step per batch size, a mixed step graph vs eager), tests (scheduler/engine tests on CUDA against HF), serve (offline + all-at-once + 30 req/s,
#        benchmark/h200_serving.sh), ab (30 req/s with SERVER_FLAGS_AB, default: mixed graphs off).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for part in ${*:-check serve}; do
  echo "=== $part $(date +%T)"
  case $part in
    check) PYTHONPATH=. timeout 240 python3 benchmark/gpu_check.py --parts kernels,engine --out "$OUT" 2>&1 \
             | grep -v Warn > "$OUT/gpu_check.log"; grep -E "FAIL|DIFF|ERROR|\[ok\] graph|== triton|mixed|summary|kernels:" "$OUT/gpu_check.log" | cut -c1-220 ;;
    tests) PYTHONPATH=. MINISGL_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -x \
             ${TESTS:-tests/test_scheduler.py tests/test_engine.py tests/test_retraction.py tests/test_llm.py} -k "not embedded and not stream_gap" 2>&1 | tail -15 | tee "$OUT/tests_cuda.log" ;;
    timing) PYTHONPATH=. timeout 200 python3 benchmark/gpu_check.py --parts timing --bs "${BS:-1,64,256}" --out "$OUT/timing" 2>&1 \
             | grep -v Warn | tee "$OUT/timing.log" | grep -E "bs |mixed step|FAIL|ERROR" ;;
    serve) mkdir -p "$OUT/serve"; OUT=$OUT/serve RATES=${RATES:-30} PARTS="offline serve" timeout 330 bash benchmark/h200_serving.sh \
             2>&1 | grep -E "^=== |tok/s|ITL|TTFT|rate|burstiness" | cut -c1-200 ;;
    ab) mkdir -p "$OUT/ab"; OUT=$OUT/ab RATES=${RATES:-30} PARTS="serve" SERVER_FLAGS="${SERVER_FLAGS_AB:---cuda-graph-max-tokens 0}" \
             timeout 300 bash benchmark/h200_serving.sh 2>&1 | grep -E "^=== |tok/s|ITL|TTFT|rate" | cut -c1-200 ;;
  esac
done
# the device tool returns at most 8 files: everything but the logs above goes into one archive
(cd "$OUT" && tar czf data.tgz --exclude data.tgz ./* && find . -mindepth 1 ! -name data.tgz ! -name gpu_check.log ! -name tests_cuda.log -delete)
echo "=== done $(date +%T) ($SECONDS s)"
