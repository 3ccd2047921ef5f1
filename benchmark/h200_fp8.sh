#!/usr/bin/env bash
# Issue 14, fp8 KV cache, its decode kernels and FlashInfer (device tool; run from a copy of the repo root, logs in $OUT):
#   bash benchmark/h200_fp8.sh [parts...]
# parts: fisetup jitsave jitload trace hostprof tests sweep offline fi latency peer offline14b cudatests engine fitests pages
# pages: offline runs from RUNS, each backend:page_size[:NAME=VALUE[:ARGS]] (backend triton or fi; the optional environment
#   variable is set for that run, "-" for none; ARGS: offline.py flags for that run, commas for spaces), default "triton:1 fi:1 triton:16 fi:16", labels like fi_ps16_2 (the run's number).
# STOP_AT=S: parts and offline runs that would start S seconds or more after the script began are skipped
# (a device call has a fixed budget: what ran still comes back).
# fisetup needs .whl-fi (flashinfer-python 0.7.0.post1 + apache-tvm-ffi 0.1.15.post2) one folder up or here;
# peer needs .peers (= ../shared/peers) and copies those wheels to .whl, where its run.sh looks.
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws TVM_FFI_CACHE_DIR=/tmp/tvmffi
# the device tool returns at most 8 files: logs go to $LOGS, packed into $OUT/logs.tgz at the end
FINAL_OUT=${OUT:-/tmp/out}; OUT=${LOGS:-/tmp/fp8logs}; mkdir -p "$OUT" "$FINAL_OUT"
RECIPE="--num-requests 256 --max-input 1024 --max-output 1024 --model benchmark/models/qwen3-0.6b --dummy-weights --peer none"
T0=${T0:-$(date +%s)}  # export T0 to share one STOP_AT clock between invocations
late() { [ -n "${STOP_AT:-}" ] && [ $(( $(date +%s) - T0 )) -ge "$STOP_AT" ]; }
off() { # label, args...: one offline run, the headline line into $OUT/offline.tsv
  local label=$1; shift
  if late; then echo -e "$label\tskipped (STOP_AT)" | tee -a "$OUT/offline.tsv"; return; fi
  timeout ${OFF_TIMEOUT:-240} python3 benchmark/offline.py $RECIPE "$@" > "$OUT/off_$label.log" 2>&1
  echo -e "$label\t$(grep -i "tok/s" "$OUT/off_$label.log" | grep -v Warn | tr '\n' ' ' | cut -c1-400)" | tee -a "$OUT/offline.tsv"
}
for part in ${*:-tests sweep offline}; do
  echo "=== $part $(date +%T) t=$(( $(date +%s) - T0 ))s"
  if late; then echo "skipped (STOP_AT)"; continue; fi
  case $part in
    fisetup) W=$(ls -d .whl-fi ../.whl-fi 2>/dev/null | head -1); mkdir -p .whl && cp $W/*.whl .whl/
             python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
             export PYTHONPATH=$PYTHONPATH:/tmp/site ;;
    jitsave) du -sh /tmp/fiws /tmp/tvmffi 2>/dev/null  # FlashInfer's JIT builds, for a later call's jitload (if < 15 MB packed)
             tar czf /tmp/fijit.tgz -C / tmp/fiws tmp/tvmffi 2>/dev/null; ls -l /tmp/fijit.tgz
             [ "$(stat -c %s /tmp/fijit.tgz)" -lt 15000000 ] && cp /tmp/fijit.tgz "$FINAL_OUT"/ ;;
    jitload) # after fisetup: the builds must be newer than the headers pip just wrote, or ninja builds them again
             J=$(ls .fijit/fijit.tgz 2>/dev/null) && tar xzf "$J" -C / && find /tmp/fiws $(ls -d /tmp/tvmffi 2>/dev/null) -exec touch {} + && du -sh /tmp/fiws ;;
    tests) MINISGL_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -x -s tests/test_kv_fp8_cuda.py 2>&1 | grep -v Warn | tee "$OUT/tests_fp8.log" | tail -25 ;;
    sweep) timeout 300 python3 benchmark/kv_fp8_sweep.py ${SWEEP_ARGS:-} --out "$OUT/sweep.json" 2>&1 | grep -v Warn | tee "$OUT/sweep.log" ;;
    offline) NOFF=$(( ${NOFF:-0} + 1 ))  # a second "offline" part in one call gets its own labels
             for r in ${REPS:-1}; do [ $NOFF -gt 1 ] && r="${NOFF}_$r"
               off "triton_auto_$r" --attention-backend triton; off "triton_fp8_$r" --attention-backend triton --kv-cache-dtype fp8_e4m3
               if [ -n "${FP8_AB:-}" ]; then for k in dot; do  # the fp8 decode kernels (auto = the CUDA-core one)
                 MINISGL_FP8_DECODE=$k off "triton_fp8${k}_$r" --attention-backend triton --kv-cache-dtype fp8_e4m3; done; fi; done ;;
    fi) off fi_tc_auto --attention-backend flashinfer
        off fi_tc_fp8 --attention-backend flashinfer --kv-cache-dtype fp8_e4m3
        [ -n "${FI_NOTC:-}" ] && MINISGL_FLASHINFER_TENSOR_CORES=0 off fi_notc_auto --attention-backend flashinfer ;;
    latency) for kv in auto fp8_e4m3; do timeout 200 python3 benchmark/latency.py --model benchmark/models/qwen3-0.6b --dummy-weights \
               --dtype bfloat16 --batch-sizes ${LAT_BS:-1,8,64,256} --kv-cache-dtype $kv --out "$OUT/latency_$kv.json" 2>&1 | grep -v Warn | tail -7 | tee "$OUT/latency_$kv.log"; done ;;
    peer) mkdir -p .whl; W=$(ls -d .whl-fi ../.whl-fi 2>/dev/null | head -1); cp $W/*.whl .whl/
          MINISGL_PEER_BUDGET_S=${PEER_BUDGET:-260} bash .peers/mini-sglang/run.sh > "$OUT/peer_run.log" 2>&1
          grep "RESULT\|FAILED" "$OUT/minisglang.log" "$OUT/peer_run.log" | tail -2 ;;
    offline14b) for kv in auto fp8_e4m3; do timeout 200 python3 benchmark/offline.py --num-requests 256 --max-input 1024 --max-output 1024 \
               --model benchmark/models/qwen3-14b --dummy-weights --peer none --kv-cache-dtype $kv > "$OUT/off14b_$kv.log" 2>&1
               echo -e "14b_$kv\t$(grep -i "tok/s\|kv_tokens" "$OUT/off14b_$kv.log" | tr '\n' ' ' | cut -c1-400)" | tee -a "$OUT/offline.tsv"; done ;;
    cudatests) MINISGL_TEST_DEVICE=cuda timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -x tests/test_models.py tests/test_engine.py \
               tests/test_llm.py tests/test_scheduler.py tests/test_step_failure.py tests/test_sampling_extras.py tests/test_kv_dtype.py \
               -k "not embedded" 2>&1 | tail -15 | tee "$OUT/tests_cuda.log" ;;
    fitests) MINISGL_TEST_DEVICE=cuda timeout ${FITESTS_TIMEOUT:-300} python3 -m pytest -q -s tests/test_flashinfer_cuda.py \
               -k "${FITESTS_K:-not fp8}" 2>&1 | grep -v Warn | tee "$OUT/tests_fi${FITESTS_TAG:-}.log" | tail -25 ;;
    trace) for b in ${TRACE_BACKENDS:-flashinfer triton}; do off "trace_${b}_ps${TRACE_PS:-16}" --attention-backend $b --page-size ${TRACE_PS:-16} --trace
             grep -A24 "device timeline" "$OUT/off_trace_${b}_ps${TRACE_PS:-16}.log" ; done ;;
    hostprof) for b in ${TRACE_BACKENDS:-flashinfer triton}; do  # the host's time under cProfile (slowed down)
               off "prof_${b}_ps${TRACE_PS:-16}" --attention-backend $b --page-size ${TRACE_PS:-16} --profile ${PROF_ARGS:-}; done ;;
    pages) n=0; for spec in ${RUNS:-triton:1 fi:1 triton:16 fi:16}; do IFS=: read -r b ps env extra <<< "$spec"
             be=$b; [ "$b" = fi ] && be=flashinfer; n=$((n + 1)); [ "$env" = - ] && env=
             ( [ -n "$env" ] && export "$env"; off "${b}_ps${ps}${env:+_${env%%=*}${env##*=}}${extra:+_${extra//[-,=]/}}_$n" \
                 --attention-backend $be --page-size "$ps" ${extra//,/ } ); done ;;
    engine) timeout ${ENGINE_TIMEOUT:-300} python3 benchmark/gpu_check.py --parts kernels,engine --backends ${BACKENDS:-triton} --out "$OUT/check" 2>&1 | grep -v Warn | tail -40 | tee "$OUT/engine.log" ;;
  esac
done
echo "=== done $(date +%T) t=$(( $(date +%s) - T0 ))s"
cp "$OUT"/offline.tsv "$OUT"/sweep.json "$FINAL_OUT"/ 2>/dev/null
tar czf "$FINAL_OUT/logs.tgz" -C "$OUT" . 2>/dev/null
