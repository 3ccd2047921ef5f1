#!/usr/bin/env bash
# Issue 14's long-context call (device tool): kernel checks (triton + flashinfer), the long-context
# benchmark for both backends, the offline recipe for both with a device timeline, and an A/B of
# MINISGL_PDL at decode batch 8-16. Parts run in order while the call's time lasts (BUDGET_S).
#   bash benchmark/h200_long.sh [parts...]   parts: check long longfi offline pdl latency
#   (BACKENDS=triton: check and offline without flashinfer)
# FlashInfer comes from carried wheels in $WHL (flashinfer-python 0.7.0.post1 + apache-tvm-ffi).
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WHL=${WHL:-.whl-fi}
END=$(( $(date +%s) + ${BUDGET_S:-540} ))
M="--model benchmark/models/qwen3-0.6b --dummy-weights"
RECIPE="--num-requests 256 --max-input 1024 --max-output 1024 $M --peer none"
left() { echo $(( END - $(date +%s) )); }
# run NEED_S TIMEOUT_S cmd...: skip when fewer than NEED_S seconds are left
run() { local need=$1 lim=$2; shift 2
  if [ "$(left)" -lt "$need" ]; then echo "SKIPPED (time): $*"; return; fi
  [ "$(left)" -lt "$lim" ] && lim=$(left); timeout "$lim" "$@"; }
if ls $WHL/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $WHL/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site FLASHINFER_WORKSPACE_BASE=/tmp/fiws
fi
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,power.draw --format=csv | tee "$OUT/gpu.txt"
for part in ${*:-check long longfi offline pdl}; do
  echo "=== $part $(date +%T), $(left) s left"
  case $part in
    check) run 60 230 python3 benchmark/gpu_check.py --parts ${CHECK_PARTS:-kernels} --backends ${BACKENDS:-triton,flashinfer} --out /tmp/check 2>&1 \
             | grep -v Warn | tee "$OUT/check.log"; cp /tmp/check/gpu_check.json "$OUT/" 2>/dev/null ;;
    long) run 90 220 python3 benchmark/long_context.py $M --attention-backend triton --kernels \
             --out "$OUT/long_context_triton.json" 2>&1 | grep -v Warn | tee "$OUT/long.log" ;;
    longfi) run 60 150 python3 benchmark/long_context.py $M --attention-backend flashinfer \
             --out "$OUT/long_context_flashinfer.json" 2>&1 | grep -v Warn | tee -a "$OUT/long.log" ;;
    offline) for be in $(echo ${BACKENDS:-triton,flashinfer} | tr , ' '); do
               run 50 110 python3 benchmark/offline.py $RECIPE --attention-backend $be --trace 2>&1 | grep -v Warn \
                 | tee -a "$OUT/offline.log"; done ;;
    pdl) for pdl in 1 0 1 0; do
           run 35 60 env MINISGL_PDL=$pdl python3 benchmark/latency.py $M --dtype bfloat16 --attention-backend triton \
             --batch-sizes 8,16,32 --gen-len 16 2>&1 | grep -v Warn | grep -A5 "^ *batch" | sed "s/^/PDL=$pdl /" \
             | tee -a "$OUT/pdl.log"; done ;;
    latency) run 40 90 python3 benchmark/latency.py $M --dtype bfloat16 --attention-backend triton \
             --batch-sizes 1,8,16,32,64,256 --out "$OUT/latency.json" 2>&1 | grep -v Warn | tee "$OUT/latency.log" ;;
  esac
done
echo "=== done $(date +%T)"
