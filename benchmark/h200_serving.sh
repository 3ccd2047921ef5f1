#!/usr/bin/env bash
# Online serving on the H200 (device tool), issue 13: the offline figure, then the same recipe
# through the HTTP server, then a chat mix without max_tokens. Logs and JSON land in $OUT.
#
#   bash benchmark/h200_serving.sh            # carry: .whl .whl-serve
#
# 1. installs the carried wheels (.whl: pydantic, xgrammar, ...; .whl-serve: fastapi, uvicorn,
#    pyzmq, msgpack, prometheus-client, uvloop, httptools, ...) into /tmp/site;
# 2. offline: benchmark/offline.py, 256 requests, inputs/outputs up to 1024 (random ids, EOS
#    ignored) on dummy-weight Qwen3-0.6B, bf16: the number to compare the server with;
# 3. server A: `python -m minisgl --load-format dummy --skip-tokenizer-init` on the same model;
#    benchmark/serving.py --workload random-ids (the same 256 requests as streams) all at once
#    (rate inf, max concurrency 256), then at Poisson 30 and 60 req/s: serve.json, serve.png
#    (every run: output_tokens 133,966 as offline, usage_mismatches 0);
# 4. server B: the same model with --tokenizer (the SmolLM2 tokenizer carried in
#    .whl-serve/smollm2-tokenizer: a dummy model's text is noise anyway), the ShareGPT-shaped chat
#    mix without max_tokens: each request runs until EOS or the context (--max-seq-len), so the
#    scheduler admits requests whose length it does not know; max running from /metrics:
#    chat_nomax.json, chat_nomax.png. Server logs: server_ids.log, server_chat.log.
# Every knob is an environment variable, so the same script runs on the CPU with a tiny model:
#   MODEL=/tmp/tiny N=16 MAX_INPUT=120 MAX_OUTPUT=120 CHAT_N=8 MAX_SEQ_LEN=512 RATES=inf,4 \
#     OUT=/tmp/o bash benchmark/h200_serving.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
MODEL=${MODEL:-benchmark/models/qwen3-0.6b}
TOKENIZER=${TOKENIZER:-.whl-serve/smollm2-tokenizer}
PORT=${PORT:-30000}
N=${N:-256}; MAX_INPUT=${MAX_INPUT:-1024}; MAX_OUTPUT=${MAX_OUTPUT:-1024}
RATES=${RATES:-30,60}
CHAT_N=${CHAT_N:-256}
MAX_SEQ_LEN=${MAX_SEQ_LEN:-2560}   # recipe: 1024 + 1024 fits; the chat mix runs up to it
PARTS=${PARTS:-offline serve chat}
SERVER_FLAGS=${SERVER_FLAGS:-}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

if ls .whl/*.whl .whl-serve/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl .whl-serve/*.whl 2>&1 | grep -v "^WARNING" | tail -3
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
{ echo "date $(date -u +%FT%TZ)"; nproc; uptime; python3 -c "import torch, fastapi, uvicorn; print('torch', torch.__version__, 'fastapi', fastapi.__version__, 'uvicorn', uvicorn.__version__)"
  python3 -c "import uvloop, httptools; print('uvloop', uvloop.__version__, 'httptools', httptools.__version__)" 2>&1 | tail -1
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>/dev/null; } | tee "$OUT/env.txt"

get() {  # $1: path; prints the body (python, not curl: the device image may lack it)
  python3 -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:$PORT$1', timeout=5).read().decode())"
}

SERVER_PID=""
stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID"; for _ in $(seq 40); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$SERVER_PID" 2>/dev/null
  fi
  SERVER_PID=""
}
trap stop_server EXIT

start_server() {  # $1: log name, rest: flags
  local log=$1; shift
  python3 -m minisgl --model "$MODEL" --load-format dummy --port "$PORT" --max-seq-len "$MAX_SEQ_LEN" $SERVER_FLAGS "$@" \
    > "$OUT/$log" 2>&1 &
  SERVER_PID=$!
  local t0=$SECONDS
  for _ in $(seq 480); do
    if get /health >/dev/null 2>&1; then echo "server up after $((SECONDS - t0)) s"; return 0; fi
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "server died:"; tail -30 "$OUT/$log"; return 1; }
    sleep 0.5
  done
  echo "server not ready"; tail -30 "$OUT/$log"; return 1
}

bench() {  # $1: name, rest: serving.py flags
  local name=$1; shift
  timeout 240 python3 benchmark/serving.py --base-url "http://127.0.0.1:$PORT" --output "$OUT/$name.json" \
    --plot "$OUT/$name.png" "$@" 2>&1 | tee "$OUT/$name.log"
  get /metrics > "$OUT/$name.metrics.txt"
}

for part in $PARTS; do
  echo "=== $part $(date +%T)"
  case $part in
    offline)
      timeout 150 python3 benchmark/offline.py --num-requests "$N" --max-input "$MAX_INPUT" --max-output "$MAX_OUTPUT" \
        --model "$MODEL" --dummy-weights --peer none 2>&1 | grep -v Warn | tee "$OUT/offline.log" | tail -3 ;;
    serve)
      start_server server_ids.log --skip-tokenizer-init || continue
      recipe=(--workload random-ids --num-requests "$N" --max-input "$MAX_INPUT" --max-output "$MAX_OUTPUT")
      get /server_info > "$OUT/server_info_ids.json"
      # inf with max concurrency N: all N at once, as offline; then Poisson arrivals
      bench serve "${recipe[@]}" --request-rates "inf,$RATES" --max-concurrency "$N"
      stop_server ;;
    chat)
      start_server server_chat.log --tokenizer "$TOKENIZER" || continue
      bench chat_nomax --workload chat --num-requests "$CHAT_N" --max-input "$MAX_INPUT" --max-output "$MAX_OUTPUT" \
        --chat-max-tokens none --request-rates inf
      stop_server ;;
  esac
done
echo "=== done $(date +%T) ($SECONDS s)"
