#!/usr/bin/env bash
# A fleet of `laplace serve` replicas of one model behind HAProxy (deploy/haproxy.cfg.in), on
# this machine.
#
#   scripts/serve_fleet.sh start [N] --model DIR [--model DIR2 ...] [--port P] [--host ADDR]
#                          [--stats-port P] [--dir RUNDIR] [--session-dir DIR] [--gpus | --cpu]
#                          [--ready-timeout S] [-- EXTRA laplace serve ARGS]
#   scripts/serve_fleet.sh stop   [--dir RUNDIR] [--timeout S]
#   scripts/serve_fleet.sh status [--dir RUNDIR]
#   scripts/serve_fleet.sh render --server ID=HOST:PORT [--server ...] [--hash HEX] [--port P]
#                          [--host ADDR] [--stats-port P] > haproxy.cfg
#
# start   N replicas (`laplace serve --host 127.0.0.1 --port 0 --replica-id rK --session-dir
#         RUNDIR/sessions EXTRA`, K = 0..N-1, each in its own session, logs in RUNDIR/rK.log);
#         waits until each answers GET /health with 200; reads the `model_hash` of each and
#         REFUSES to go on (exit 1, everything it started stopped) unless all are the same —
#         a fleet never mixes models; renders deploy/haproxy.cfg.in with that hash and the
#         replicas into RUNDIR/haproxy.cfg, checks it (haproxy -c), starts haproxy (-db, in the
#         background, its log in RUNDIR/haproxy.log), waits until HAProxy sees every replica up,
#         and prints the front door's URL (also in RUNDIR/fleet.env as FRONT_URL).
#           N              replicas (required on the CPU; on GPUs, default one per GPU).
#           --model DIR    the model directory; given several times (copies of one model, e.g.
#                          on different disks), replica K takes the (K mod count)-th. Copies
#                          must be the same model: start checks.
#           --port P       the front door's port (default 8000; 0 = a free one).
#           --host ADDR    the front door's address (default 127.0.0.1; replicas are always on
#                          127.0.0.1, reachable only through HAProxy).
#           --stats-port P HAProxy's /stats and /metrics (Prometheus) on 127.0.0.1 (0 = free,
#                          the default).
#           --dir RUNDIR   where pids, logs, the config and the sessions go (default ./fleet).
#           --session-dir  the replicas' shared --session-dir (default RUNDIR/sessions).
#           --gpus         one replica per GPU: replica K runs with CUDA_VISIBLE_DEVICES=<K-th
#                          GPU> and --device cuda. The GPUs are CUDA_VISIBLE_DEVICES's list when
#                          set, else nvidia-smi's. A non-empty CUDA_VISIBLE_DEVICES implies
#                          --gpus; --cpu ignores it.
#           --ready-timeout S  seconds each replica may take to load (default 300).
#           -- ARGS        passed to every replica (e.g. --name tiny --max-slots 16
#                          --api-key-file key.txt --grace-seconds 30). /health needs no key,
#                          so neither HAProxy's checks nor this script need it.
# stop    SIGUSR1 to haproxy (a soft stop: it stops accepting, and exits once its open
#         connections end) and SIGTERM to every replica (each finishes its live requests within
#         its --grace-seconds, then exits 0); waits up to --timeout seconds (default 60), then
#         SIGKILLs what is left, saying so.
# status  each process, each replica's /health, and HAProxy's view of each replica (UP/DOWN).
#         Exit 0: all up; 1: something is down; 3: no fleet runs in RUNDIR.
# render  prints the HAProxy config for replicas that run elsewhere (production: one replica
#         per host or per GPU, under systemd). Without --hash, reads every server's /health
#         and refuses (exit 1) unless they report the same model_hash.
#
# Environment: LAPLACE (the binary; default build/laplace of this checkout), HAPROXY (default
# haproxy from PATH).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
TEMPLATE="$ROOT/deploy/haproxy.cfg.in"
LAPLACE=${LAPLACE:-$ROOT/build/laplace}
HAPROXY=${HAPROXY:-haproxy}

die() { echo "serve_fleet.sh: $*" >&2; exit 1; }
say() { echo "serve_fleet.sh: $*" >&2; }
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//' >&2; exit 2; }

# ---- small helpers ----------------------------------------------------------------------------

# free_port: a port nothing on 127.0.0.1 listens on (a connect to it is refused), below the
# kernel's ephemeral range (where `--port 0` replicas and outgoing connections take theirs).
free_port() {
  local p low=32768 _high
  read -r low _high < /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || true
  [ "$low" -gt 11024 ] || low=60000
  for _ in $(seq 1 200); do
    p=$((10000 + RANDOM % (low - 11000)))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then echo "$p"; return 0; fi
  done
  die "no free port found"
}

# start_time PID: the process's start time (field 22 of /proc/PID/stat), to tell it from a
# later process that got the same pid; fails for a zombie (exited, not yet reaped: our
# processes' parent is whatever adopted them, which may reap late).
start_time() {
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  stat=${stat##*) }  # after "pid (comm) "; comm may hold spaces
  # shellcheck disable=SC2086
  set -- $stat
  [ "$1" != Z ] || return 1
  echo "${20}"
}

# alive PIDFILE: true when the process the pid file names still runs (same pid, same start).
alive() {
  local pid start
  [ -s "$1" ] || return 1
  read -r pid start < "$1" || return 1
  [ -n "$pid" ] && [ "$(start_time "$pid" 2>/dev/null)" = "$start" ]
}
pid_of() { local pid _s; read -r pid _s < "$1"; echo "$pid"; }

# spawn PIDFILE LOG CMD...: CMD in the background, in a session of its own (a Ctrl-C or hangup
# of the shell that ran `start` does not reach it), with "PID STARTTIME" in PIDFILE.
spawn() {
  local pidfile=$1 log=$2
  shift 2
  rm -f "$pidfile"
  # shellcheck disable=SC2016  # expanded by the inner bash
  setsid bash -c 'echo "$$ $(stat=$(cat /proc/$$/stat); stat=${stat##*) }; set -- $stat; echo ${20})" > "$0.tmp" && mv "$0.tmp" "$0"; exec "$@"' \
    "$pidfile" "$@" > "$log" 2>&1 < /dev/null &
  for _ in $(seq 1 100); do [ -s "$pidfile" ] && return 0; sleep 0.05; done
  die "could not start $1 (no pid file)"
}

# http_get URL OUTFILE: prints the status code (000 when nothing answered).
http_get() {
  curl -s -m 5 -o "$2" -w '%{http_code}' "$1" 2>/dev/null || true
}

json_field() {  # json_field KEY FILE: a string field of a flat JSON object
  sed -n "s/.*\"$1\":\"\\([^\"]*\\)\".*/\\1/p" "$2" | head -n 1
}

# render_config OUT HASH FRONT_BIND STATS_BIND SERVER...: deploy/haproxy.cfg.in with its
# placeholders filled (SERVER = ID=HOST:PORT), checked with haproxy -c.
render_config() {
  local out=$1 hash=$2 front=$3 stats=$4
  shift 4
  [ -f "$TEMPLATE" ] || die "no template at $TEMPLATE"
  [[ $hash =~ ^[0-9a-fA-F]+$ ]] || die "model hash '$hash' is not hexadecimal"
  [[ $front =~ :[1-9][0-9]*$ ]] || die "the front door needs a port (not 0): $front"
  local servers="" tracked="" s id addr
  for s in "$@"; do
    id=${s%%=*} addr=${s#*=}
    [[ $id =~ ^[A-Za-z0-9._:-]+$ ]] || die "server name '$id' is not a valid HAProxy server name (letters, digits, . _ : -)"
    servers+="    server $id $addr"$'\n'
    tracked+="    server $id $addr track laplace/$id"$'\n'
  done
  # awk's index/substr, not sub(): the values may hold & and backslashes.
  (umask 077
   FRONT=$front STATS=$stats HASH=$hash SERVERS=${servers%$'\n'} TRACKED=${tracked%$'\n'} awk '
     function put(line, key, val,   i) {
       while ((i = index(line, key)) > 0) line = substr(line, 1, i - 1) val substr(line, i + length(key))
       return line
     }
     /^[ \t]*#/ { print; next }  # comments name the placeholders: left as they are
     $0 == "@SERVERS@" { print ENVIRON["SERVERS"]; next }
     $0 == "@AFFINITY_SERVERS@" { print ENVIRON["TRACKED"]; next }
     {
       line = put($0, "@FRONT_BIND@", ENVIRON["FRONT"]); line = put(line, "@STATS_BIND@", ENVIRON["STATS"])
       line = put(line, "@MODEL_HASH@", ENVIRON["HASH"]); print line
     }' "$TEMPLATE" > "$out")
  local check
  check=$("$HAPROXY" -c -f "$out" 2>&1) || die "haproxy -c rejects $out: $check"
}

# check_hashes WHAT: given REPLICA_IDS, REPLICA_URLS, REPLICA_HASHES, REPLICA_MODELS,
# REPLICA_WHAT (arrays), fails unless every hash is the same, naming each replica and its model.
check_hashes() {
  local i differ=0
  for i in "${!REPLICA_HASHES[@]}"; do
    [ "${REPLICA_HASHES[$i]}" = "${REPLICA_HASHES[0]}" ] || differ=1
  done
  [ $differ = 0 ] && return 0
  {
    echo "serve_fleet.sh: refusing to $1: the replicas serve different models (a fleet serves exactly one):"
    for i in "${!REPLICA_HASHES[@]}"; do
      echo "  ${REPLICA_IDS[$i]} (${REPLICA_URLS[$i]}${REPLICA_WHAT[$i]:+, ${REPLICA_WHAT[$i]}}): model '${REPLICA_MODELS[$i]}', model_hash ${REPLICA_HASHES[$i]}"
    done
    echo "Point every replica at the same model (same files), or run a separate fleet per model."
  } >&2
  return 1
}

# ---- stop ---------------------------------------------------------------------------------------

# stop_fleet RUNDIR TIMEOUT: soft-stops haproxy, SIGTERMs the replicas, waits, SIGKILLs leftovers.
stop_fleet() {
  local dir=$1 timeout=$2 f any=0
  local hap="$dir/haproxy.pid"
  if alive "$hap"; then kill -USR1 "$(pid_of "$hap")" 2>/dev/null || true; any=1; fi
  for f in "$dir"/r*.pid; do
    [ -e "$f" ] || continue
    if alive "$f"; then kill -TERM "$(pid_of "$f")" 2>/dev/null || true; any=1; fi
  done
  local deadline=$((SECONDS + timeout)) left
  while :; do
    left=()
    for f in "$dir"/r*.pid; do [ -e "$f" ] && alive "$f" && left+=("$f"); done
    [ ${#left[@]} = 0 ] && break
    if [ $SECONDS -ge $deadline ]; then
      for f in "${left[@]}"; do
        say "$(basename "$f" .pid) (pid $(pid_of "$f")) still runs after ${timeout} s: SIGKILL"
        kill -KILL "$(pid_of "$f")" 2>/dev/null || true
      done
      sleep 0.2
      break
    fi
    sleep 0.1
  done
  # The replicas are gone, so haproxy's connections to them are too: it exits within moments
  # of its soft stop. If clients still hold idle connections to it, end it.
  for _ in $(seq 1 50); do alive "$hap" || break; sleep 0.1; done
  if alive "$hap"; then kill -TERM "$(pid_of "$hap")" 2>/dev/null || true; sleep 0.2; fi
  if alive "$hap"; then kill -KILL "$(pid_of "$hap")" 2>/dev/null || true; fi
  rm -f "$dir"/r*.pid "$dir/haproxy.pid"
  [ $any = 1 ] && say "stopped the fleet in $dir"
  return 0
}

# ---- start --------------------------------------------------------------------------------------

cmd_start() {
  local n="" models=() port=8000 host=127.0.0.1 stats_port=0 dir=./fleet session_dir="" gpu_mode=auto
  local ready_timeout=300 extra=()
  if [ $# -gt 0 ] && [[ $1 =~ ^[0-9]+$ ]]; then n=$1; shift; fi
  while [ $# -gt 0 ]; do
    case $1 in
      --model) models+=("${2:?--model needs a directory}"); shift ;;
      --port) port=${2:?}; shift ;;
      --host) host=${2:?}; shift ;;
      --stats-port) stats_port=${2:?}; shift ;;
      --dir) dir=${2:?}; shift ;;
      --session-dir) session_dir=${2:?}; shift ;;
      --gpus) gpu_mode=gpus ;;
      --cpu) gpu_mode=cpu ;;
      --ready-timeout) ready_timeout=${2:?}; shift ;;
      --) shift; extra=("$@"); break ;;
      -h|--help) usage ;;
      *) die "start: unknown argument '$1' (laplace serve's own arguments go after --)" ;;
    esac
    shift
  done
  [ ${#models[@]} -gt 0 ] || die "start: --model DIR is required"
  local m
  for m in "${models[@]}"; do [ -d "$m" ] || die "start: no model directory $m"; done
  local a
  for a in "${extra[@]}"; do
    case $a in
      --model|--model=*|--port|--port=*|--host|--host=*|--replica-id|--replica-id=*|--session-dir|--session-dir=*)
        die "start: ${a%%=*} is set by serve_fleet.sh (see its own options)" ;;
    esac
  done
  [ -x "$LAPLACE" ] || die "no laplace binary at $LAPLACE (build it, or set LAPLACE)"
  command -v "$HAPROXY" > /dev/null || die "haproxy is not installed (apt-get install haproxy)"
  command -v curl > /dev/null || die "curl is not installed"

  # GPUs: CUDA_VISIBLE_DEVICES's list, else nvidia-smi's.
  local gpus=()
  if [ $gpu_mode = auto ] && [ -n "${CUDA_VISIBLE_DEVICES:-}" ] && [ "${CUDA_VISIBLE_DEVICES}" != -1 ]; then gpu_mode=gpus; fi
  if [ $gpu_mode = gpus ]; then
    if [ -n "${CUDA_VISIBLE_DEVICES:-}" ] && [ "${CUDA_VISIBLE_DEVICES}" != -1 ]; then
      IFS=, read -r -a gpus <<< "$CUDA_VISIBLE_DEVICES"
    elif command -v nvidia-smi > /dev/null; then
      mapfile -t gpus < <(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null)
    fi
    [ ${#gpus[@]} -gt 0 ] || die "start: --gpus, but no GPU is listed (CUDA_VISIBLE_DEVICES) or found (nvidia-smi)"
    [ -n "$n" ] || n=${#gpus[@]}
    [ "$n" -le ${#gpus[@]} ] || die "start: $n replicas, but only ${#gpus[@]} GPUs (${gpus[*]}): one replica per GPU"
    local has_device=0
    for a in "${extra[@]}"; do case $a in --device|--device=*) has_device=1 ;; esac; done
    [ $has_device = 1 ] || extra+=(--device cuda)
  fi
  [ -n "$n" ] || die "start: say how many replicas (start N --model DIR)"
  [ "$n" -ge 1 ] || die "start: N must be at least 1"

  mkdir -p "$dir"
  chmod 700 "$dir"
  dir=$(cd "$dir" && pwd)
  session_dir=${session_dir:-$dir/sessions}
  mkdir -p "$session_dir"
  local f
  alive "$dir/haproxy.pid" && die "a fleet already runs in $dir (scripts/serve_fleet.sh stop --dir $dir)"
  for f in "$dir"/r*.pid; do
    [ -e "$f" ] && alive "$f" && die "a fleet already runs in $dir (scripts/serve_fleet.sh stop --dir $dir)"
  done
  rm -f "$dir"/r*.pid "$dir"/r*.log "$dir/haproxy.pid" "$dir/fleet.env" "$dir/haproxy.cfg"

  # From here on, anything that fails stops what was started.
  STARTED_DIR=$dir
  trap 'stop_fleet "$STARTED_DIR" 30 > /dev/null 2>&1 || true' EXIT
  trap 'exit 130' INT TERM

  local k env_gpu
  for ((k = 0; k < n; k++)); do
    env_gpu=()
    [ $gpu_mode = gpus ] && env_gpu=("CUDA_VISIBLE_DEVICES=${gpus[$k]}")
    spawn "$dir/r$k.pid" "$dir/r$k.log" env "${env_gpu[@]}" "$LAPLACE" serve \
      --model "${models[$((k % ${#models[@]}))]}" --host 127.0.0.1 --port 0 --replica-id "r$k" \
      --session-dir "$session_dir" "${extra[@]}"
  done

  # Each replica: its port (from "listening on"), then /health 200.
  REPLICA_IDS=() REPLICA_URLS=() REPLICA_HASHES=() REPLICA_MODELS=() REPLICA_WHAT=()
  local ports=() p code body="$dir/.health" deadline what
  for ((k = 0; k < n; k++)); do
    deadline=$((SECONDS + ready_timeout))
    p=
    while :; do
      p=$(sed -n 's/.*listening on http:\/\/127\.0\.0\.1:\([0-9]*\).*/\1/p' "$dir/r$k.log" | head -n 1)
      if [ -n "$p" ]; then
        code=$(http_get "http://127.0.0.1:$p/health" "$body")
        [ "$code" = 200 ] && break
        if [ "$code" = 503 ] && [ "$(json_field status "$body")" = failed ]; then
          die "replica r$k failed to load its model: $(tail -n 5 "$dir/r$k.log")"
        fi
      fi
      alive "$dir/r$k.pid" || die "replica r$k exited while starting; the end of $dir/r$k.log:
$(tail -n 8 "$dir/r$k.log")"
      [ $SECONDS -lt $deadline ] || die "replica r$k was not ready within $ready_timeout s (see $dir/r$k.log)"
      sleep 0.1
    done
    local hash replica model
    hash=$(json_field model_hash "$body") replica=$(json_field replica "$body") model=$(json_field model "$body")
    [ -n "$hash" ] || die "replica r$k's /health has no model_hash ($(cat "$body")): this laplace serve predates fleets"
    [ "$replica" = "r$k" ] || die "the server on port $p answers as replica '$replica', not r$k"
    what="--model ${models[$((k % ${#models[@]}))]}"
    [ $gpu_mode = gpus ] && what+=", GPU ${gpus[$k]}"
    ports+=("$p")
    REPLICA_IDS+=("r$k") REPLICA_URLS+=("http://127.0.0.1:$p") REPLICA_HASHES+=("$hash") REPLICA_MODELS+=("$model") REPLICA_WHAT+=("$what")
    say "r$k ready on http://127.0.0.1:$p (model '$model', model_hash $hash${gpus:+, GPU ${gpus[$k]:-}})"
  done
  rm -f "$body"
  check_hashes start || exit 1

  # Free ports for HAProxy only now that the replicas hold theirs.
  [ "$port" = 0 ] && port=$(free_port)
  [ "$stats_port" = 0 ] && stats_port=$(free_port)
  [ "$stats_port" != "$port" ] || stats_port=$(free_port)
  local servers=()
  for ((k = 0; k < n; k++)); do servers+=("r$k=127.0.0.1:${ports[$k]}"); done
  render_config "$dir/haproxy.cfg" "${REPLICA_HASHES[0]}" "$host:$port" "127.0.0.1:$stats_port" "${servers[@]}"
  spawn "$dir/haproxy.pid" "$dir/haproxy.log" "$HAPROXY" -f "$dir/haproxy.cfg" -db

  # Up when HAProxy's stats list every replica UP (rise 2: about a second after its start).
  local csv="$dir/.stats.csv" up
  deadline=$((SECONDS + 30))
  while :; do
    alive "$dir/haproxy.pid" || die "haproxy exited; the end of $dir/haproxy.log:
$(tail -n 8 "$dir/haproxy.log")"
    code=$(http_get "http://127.0.0.1:$stats_port/stats;csv" "$csv")
    if [ "$code" = 200 ]; then
      up=$(awk -F, '$1 == "laplace" && $2 ~ /^r[0-9]+$/ && $18 == "UP"' "$csv" | wc -l)
      [ "$up" = "$n" ] && break
    fi
    [ $SECONDS -lt $deadline ] || die "HAProxy does not see every replica up within 30 s; $dir/haproxy.log says:
$(tail -n 8 "$dir/haproxy.log")"
    sleep 0.1
  done
  rm -f "$csv"

  local url_host=$host
  [ "$url_host" = 0.0.0.0 ] && url_host=127.0.0.1
  {
    printf 'FRONT_URL=%q\n' "http://$url_host:$port"
    printf 'STATS_URL=%q\n' "http://127.0.0.1:$stats_port/stats"
    printf 'MODEL_HASH=%q\n' "${REPLICA_HASHES[0]}"
    printf 'SESSION_DIR=%q\n' "$session_dir"
    printf 'REPLICAS=%q\n' "${REPLICA_IDS[*]}"
    for ((k = 0; k < n; k++)); do printf 'URL_r%d=%q\n' "$k" "${REPLICA_URLS[$k]}"; done
  } > "$dir/fleet.env"
  trap - EXIT INT TERM
  say "$n replicas of model '${REPLICA_MODELS[0]}' (model_hash ${REPLICA_HASHES[0]}) behind HAProxy; stats on http://127.0.0.1:$stats_port/stats"
  echo "http://$url_host:$port"
}

# ---- status -------------------------------------------------------------------------------------

cmd_status() {
  local dir=./fleet
  while [ $# -gt 0 ]; do
    case $1 in
      --dir) dir=${2:?}; shift ;;
      -h|--help) usage ;;
      *) die "status: unknown argument '$1'" ;;
    esac
    shift
  done
  [ -f "$dir/fleet.env" ] || { echo "no fleet in $dir"; exit 3; }
  # shellcheck disable=SC1091
  . "$dir/fleet.env"
  local ok=0 r f url code body="$dir/.health" state running=0
  alive "$dir/haproxy.pid" && running=1
  for r in $REPLICAS; do alive "$dir/$r.pid" && running=1; done
  [ $running = 1 ] || { echo "no fleet runs in $dir (the last one's logs are there)"; exit 3; }
  echo "front door $FRONT_URL  model_hash $MODEL_HASH  stats $STATS_URL"
  if alive "$dir/haproxy.pid"; then echo "haproxy   pid $(pid_of "$dir/haproxy.pid")  running"; else echo "haproxy   not running"; ok=1; fi
  local csv="$dir/.stats.csv"
  http_get "${STATS_URL};csv" "$csv" > /dev/null
  for r in $REPLICAS; do
    f="$dir/$r.pid"
    url=URL_$r
    url=${!url}
    state=$(awk -F, -v r="$r" '$1 == "laplace" && $2 == r { print $18 " (" $37 ")" }' "$csv" 2>/dev/null || true)
    if alive "$f"; then
      code=$(http_get "$url/health" "$body")
      echo "$r        pid $(pid_of "$f")  $url  /health $code $(cat "$body" 2>/dev/null)  haproxy: ${state:-?}"
    else
      echo "$r        not running  $url  haproxy: ${state:-?}"
    fi
    [[ $state == UP* ]] || ok=1
  done
  rm -f "$body" "$csv"
  exit $ok
}

cmd_stop() {
  local dir=./fleet timeout=60
  while [ $# -gt 0 ]; do
    case $1 in
      --dir) dir=${2:?}; shift ;;
      --timeout) timeout=${2:?}; shift ;;
      -h|--help) usage ;;
      *) die "stop: unknown argument '$1'" ;;
    esac
    shift
  done
  [ -d "$dir" ] || die "stop: no directory $dir"
  stop_fleet "$dir" "$timeout"
}

# ---- render (production) ------------------------------------------------------------------------

cmd_render() {
  local servers=() hash="" port=8000 host=127.0.0.1 stats_port=8404
  while [ $# -gt 0 ]; do
    case $1 in
      --server) servers+=("${2:?--server ID=HOST:PORT}"); shift ;;
      --hash) hash=${2:?}; shift ;;
      --port) port=${2:?}; shift ;;
      --host) host=${2:?}; shift ;;
      --stats-port) stats_port=${2:?}; shift ;;
      -h|--help) usage ;;
      *) die "render: unknown argument '$1'" ;;
    esac
    shift
  done
  [ ${#servers[@]} -gt 0 ] || die "render: at least one --server ID=HOST:PORT"
  if [ -z "$hash" ]; then
    local s body code
    body=$(mktemp)
    REPLICA_IDS=() REPLICA_URLS=() REPLICA_HASHES=() REPLICA_MODELS=() REPLICA_WHAT=()
    for s in "${servers[@]}"; do
      code=$(http_get "http://${s#*=}/health" "$body")
      [ "$code" = 200 ] || { rm -f "$body"; die "render: ${s%%=*} (http://${s#*=}/health) answers $code, not 200"; }
      REPLICA_IDS+=("${s%%=*}") REPLICA_URLS+=("http://${s#*=}") REPLICA_HASHES+=("$(json_field model_hash "$body")")
      REPLICA_MODELS+=("$(json_field model "$body")") REPLICA_WHAT+=("")
      [ -n "${REPLICA_HASHES[-1]}" ] || { rm -f "$body"; die "render: ${s%%=*}'s /health has no model_hash"; }
    done
    rm -f "$body"
    check_hashes "render a config" || exit 1
    hash=${REPLICA_HASHES[0]}
  fi
  local out
  out=$(mktemp)
  render_config "$out" "$hash" "$host:$port" "127.0.0.1:$stats_port" "${servers[@]}"
  cat "$out"
  rm -f "$out"
}

[ $# -gt 0 ] || usage
cmd=$1
shift
case $cmd in
  start) cmd_start "$@" ;;
  stop) cmd_stop "$@" ;;
  status) cmd_status "$@" ;;
  render) cmd_render "$@" ;;
  -h|--help|help) usage ;;
  *) die "unknown command '$cmd' (start, stop, status, render)" ;;
esac
