#!/usr/bin/env bash
# Real clients against `laplace serve` on 127.0.0.1: curl (streaming and not) and the
# official `openai` npm package (tests/openai_client, node --test). Builds a small model
# directory (a 400-piece tokenizer and laplace-tiny's shapes, random weights) first.
# Usage: tests/server_clients.sh LAPLACE_BINARY
set -euo pipefail
LAPLACE=${1:?usage: server_clients.sh LAPLACE_BINARY}
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/serve_fixture.sh
. "$HERE/serve_fixture.sh"
make_model_dir
KEY=test-key-123
start_server --name tiny --max-slots 4 --api-key "$KEY"
URL="http://127.0.0.1:$PORT"
AUTH=(-H "Authorization: Bearer $KEY")
echo "server on $URL"

passed=0
check() { passed=$((passed + 1)); echo "ok $passed - $1"; }

# --- curl ---
code=$(curl -s -o /dev/null -w '%{http_code}' "$URL/v1/models")
[ "$code" = 401 ] || fail "no key: got $code, want 401"; check "curl: missing key is 401"
body=$(curl -sf "${AUTH[@]}" "$URL/v1/models")
echo "$body" | grep -q '"id":"tiny"' || fail "models: $body"; check "curl: /v1/models"
body=$(curl -sf "${AUTH[@]}" "$URL/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model":"tiny","prompt":"The quick","max_tokens":8,"temperature":0}')
echo "$body" | grep -q '"completion_tokens":8' || fail "completion: $body"; check "curl: completion"
text=$(echo "$body" | /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["text"], end="")')
streamed=$(curl -sfN "${AUTH[@]}" "$URL/v1/completions" -H 'Content-Type: application/json' -d '{"model":"tiny","prompt":"The quick","max_tokens":8,"temperature":0,"stream":true}' |
  /usr/bin/python3 -c '
import json, sys
out = ""
done = False
for line in sys.stdin:
    line = line.strip()
    if not line.startswith("data: "): continue
    if line == "data: [DONE]": done = True; continue
    for c in json.loads(line[6:])["choices"]: out += c["text"]
assert done, "no [DONE]"
print(out, end="")')
[ "$streamed" = "$text" ] || fail "streamed '$streamed' != '$text'"; check "curl: streaming equals non-streaming"
code=$(curl -s -o "$WORK/err.json" -w '%{http_code}' "${AUTH[@]}" "$URL/v1/completions" -H 'Content-Type: application/json' -d '{"prompt": 5}')
[ "$code" = 400 ] && grep -q '"param":"prompt"' "$WORK/err.json" || fail "bad prompt: $code $(cat "$WORK/err.json")"
check "curl: wrong prompt type is 400 with param"
# Safe on localhost: a body that is not declared JSON (curl -d alone sends a form's type, as a
# cross-site page can) is 415, and a host name the server does not answer to is 403.
code=$(curl -s -o /dev/null -w '%{http_code}' "${AUTH[@]}" "$URL/v1/completions" -d '{"prompt":"a","max_tokens":1}')
[ "$code" = 415 ] || fail "form-typed body: got $code, want 415"
code=$(curl -s -o /dev/null -w '%{http_code}' "${AUTH[@]}" -H 'Host: rebound.example' "$URL/v1/models")
[ "$code" = 403 ] || fail "rebound host: got $code, want 403"
code=$(curl -s -o /dev/null -w '%{http_code}' "${AUTH[@]}" "http://localhost:$PORT/v1/models")
[ "$code" = 200 ] || fail "localhost: got $code, want 200"
check "curl: a form-typed body is 415, another host name 403, localhost 200"
metrics=$(curl -sf "${AUTH[@]}" "$URL/metrics")
grep -q '^laplace_time_to_first_token_seconds_count [1-9]' <<< "$metrics" || fail "metrics: $metrics"
check "curl: /metrics in Prometheus format"
# The streamed request repeated the first one's prompt: a hit in the state cache's device
# tier (spare pool slots; on the CPU they are host memory like the rest of the pool).
grep -q 'laplace serve: state cache: device tier 4 slots' "$WORK/server.log" || fail "no device tier: $(cat "$WORK/server.log")"
grep -q '^laplace_cache_device_hits_total [1-9]' <<< "$metrics" || fail "no device-tier hit: $metrics"
grep -q '^laplace_cache_device_slots 4$' <<< "$metrics" || fail "device slots: $metrics"
check "curl: a repeated prompt is a device-tier cache hit (/metrics)"

# --- the official openai package ---
if ! command -v node > /dev/null; then fail "node is not installed (apt-get install nodejs)"; fi
if [ ! -d "$HERE/openai_client/node_modules/openai" ]; then
  fail "tests/openai_client/node_modules is missing: run scripts/setup.sh (npm ci there)"
fi
LAPLACE_URL=$URL LAPLACE_MODEL=tiny LAPLACE_API_KEY=$KEY node --test "$HERE/openai_client/test.mjs"

# --- SIGTERM: a graceful stop ends a running stream with an error event and [DONE], exit 0 ---
kill "$SERVER_PID"; wait "$SERVER_PID" || fail "the first server did not exit 0 on SIGTERM"
SERVER_PID=
SERVER_LOG=$WORK/server2.log start_server --name tiny --max-slots 2 --max-tokens 1000000 --grace-seconds 0.5
curl -sN "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
  -d '{"prompt":"The quick","max_tokens":900000,"ignore_eos":true,"stream":true}' > "$WORK/stream.txt" &
CURL_PID=$!
for _ in $(seq 1 200); do [ -s "$WORK/stream.txt" ] && break; sleep 0.05; done
[ -s "$WORK/stream.txt" ] || fail "the stream did not start"
kill -TERM "$SERVER_PID"
status=0; wait "$SERVER_PID" || status=$?
SERVER_PID=
wait "$CURL_PID" || true
[ "$status" = 0 ] || fail "laplace serve exited $status on SIGTERM: $(tail -3 "$WORK/server2.log")"
tail -c 400 "$WORK/stream.txt" | grep -q '"code":"server_shutdown"' || fail "no error event: $(tail -c 300 "$WORK/stream.txt")"
[ "$(tail -n 2 "$WORK/stream.txt" | head -n 1)" = "data: [DONE]" ] || fail "no [DONE] at the end: $(tail -c 200 "$WORK/stream.txt")"
check "SIGTERM: the stream ends with an error event and [DONE]; exit 0"
echo "$passed passed, 0 failed"
