#!/usr/bin/env bash
# Every GPU-machine run of the project, as named parts of one script (device tool, one H200).
#
#   COMMIT=<sha> bash tools/h200.sh PART...   from the repo root; headlines on stdout, logs in $OUT/logs.tgz
#
# What a call carries (the device tool sends the checkout only; set these up once, in the checkout):
#   .peers  cp -r /work/shared/peers .peers && echo /.peers/ >> .git/info/exclude
#           (upstream mini-sglang 20fcd7f + its run.sh; part `peer`)
#   .whl    flashinfer_python-0.7.0.post1 and apache_tvm_ffi-0.1.15.post2 wheels (the device README's
#           wheel recipe; /.whl/ is in .gitignore): the peer's FlashInfer (`peer`) and our FlashInfer
#           backend (`fitests`, `flashinfer`). Optional: xgrammar, pydantic, jsonschema wheels for the
#           structured-output tests in `cudatests` (with TESTS_SITE=1, which also puts FlashInfer on
#           the path: the attention tests then check it too, after ~2 min of JIT builds); for `serve`,
#           fastapi, uvicorn, pyzmq, msgpack, prometheus-client, uvloop, httptools, ... and a tokenizer
#           folder .whl/smollm2-tokenizer (or .whl-serve/, as before).
#   .fijit  fijit.tgz from an earlier call's `jitsave` (optional; `jitload` restores FlashInfer's JIT
#           builds, ~2 min of device time per fresh machine otherwise).
#
# Parts (run in the order given; each one's figure is the one quoted in docs/PERFORMANCE.md):
#   peer        upstream mini-sglang's own offline bench (.peers/mini-sglang/run.sh), then our offline
#               recipe with bf16 K/V, then with --kv-cache-dtype fp8_e4m3: the same-call ratios
#   offline     our offline recipe, bf16 K/V then fp8 K/V (no peer)
#   offline14b  the same recipe on Qwen3-14B, bf16 and fp8 K/V
#   det         --deterministic vs the default (issue 31): the 64-request workload (--max-input 512
#               --max-output 256, as in docs/PERFORMANCE.md), then the offline recipe, each mode in its own process
#   models      issue 27's shapes ($MODELS, default gemma-3-12b deepseek-v2-lite gpt-oss-20b in
#               benchmark/models/): the offline recipe, then latency.py's decode steps vs roofline
#   cudatests   the CUDA pytest suites (MINISGL_TEST_DEVICE=cuda); TESTS / PYTEST_ARGS override
#   latency     benchmark/latency.py: batch-1 TTFT/ITL through the scheduler, decode step vs roofline
#   long        benchmark/long_context.py (triton, with its kernel sweeps)
#   fitests     tests/test_flashinfer_cuda.py (FlashInfer from .whl; FITESTS_K selects)
#   flashinfer  our offline recipe on the FlashInfer backend at page size 16, triton beside it
#   serve       the HTTP server: offline figure, then the recipe as streams (all at once, Poisson
#               $RATES), then the chat mix without max_tokens (needs the serving wheels in .whl)
#   trace       offline recipe with --trace (device timeline), $TRACE_BACKENDS
#   sweep       tools/kv_fp8_sweep.py (fp8 decode kernel configs vs bf16 KV), $SWEEP_ARGS
#   gemv        tools/gemv_tune.py (skinny GEMV tiles), $GEMV_ARGS
#   stepprof    tools/step_profile.py (kernels of one decode step), $STEP_BS
#   moetune     tools/tune_moe.py (MoE GEMM tiles on a Qwen3-30B-A3B-shaped layer)
#   jitsave     pack FlashInfer's JIT builds into $OUT/fijit.tgz;  jitload: restore .fijit/fijit.tgz
#
# BUDGET_S (default 570): parts and runs that would start past it are skipped and a running one is
# cut at it, so a call inside the device tool's 600 s limit still returns what ran.
# A ~9 minute call doing the peer comparison and the CUDA suites (device tool, carry [".whl", ".peers"]):
#   bash tools/h200.sh peer cudatests
# (the suites get what the peer and the two offline runs leave of BUDGET_S; `cudatests` alone is a
# second call of ~5 min. The CPU's interpreter tests and the embedded-model tests are left out.)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws TVM_FFI_CACHE_DIR=/tmp/tvmffi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The device tool returns at most 8 files: logs go to $LOGS, packed into $OUT/logs.tgz at the end.
FINAL_OUT=${OUT:-/tmp/out}; LOGS=${LOGS:-/tmp/h200logs}; mkdir -p "$FINAL_OUT" "$LOGS"
T0=$(date +%s); BUDGET_S=${BUDGET_S:-570}
MODEL=benchmark/models/qwen3-0.6b
RECIPE="--num-requests 256 --max-input 1024 --max-output 1024 --dummy-weights --peer none"

left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
# limited CAP cmd...: cmd under a timeout of min(CAP, time left); SIGINT first, so pytest still
# prints its summary; skipped when under 20 s are left
limited() { local cap=$1 l; shift; l=$(left)
  if [ "$l" -lt 20 ]; then echo "SKIPPED (budget): $*"; return 124; fi
  [ "$l" -lt "$cap" ] && cap=$l
  timeout -s INT -k 15 "$cap" "$@"; }
# off LABEL ARGS...: one offline run of the recipe in its own process; its headline line to stdout
off() { local label=$1; shift
  limited "${OFF_TIMEOUT:-150}" python3 benchmark/offline.py $RECIPE "$@" > "$LOGS/off_$label.log" 2>&1
  echo -e "$label\t$(grep -i "tok/s" "$LOGS/off_$label.log" | grep -v Warn | tr '\n' ' ' | cut -c1-400)" | tee -a "$LOGS/offline.tsv"; }
site() {  # the carried wheels (.whl, and .whl-serve if carried) into /tmp/site, on PYTHONPATH after the repo
  [ -n "${SITE_DONE:-}" ] && return; SITE_DONE=1
  local w; w=$(ls .whl/*.whl .whl-serve/*.whl 2>/dev/null) || true
  [ -n "$w" ] || { echo "no .whl/*.whl carried"; return; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $w 2>&1 \
    | grep -v "^WARNING" | tail -3
  export PYTHONPATH=$PYTHONPATH:/tmp/site; }
# the HTTP server for `serve` (python, not curl: the device image may lack it)
get() { python3 -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:${PORT:-30000}$1', timeout=5).read().decode())"; }
SERVER_PID=""
stop_server() { [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null && { kill -TERM "$SERVER_PID"
    for _ in $(seq 40); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done; kill -KILL "$SERVER_PID" 2>/dev/null; }
  SERVER_PID=""; }
trap stop_server EXIT
start_server() { local log=$1; shift  # log name, server flags
  python3 -m minisgl --model $MODEL --load-format dummy --port "${PORT:-30000}" --max-seq-len 2560 ${SERVER_FLAGS:-} "$@" \
    > "$LOGS/$log.log" 2>&1 & SERVER_PID=$!
  for _ in $(seq 480); do get /health >/dev/null 2>&1 && { echo "server up"; return 0; }
    kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
  echo "server not ready:"; tail -30 "$LOGS/$log.log"; stop_server; return 1; }
bench() { local name=$1; shift  # result name, benchmark/serving.py flags
  limited 240 python3 benchmark/serving.py --base-url "http://127.0.0.1:${PORT:-30000}" --output "$LOGS/$name.json" \
    --plot "$LOGS/$name.png" "$@" > "$LOGS/$name.log" 2>&1
  grep -E "tok/s|ITL|TTFT|rate|burstiness" "$LOGS/$name.log" | cut -c1-200; get /metrics > "$LOGS/$name.metrics.txt"; }
reps() { seq "${REPS:-1}"; }  # REPS=N: each offline run N times, one process each

# the CUDA suites: every test file that runs on CUDA (the *_cuda.py files skip elsewhere)
CUDA_TESTS="tests/test_attention_cuda.py tests/test_triton_ops_cuda.py tests/test_sampling_cuda.py tests/test_kv_fp8_cuda.py
  tests/test_models.py tests/test_engine.py tests/test_llm.py tests/test_scheduler.py tests/test_step_failure.py
  tests/test_sampling_extras.py tests/test_kv_dtype.py tests/test_deterministic.py tests/test_retraction.py
  tests/test_prompt_logprobs.py tests/test_structured_output.py tests/test_phi3.py tests/test_models_round2.py tests/test_gemma.py
  tests/test_window_pages.py"

# the device's copy carries the working tree but not its .git: the caller names the commit (COMMIT=)
{ echo "date $(date -u +%FT%TZ) commit ${COMMIT:-unnamed (pass COMMIT=)} parts: $*"
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)"; } | tee "$LOGS/env.txt"
for part in "$@"; do
  echo "=== $part $(date +%T) t=$(( $(date +%s) - T0 ))s"
  if [ "$(left)" -lt 20 ]; then echo "skipped (BUDGET_S)"; continue; fi
  case $part in
    peer) # the ratio must come from one call: upstream first (its JIT prewarm runs on 7 cores), then ours
      OUT=$LOGS MINISGL_PEER_BUDGET_S=$(( $(left) < ${PEER_BUDGET:-300} ? $(left) : ${PEER_BUDGET:-300} )) \
        bash .peers/mini-sglang/run.sh > "$LOGS/peer_run.log" 2>&1
      grep -h "RESULT\|FAILED" "$LOGS/minisglang.log" "$LOGS/peer_run.log" 2>/dev/null | tail -1
      cp "$LOGS/minisglang_result.json" "$FINAL_OUT/" 2>/dev/null
      for r in $(reps); do off "bf16_$r" --model $MODEL --attention-backend triton
        off "fp8_$r" --model $MODEL --attention-backend triton --kv-cache-dtype fp8_e4m3; done
      python3 -c "import json, re; p = json.load(open('$LOGS/minisglang_result.json'))['output_tok_s']
for line in open('$LOGS/offline.tsv'):
    m = re.search(r'= ([0-9.]+) output tok/s', line)
    if m: print(line.split()[0], f'{float(m.group(1)) / p:.3f}x mini-sglang ({p:.0f} tok/s)')" 2>/dev/null ;;
    offline) for r in $(reps); do off "bf16_$r" --model $MODEL --attention-backend triton
               off "fp8_$r" --model $MODEL --attention-backend triton --kv-cache-dtype fp8_e4m3; done ;;
    det) for mode in default deterministic; do flag=""; [ $mode = deterministic ] && flag=--deterministic
           OFF_TIMEOUT=${OFF_TIMEOUT:-120} limited 120 python3 benchmark/offline.py --num-requests 64 --max-input 512 \
             --max-output 256 --model $MODEL --dummy-weights --peer none $flag > "$LOGS/det64_$mode.log" 2>&1
           echo -e "det64_$mode\t$(grep -i "tok/s" "$LOGS/det64_$mode.log" | grep -v Warn | tr '\n' ' ' | cut -c1-300)"; done
         for mode in default deterministic; do flag=""; [ $mode = deterministic ] && flag=--deterministic
           off "recipe_$mode" --model $MODEL $flag; done ;;
    models) for m in ${MODELS:-gemma-3-12b deepseek-v2-lite gpt-oss-20b}; do
              OFF_TIMEOUT=${OFF_TIMEOUT:-200} off "$m" --model "benchmark/models/$m"
              limited 150 python3 benchmark/latency.py --model "benchmark/models/$m" --dummy-weights --dtype bfloat16 \
                --batch-sizes ${LAT_BS:-1,64,256} --out "$LOGS/latency_$m.json" > "$LOGS/latency_$m.log" 2>&1
              grep -v Warn "$LOGS/latency_$m.log" | grep -E "batch|^ +[0-9]" | tail -5; done ;;
    offline14b) for kv in auto fp8_e4m3; do OFF_TIMEOUT=${OFF_TIMEOUT:-220} off "14b_$kv" --model benchmark/models/qwen3-14b \
                  --kv-cache-dtype $kv; done ;;
    cudatests) [ -n "${TESTS_SITE:-}" ] && site  # TESTS_SITE=1: the carried wheels too (xgrammar, flashinfer)
      MINISGL_TEST_DEVICE=cuda limited "${TESTS_TIMEOUT:-400}" python3 -m pytest -q ${TESTS:-$CUDA_TESTS} \
        -k "${TESTS_K:-not embedded and not stream_gap and not interpreter}" ${PYTEST_ARGS:-} > "$LOGS/tests_cuda.log" 2>&1
      grep -E "passed|failed|error|FAILED|ERROR" "$LOGS/tests_cuda.log" | tail -25 ;;
    latency) for kv in ${LAT_KV:-auto}; do limited 240 python3 benchmark/latency.py --model $MODEL --dummy-weights --dtype bfloat16 \
               --batch-sizes ${LAT_BS:-1,8,16,32,64,128,192,256} --kv-cache-dtype $kv --out "$LOGS/latency_$kv.json" \
               > "$LOGS/latency_$kv.log" 2>&1; grep -v Warn "$LOGS/latency_$kv.log" | tail -14; done ;;
    long) limited 240 python3 benchmark/long_context.py --model $MODEL --dummy-weights --attention-backend triton --kernels \
            --out "$LOGS/long_context_triton.json" > "$LOGS/long.log" 2>&1; grep -v Warn "$LOGS/long.log" | tail -20 ;;
    fitests) site; MINISGL_TEST_DEVICE=cuda limited "${FITESTS_TIMEOUT:-300}" python3 -m pytest -q -s tests/test_flashinfer_cuda.py \
               -k "${FITESTS_K:-not fp8}" > "$LOGS/tests_fi.log" 2>&1; grep -v Warn "$LOGS/tests_fi.log" | tail -15 ;;
    flashinfer) site; for r in $(reps); do off "fi_ps16_$r" --model $MODEL --attention-backend flashinfer --page-size 16
                  off "triton_ps16_$r" --model $MODEL --attention-backend triton --page-size 16; done ;;
    trace) for b in ${TRACE_BACKENDS:-triton}; do [ "$b" = flashinfer ] && site
             off "trace_$b" --model $MODEL --attention-backend "$b" --trace; grep -A24 "device timeline" "$LOGS/off_trace_$b.log"; done ;;
    sweep) limited 300 python3 tools/kv_fp8_sweep.py ${SWEEP_ARGS:-} --out "$LOGS/sweep.json" > "$LOGS/sweep.log" 2>&1
           grep -v Warn "$LOGS/sweep.log" | tail -30; cp "$LOGS/sweep.json" "$FINAL_OUT/" 2>/dev/null ;;
    gemv) limited 240 python3 tools/gemv_tune.py --out "$LOGS" --budget-s "${GEMV_BUDGET:-150}" ${GEMV_ARGS:---lm-head} \
            > "$LOGS/gemv.log" 2>&1; grep -v Warn "$LOGS/gemv.log" | tail -30 ;;
    stepprof) limited 120 python3 tools/step_profile.py --batch-sizes "${STEP_BS:-1,64}" --out "$LOGS" > "$LOGS/stepprof.log" 2>&1
              grep -v Warn "$LOGS/stepprof.log" | tail -40 ;;
    moetune) limited 240 python3 tools/tune_moe.py > "$LOGS/moetune.log" 2>&1; grep -v Warn "$LOGS/moetune.log" | tail -30 ;;
    serve) site; off serve_offline --model $MODEL  # the number the server is compared with, same call
      # server A: token ids only; the recipe's 256 requests as streams, all at once, then Poisson arrivals
      if start_server server_ids --skip-tokenizer-init; then
        bench serve --workload random-ids --num-requests 256 --max-input 1024 --max-output 1024 \
          --request-rates "inf,${RATES:-30,60}" --max-concurrency 256; stop_server; fi
      # server B: a tokenizer (a dummy model's text is noise anyway), the chat mix without max_tokens
      if start_server server_chat --tokenizer "$(ls -d .whl-serve/smollm2-tokenizer .whl/smollm2-tokenizer 2>/dev/null | head -1)"; then
        bench chat_nomax --workload chat --num-requests 256 --max-input 1024 --max-output 1024 --chat-max-tokens none \
          --request-rates inf; stop_server; fi ;;
    jitsave) du -sh /tmp/fiws /tmp/tvmffi 2>/dev/null; tar czf /tmp/fijit.tgz -C / tmp/fiws tmp/tvmffi 2>/dev/null
             [ "$(stat -c %s /tmp/fijit.tgz)" -lt 15000000 ] && cp /tmp/fijit.tgz "$FINAL_OUT"/ ;;
    jitload) # after site: the builds must be newer than the headers pip just wrote, or ninja rebuilds them
             site; tar xzf .fijit/fijit.tgz -C / && find /tmp/fiws $(ls -d /tmp/tvmffi 2>/dev/null) -exec touch {} + && du -sh /tmp/fiws ;;
    *) echo "unknown part $part (see the top of tools/h200.sh)" ;;
  esac
done
echo "=== done $(date +%T) t=$(( $(date +%s) - T0 ))s"
cp "$LOGS/offline.tsv" "$FINAL_OUT/" 2>/dev/null
tar czf "$FINAL_OUT/logs.tgz" -C "$LOGS" . 2>/dev/null
