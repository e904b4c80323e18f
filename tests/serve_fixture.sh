# Sourced by the shell tests that drive a real `laplace serve` (server_clients.sh,
# ui_browser.sh): a work directory removed on exit with the server stopped, a small model
# directory, and starting the server until it says it is ready. Needs LAPLACE (the binary)
# and HERE (tests/) set by the caller.
WORK=$(mktemp -d)
SERVER_PID=
cleanup() {
  if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# $WORK/model: a 400-piece tokenizer trained on a repetitive text and laplace-tiny's shapes,
# random weights (seed 5). With VOCAB=400 the model's vocabulary is the tokenizer's, so every
# token it picks is a piece with text; without, laplace-tiny's own vocabulary.
make_model_dir() {
  for i in $(seq 1 300); do
    echo "the quick brown fox $i jumps over the lazy dog; a fortune a day keeps the doctor away."
    echo "Why did the programmer quit? Because he did not get arrays. The meaning of life is $((i % 7))."
  done > "$WORK/corpus.txt"
  "$LAPLACE" tokenizer train --input "$WORK/corpus.txt" --model-prefix "$WORK/tok" --vocab-size 400 > /dev/null
  local cfg="$HERE/../configs/laplace-tiny.json"
  if [ -n "${VOCAB:-}" ]; then
    sed "s/\"vocab_size\": [0-9]*/\"vocab_size\": $VOCAB/" "$cfg" > "$WORK/config.json"
    cfg="$WORK/config.json"
  fi
  "$LAPLACE" init --config "$cfg" --out "$WORK/model" --seed 5 > /dev/null
  cp "$WORK/tok.model" "$WORK/model/tokenizer.model"
}

# start_server ARGS...: `laplace serve --model $WORK/model --port 0 ARGS` in the background,
# its output in $SERVER_LOG (default $WORK/server.log); waits (20 s at most) until it is ready
# and sets PORT.
start_server() {
  local log=${SERVER_LOG:-$WORK/server.log}
  "$LAPLACE" serve --model "$WORK/model" --port 0 "$@" > "$log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 200); do
    grep -q "ready" "$log" 2>/dev/null && break
    kill -0 "$SERVER_PID" 2>/dev/null || { cat "$log"; fail "server exited"; }
    sleep 0.1
  done
  PORT=$(sed -n 's/.*listening on http:\/\/127.0.0.1:\([0-9]*\).*/\1/p' "$log")
  [ -n "$PORT" ] || { cat "$log"; fail "no port"; }
}
