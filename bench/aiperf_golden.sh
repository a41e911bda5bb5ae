#!/usr/bin/env bash
# AIPerf (PyPI `aiperf`) against /v1/completions of the tiny golden stack: what `make bench-http` runs.
#
# 1. builds a Hugging Face tokenizer from the golden SentencePiece file, offline (scripts/hf_tokenizer.py),
#    so AIPerf counts prompt tokens exactly as the tokenizer service does;
# 2. starts tokenizer, model (golden checkpoint, float32) and gateway with scripts/run_stack.py;
# 3. runs `aiperf profile` (streaming completions, fixed concurrency, synthetic prompts);
# 4. stops the stack (SIGINT: all three drain and exit).
# AIPerf's own artifacts (profile_export_aiperf.json / .csv, logs) land in $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."

GOLDEN=${GOLDEN:-../shared/golden}
OUT=${OUT:-bench/results/aiperf_golden}
AIPERF_VENV=${AIPERF_VENV:-.venv-aiperf}
TOKENIZER_DIR=${TOKENIZER_DIR:-artifacts/hf-tokenizer-golden}
CONCURRENCY=${CONCURRENCY:-4}
REQUESTS=${REQUESTS:-64}
INPUT_TOKENS=${INPUT_TOKENS:-32}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-32}
BASE=${BASE_PORT:-18050}
HTTP_PORT=$((BASE + 3))

"$AIPERF_VENV/bin/python" scripts/hf_tokenizer.py --model "$GOLDEN/tokenizer.model" --out "$TOKENIZER_DIR"

log=$(mktemp)
.venv/bin/python scripts/run_stack.py --config "$GOLDEN/config.json" --checkpoint "$GOLDEN/checkpoint" \
  --tokenizer "$GOLDEN/tokenizer.model" --slots "$CONCURRENCY" --gateway-port "$BASE" \
  --tokenizer-port $((BASE + 1)) --model-port $((BASE + 2)) --http-port "$HTTP_PORT" \
  --metrics-port 0 --model-metrics-port 0 --max-tokens 4 --log-level warning >"$log" 2>&1 &
stack=$!
trap 'kill -INT $stack 2>/dev/null; wait $stack 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 600); do
  grep -q "Ctrl-C stops all three" "$log" && break
  kill -0 $stack 2>/dev/null || { cat "$log"; exit 1; }
  sleep 1
done
grep -q "Ctrl-C stops all three" "$log" || { echo "stack not serving"; cat "$log"; exit 1; }

rm -rf "$OUT" && mkdir -p "$OUT"
"$AIPERF_VENV/bin/aiperf" profile \
  --model grok-1 --url "http://127.0.0.1:$HTTP_PORT" --endpoint-type completions --streaming \
  --tokenizer "$TOKENIZER_DIR" --use-server-token-count \
  --concurrency "$CONCURRENCY" --request-count "$REQUESTS" --warmup-request-count 4 \
  --synthetic-input-tokens-mean "$INPUT_TOKENS" --synthetic-input-tokens-stddev 0 \
  --output-tokens-mean "$OUTPUT_TOKENS" --output-tokens-stddev 0 \
  --extra-inputs ignore_eos:true --random-seed 7 \
  --artifact-dir "$OUT" 2>&1 | tee "$OUT/console.txt"
