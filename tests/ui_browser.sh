#!/usr/bin/env bash
# The web page of `laplace serve` in a real browser: starts the server (with an API key and a
# session directory) on a small model, then tests/ui_browser.mjs drives headless Chromium
# against it, on tests/serve_fixture.sh's model directory (laplace-tiny's shapes with V = 400).
# Usage: tests/ui_browser.sh LAPLACE_BINARY
#   LAPLACE_UI_SCREENSHOTS=docs/img tests/ui_browser.sh build/laplace   # also writes the screenshots
set -euo pipefail
LAPLACE=${1:?usage: ui_browser.sh LAPLACE_BINARY}
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/serve_fixture.sh
. "$HERE/serve_fixture.sh"

CHROMIUM=${CHROMIUM:-$(command -v chromium || true)}
[ -n "$CHROMIUM" ] || fail "chromium is not installed (scripts/setup.sh installs Debian's chromium)"
command -v node > /dev/null || fail "node is not installed (apt-get install nodejs)"
if [ -n "${LAPLACE_UI_SCREENSHOTS:-}" ]; then LAPLACE_UI_SCREENSHOTS=$(cd "$LAPLACE_UI_SCREENSHOTS" && pwd); fi

# laplace-tiny's shapes with the tokenizer's vocabulary: every token the model picks is a
# piece with text, so streamed text shows up at once.
VOCAB=400 make_model_dir
KEY=ui-test-key
start_server --name tiny --max-slots 4 --api-key "$KEY" --session-dir "$WORK/sessions" --max-tokens 100000
echo "server on http://127.0.0.1:$PORT"

LAPLACE_URL="http://127.0.0.1:$PORT" LAPLACE_API_KEY=$KEY CHROMIUM=$CHROMIUM \
  LAPLACE_UI_SCREENSHOTS=${LAPLACE_UI_SCREENSHOTS:-} node "$HERE/ui_browser.mjs" || {
  echo "--- server log (last lines)"; tail -20 "$WORK/server.log"; fail "the browser test failed"; }
