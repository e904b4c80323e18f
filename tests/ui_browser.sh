#!/usr/bin/env bash
# The web page of `laplace serve` in a real browser: starts the server (with an API key and a
# session directory) on a small model, then tests/ui_browser.mjs drives headless Chromium
# against it. Builds the model directory the way tests/server_clients.sh does (a 400-piece
# tokenizer, laplace-tiny's shapes with V = 400, random weights).
# Usage: tests/ui_browser.sh LAPLACE_BINARY
#   LAPLACE_UI_SCREENSHOTS=docs/img tests/ui_browser.sh build/laplace   # also writes the screenshots
set -euo pipefail
LAPLACE=${1:?usage: ui_browser.sh LAPLACE_BINARY}
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=$(mktemp -d)
SERVER_PID=
cleanup() {
  if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

CHROMIUM=${CHROMIUM:-$(command -v chromium || true)}
[ -n "$CHROMIUM" ] || fail "chromium is not installed (scripts/setup.sh installs Debian's chromium)"
command -v node > /dev/null || fail "node is not installed (apt-get install nodejs)"
if [ -n "${LAPLACE_UI_SCREENSHOTS:-}" ]; then LAPLACE_UI_SCREENSHOTS=$(cd "$LAPLACE_UI_SCREENSHOTS" && pwd); fi

for i in $(seq 1 300); do
  echo "the quick brown fox $i jumps over the lazy dog; a fortune a day keeps the doctor away."
  echo "Why did the programmer quit? Because he did not get arrays. The meaning of life is $((i % 7))."
done > "$WORK/corpus.txt"
"$LAPLACE" tokenizer train --input "$WORK/corpus.txt" --model-prefix "$WORK/tok" --vocab-size 400 > /dev/null
# laplace-tiny's shapes with the tokenizer's vocabulary: every token the model picks is a
# piece with text, so streamed text shows up at once.
sed 's/"vocab_size": [0-9]*/"vocab_size": 400/' "$HERE/../configs/laplace-tiny.json" > "$WORK/config.json"
"$LAPLACE" init --config "$WORK/config.json" --out "$WORK/model" --seed 5 > /dev/null
cp "$WORK/tok.model" "$WORK/model/tokenizer.model"
KEY=ui-test-key

"$LAPLACE" serve --model "$WORK/model" --name tiny --port 0 --max-slots 4 --api-key "$KEY" \
  --session-dir "$WORK/sessions" --max-tokens 100000 > "$WORK/server.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 1 200); do
  grep -q "ready" "$WORK/server.log" 2>/dev/null && break
  kill -0 "$SERVER_PID" 2>/dev/null || { cat "$WORK/server.log"; fail "server exited"; }
  sleep 0.1
done
PORT=$(sed -n 's/.*listening on http:\/\/127.0.0.1:\([0-9]*\).*/\1/p' "$WORK/server.log")
[ -n "$PORT" ] || { cat "$WORK/server.log"; fail "no port"; }
echo "server on http://127.0.0.1:$PORT"

LAPLACE_URL="http://127.0.0.1:$PORT" LAPLACE_API_KEY=$KEY CHROMIUM=$CHROMIUM \
  LAPLACE_UI_SCREENSHOTS=${LAPLACE_UI_SCREENSHOTS:-} node "$HERE/ui_browser.mjs" || {
  echo "--- server log (last lines)"; tail -20 "$WORK/server.log"; fail "the browser test failed"; }
