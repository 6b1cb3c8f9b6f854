#!/usr/bin/env bash
# specserve against llama.cpp's llama-server on the same machine, the same GGUF file (the embedded model) and the
# same prompts, measured by one client (`specserve bench serve`) in one run:
#   llama-server with its defaults, llama-server with its model-free n-gram speculation, then specserve with each
#   config given (default: deploy/configs/default.yaml, what `make serve` runs).
#
#   deploy/bench/vs-llamacpp.sh [CONFIG.yaml ...]
# Env: PROMPTS (JSONL, default deploy/prompts/bench.jsonl), CONCURRENCY (default 1,4,16), MAX_TOKENS (64),
#      OUT (report directory, default bench-llamacpp/), VENV (default .venv), SKIP_LLAMACPP=1 (specserve only).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${VENV:-.venv}"
PROMPTS="${PROMPTS:-deploy/prompts/bench.jsonl}"
CONCURRENCY="${CONCURRENCY:-1,4,16}"
MAX_TOKENS="${MAX_TOKENS:-64}"
OUT="${OUT:-bench-llamacpp}"
CONFIGS=("$@")
[[ ${#CONFIGS[@]} -gt 0 ]] || CONFIGS=(deploy/configs/default.yaml)
mkdir -p "$OUT"
GGUF="$("$VENV/bin/python" -c "from server.model_files import resolve_model; print(resolve_model('embedded', progress=False).gguf)")"
deploy/bench/llamacpp.sh build >/dev/null

pid=""
stop() { [[ -n "$pid" ]] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null; pid=""; }
trap stop EXIT
wait_ready() {  # URL
  for _ in $(seq 600); do curl -sf "$1/health" >/dev/null && return 0; sleep 1; done
  echo "vs-llamacpp: $1 did not come up" >&2; return 1
}
bench() {  # NAME URL (a level with failed requests is reported in the table, not fatal)
  echo "== $1" >&2
  "$VENV/bin/specserve" bench serve --url "$2" --prompts "$PROMPTS" --concurrency "$CONCURRENCY" \
    --max-tokens "$MAX_TOKENS" --json "$OUT/$1.json" | tee "$OUT/$1.txt" || echo "vs-llamacpp: $1 had errors" >&2
}

if [[ -z "${SKIP_LLAMACPP:-}" ]]; then
  deploy/bench/llamacpp.sh serve "$GGUF" 8091 >"$OUT/llama-server.log" 2>&1 & pid=$!
  wait_ready http://127.0.0.1:8091 && bench llama-server http://127.0.0.1:8091; stop
  deploy/bench/llamacpp.sh serve "$GGUF" 8091 --spec-type ngram-mod >"$OUT/llama-server-ngram.log" 2>&1 & pid=$!
  wait_ready http://127.0.0.1:8091 && bench llama-server-ngram http://127.0.0.1:8091; stop
fi
for cfg in "${CONFIGS[@]}"; do
  name="specserve-$(basename "$cfg" .yaml)"
  LD_PRELOAD="$(ls /usr/lib/*/libjemalloc.so.2 2>/dev/null | head -n 1)" \
    "$VENV/bin/specserve" serve --config "$cfg" --port 8092 >"$OUT/$name.log" 2>&1 & pid=$!
  wait_ready http://127.0.0.1:8092 && bench "$name" http://127.0.0.1:8092; stop
done
