#!/usr/bin/env bash
# The H200 benchmark run (device tool): fused-kernel checks, latency/roofline sweep, offline
# throughput with HF on a subset. Logs and JSON land in $OUT.
#   bash benchmark/h200_run.sh [parts...]   parts: kernels latency offline offline14b tests variants
#                                            profile final trace extend sampling flashinfer repeat
#                                            gemv stepprof stepprof1 latency1 engine cudatests peer
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RECIPE="--num-requests 256 --max-input 1024 --max-output 1024 --model benchmark/models/qwen3-0.6b --dummy-weights"
parts=${*:-kernels latency offline}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
for part in $parts; do
  echo "=== $part $(date +%T)"
  case $part in
    kernels) timeout 240 python3 benchmark/gpu_kernels_check.py --budget-s 150 --out "$OUT" 2>&1 | tee "$OUT/kernels.log" ;;
    latency) timeout 240 python3 benchmark/latency.py --model benchmark/models/qwen3-0.6b --dummy-weights \
               --dtype bfloat16 --batch-sizes 1,8,16,32,64,128,192,256 --out "$OUT/latency.json" 2>&1 | tee "$OUT/latency.log" ;;
    offline) timeout 240 python3 benchmark/offline.py --num-requests 256 --max-input 1024 --max-output 1024 \
               --model benchmark/models/qwen3-0.6b --dummy-weights --peer-subset ${PEER_SUBSET:-32} 2>&1 | tee "$OUT/offline.log" ;;
    variants) for v in "" "--max-extend-tokens 16384" "--page-size 16"; do
               timeout 100 python3 benchmark/offline.py --num-requests 256 --max-input 1024 --max-output 1024 \
               --model benchmark/models/qwen3-0.6b --dummy-weights --peer none $v 2>&1 | grep -v Warn | tail -2 | tee -a "$OUT/variants.log"; done
             MINISGL_DISABLE_OVERLAP_SCHEDULING=1 timeout 100 python3 benchmark/offline.py --num-requests 256 --max-input 1024 \
               --max-output 1024 --model benchmark/models/qwen3-0.6b --dummy-weights --peer none 2>&1 | tail -2 | tee -a "$OUT/variants.log" ;;
    profile) timeout 120 python3 benchmark/offline.py --num-requests 256 --max-input 1024 --max-output 1024 \
               --model benchmark/models/qwen3-0.6b --dummy-weights --peer none --profile 2>&1 | grep -v Warn | tee "$OUT/profile.log" ;;
    final) for v in "" "--max-extend-tokens 16384 --page-size 16"; do
               timeout 100 python3 benchmark/offline.py --num-requests 256 --max-input 1024 --max-output 1024 \
               --model benchmark/models/qwen3-0.6b --dummy-weights --peer none $v 2>&1 | grep -v Warn | tail -2 | tee -a "$OUT/final.log"; done ;;
    repeat) timeout 150 python3 benchmark/offline.py $RECIPE --peer none --repeat 3 ${EXTRA:-} 2>&1 | grep -v Warn | tail -3 | tee -a "$OUT/repeat.log" ;;
    trace) timeout 200 python3 benchmark/offline.py $RECIPE --peer none --trace 2>&1 | grep -v Warn | tee "$OUT/trace.log" ;;
    extend) for v in "--max-extend-tokens 8192" "--max-extend-tokens 32768" ""; do
               timeout 100 python3 benchmark/offline.py $RECIPE --peer none $v 2>&1 | grep -v Warn | tail -2 | tee -a "$OUT/extend.log"; done ;;
    gemv) timeout ${GEMV_TIMEOUT:-200} python3 benchmark/gpu_gemv_tune.py --out "$OUT" --budget-s ${GEMV_BUDGET:-120} ${GEMV_ARGS:---lm-head} 2>&1 | tee "$OUT/gemv.log" ;;
    peer) # upstream mini-sglang's own bench.py, then ours, in one call (the ratio must come from one
          # call): needs .whl (flashinfer 0.7.0.post1 + apache-tvm-ffi) and .peers (= ../shared/peers)
          MINISGL_PEER_BUDGET_S=${PEER_BUDGET:-300} bash .peers/mini-sglang/run.sh > /dev/null 2>&1
          grep "RESULT\|FAILED" "$OUT/minisglang.log" | tail -1
          timeout 90 python3 benchmark/offline.py $RECIPE --peer none --repeat 2 2>&1 | grep -v Warn | tail -3 | tee "$OUT/offline.log" ;;
    stepprof1) timeout 60 python3 benchmark/gpu_step_profile.py --batch-sizes 1 --out "$OUT" 2>&1 | grep -v Warn | tee "$OUT/stepprof.log" ;;
    cudatests) MINISGL_TEST_DEVICE=cuda timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -x tests/test_models.py tests/test_engine.py \
               tests/test_llm.py tests/test_scheduler.py tests/test_step_failure.py tests/test_sampling_extras.py \
               -k "not embedded" 2>&1 | tee "$OUT/tests_cuda.log" ;;
    stepprof) timeout 100 python3 benchmark/gpu_step_profile.py --batch-sizes 1,64 --out "$OUT" 2>&1 | grep -v Warn | tee "$OUT/stepprof.log"
             MINISGL_PDL=0 timeout 100 python3 benchmark/gpu_step_profile.py --batch-sizes 1,64 2>&1 | grep -v Warn | tee "$OUT/stepprof_nopdl.log"
             MINISGL_SKINNY_GEMM=0 MINISGL_PDL=0 timeout 100 python3 benchmark/gpu_step_profile.py --batch-sizes 1,64 2>&1 | grep -v Warn | tee "$OUT/stepprof_off.log" ;;
    latency1) timeout 150 python3 benchmark/latency.py --model benchmark/models/qwen3-0.6b --dummy-weights \
               --dtype bfloat16 --batch-sizes 1,8,64 --out "$OUT/latency1.json" 2>&1 | grep -v Warn | tee "$OUT/latency1.log" ;;
    engine) timeout 200 python3 benchmark/gpu_check.py --parts engine --backends triton --out "$OUT/check" 2>&1 | tee "$OUT/engine.log" ;;
    sampling) timeout 120 python3 benchmark/gpu_sampling_check.py --out "$OUT" 2>&1 | tee "$OUT/sampling.log" ;;
    flashinfer) # needs the carried wheels (.whl): JIT builds take ~2 min the first time
             python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
             PYTHONPATH=/tmp/site:$PYTHONPATH FLASHINFER_WORKSPACE_BASE=/tmp/fiws timeout 420 python3 benchmark/offline.py \
               $RECIPE --peer none --repeat 2 --attention-backend flashinfer 2>&1 | grep -v Warn | tee "$OUT/flashinfer.log" ;;
    offline14b) timeout 200 python3 benchmark/offline.py --num-requests 256 --max-input 1024 --max-output 1024 \
               --model benchmark/models/qwen3-14b --dummy-weights --peer none 2>&1 | tee "$OUT/offline14b.log" ;;
    tests) # structured output needs xgrammar (+ jsonschema for the checks): carried wheels in .whl/
           if ls .whl/xgrammar-*.whl >/dev/null 2>&1; then
             python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
           fi
           MINISGL_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -x tests/test_models.py tests/test_engine.py \
               tests/test_llm.py tests/test_scheduler.py tests/test_step_failure.py tests/test_sampling_extras.py tests/test_prompt_logprobs.py tests/test_structured_output.py \
               -k "not embedded" 2>&1 | tee "$OUT/tests_cuda.log" ;;
  esac
done
echo "=== done $(date +%T)"
