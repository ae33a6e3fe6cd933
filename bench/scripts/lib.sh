# shellcheck shell=bash disable=SC2034 # its variables are for the scripts that source it
# The setup the benchmark scripts here share, in small functions. Not run on its own; each
# script sources it:   . "$(dirname "$0")/lib.sh"
# Used by: overhead.sh, tls.sh, ab.sh, two_threads.sh, idle_rss.sh, symbol_order.sh, soak.sh and
# crosscheck/run.sh (each names the results page it feeds). Everything it starts listens on
# 127.0.0.1 only. It sets no shell options: each script keeps its own.

# The repository root (this file is bench/scripts/lib.sh) and the script's name for messages.
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
SCRIPT=$(basename "$0")

die() { echo "$SCRIPT: $*" >&2; exit 1; }

# need_tools HINT TOOL...: exit unless every TOOL is on PATH; HINT (may be "") says how to get
# them.
need_tools() {
  local hint=$1 tool; shift
  for tool in "$@"; do
    command -v "$tool" >/dev/null || die "$tool not found${hint:+ ($hint)}"
  done
}

# --- release binaries --------------------------------------------------------------------------
# cargo's own target directory unless CARGO_TARGET_DIR names another (the fat-LTO release build
# takes minutes: point it at one kept between clones to build once).
DEFAULT_TARGET_DIR=$REPO_ROOT/target

# build_release CARGO-BUILD-ARGS...: `cargo build --release -q` into CARGO_TARGET_DIR, exported.
build_release() {
  export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$DEFAULT_TARGET_DIR}
  cargo build --release -q "$@"
}

# release_bin NAME: the path of a release binary (examples/NAME for an example).
release_bin() { echo "${CARGO_TARGET_DIR:-$DEFAULT_TARGET_DIR}/release/$1"; }

# --- scratch directory, background processes, cleanup ------------------------------------------
NGINX_PIDFILES=()

# start_work NAME: WORK=/tmp/kvroute-NAME.XXXXXX, removed at exit together with everything
# started meanwhile (cleanup).
start_work() {
  WORK=$(mktemp -d "/tmp/kvroute-$1.XXXXXX")
  trap cleanup EXIT
}

# stop_jobs [SIGNAL=TERM]: signals every background job of this shell that still runs.
stop_jobs() {
  local p
  for p in $(jobs -rp); do kill -s "${1:-TERM}" "$p" 2>/dev/null || true; done
}

# cleanup: the EXIT trap of start_work. Stops the background jobs (with CLEANUP_SIGNAL, default
# TERM) and the nginx instances start_nginx started, then removes WORK.
cleanup() {
  local f
  stop_jobs "${CLEANUP_SIGNAL:-TERM}"
  for f in "${NGINX_PIDFILES[@]}"; do
    if [ -f "$f" ]; then kill "$(cat "$f")" 2>/dev/null || true; fi
  done
  sleep 0.3
  rm -rf "$WORK"
}

# spawn CPUS ERR CMD...: runs CMD in the background, pinned to CPUS (taskset -c; "" leaves it
# unpinned), with RUST_LOG=$SPAWN_LOG (default warn) and its stderr in ERR. Sets SPAWNED to its
# pid (taskset and env exec, so it is CMD's).
spawn() {
  local cpus=$1 err=$2; shift 2
  if [ -n "$cpus" ]; then
    RUST_LOG=${SPAWN_LOG:-warn} taskset -c "$cpus" "$@" 2>"$err" &
  else
    RUST_LOG=${SPAWN_LOG:-warn} "$@" 2>"$err" &
  fi
  SPAWNED=$!
}

# --- readiness ---------------------------------------------------------------------------------
# wait_port PORT [TRIES=200]: waits (TRIES x 50 ms) until 127.0.0.1:PORT accepts a connection.
wait_port() {
  local i
  for ((i = 0; i < ${2:-200}; i++)); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.05
  done
  echo "port $1 never opened" >&2
  return 1
}

# wait_http TRIES URL...: waits (TRIES x 100 ms) until every URL answers 2xx.
wait_http() {
  local tries=$1 i url ok; shift
  for ((i = 0; i < tries; i++)); do
    ok=1
    for url in "$@"; do curl -sf "$url" >/dev/null || { ok=0; break; }; done
    [ "$ok" = 1 ] && return 0
    sleep 0.1
  done
  return 1
}

# --- the proxy benchmarks' layout --------------------------------------------------------------
# The proxy under test runs on CPU 1; the load generator and the backend share CPU 0, so every
# rate is per proxy core.
PROXY_CPU=1
LOAD_CPU=0

# The answer of the instant backend: a whole chat completion, at once.
CHAT_JSON='{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"completion_tokens":1,"total_tokens":11}}'

# nginx_conf NAME SERVER...: writes $WORK/NAME.conf, one nginx worker (pid file and error log in
# WORK, no access log, kept-alive connections) serving the SERVER blocks.
nginx_conf() {
  local name=$1; shift
  {
    cat <<CONF
worker_processes 1;
pid $WORK/$name.pid;
error_log $WORK/$name.err warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_max_body_size 10m;
  client_body_buffer_size 1m;
  keepalive_requests 1000000;
CONF
    printf '%s\n' "$@"
    echo "}"
  } > "$WORK/$name.conf"
}

# chat_backend PORT: a server block answering every request at 127.0.0.1:PORT with CHAT_JSON.
chat_backend() {
  echo "  server { listen 127.0.0.1:$1; location / { default_type application/json; return 200 '$CHAT_JSON'; } }"
}

# nginx_proxy LISTEN PORT [LINE...]: a server block listening at LISTEN (an nginx `listen`
# value) that proxies to 127.0.0.1:PORT over kept-alive HTTP/1.1, reading the request body
# first and streaming the response; each LINE goes into the server block.
nginx_proxy() {
  local listen=$1 port=$2; shift 2
  echo "  upstream fleet { server 127.0.0.1:$port; keepalive 64; }"
  echo "  server {"
  echo "    listen $listen;"
  if [ $# -gt 0 ]; then printf '    %s\n' "$@"; fi
  cat <<'CONF'
    location / {
      proxy_pass http://fleet;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering on;
    }
  }
CONF
}

# start_nginx CPUS NAME: starts nginx with $WORK/NAME.conf pinned to CPUS (it daemonises);
# cleanup stops it.
start_nginx() {
  NGINX_PIDFILES+=("$WORK/$2.pid")
  taskset -c "$1" nginx -c "$WORK/$2.conf" -p "$WORK"
}

stop_nginx() { kill "$(cat "$WORK/$1.pid")"; }

# nginx_pids NAME: the pids of nginx NAME's master and workers (workers do not carry the config
# path in their command line: they are the master's children).
nginx_pids() {
  local master; master=$(cat "$WORK/$1.pid")
  echo "$master $(pgrep -P "$master" | tr '\n' ' ')"
}

# --- proxy configurations ----------------------------------------------------------------------
# pingora_yaml NAME THREADS: Pingora's server keys as every proxy here runs them: THREADS worker
# threads, pid file and upgrade socket $WORK/NAME.*, no grace period, 1 s to shut down.
pingora_yaml() {
  printf 'version: 1\nthreads: %s\npid_file: %s/%s.pid\nupgrade_sock: %s/%s.sock\n' "$2" "$WORK" "$1" "$WORK" "$1"
  printf 'grace_period_seconds: 0\ngraceful_shutdown_timeout_seconds: 1\n'
}

# kvroute_yaml LISTEN-PORT ADMIN-PORT BACKEND...: the `kvroute:` section, listening on
# 127.0.0.1; a BACKEND is a port on 127.0.0.1, or PORT=SNI for one reached over TLS as SNI.
# More `kvroute:` keys can follow it, indented by two spaces.
kvroute_yaml() {
  local b
  printf 'kvroute:\n  listen: "127.0.0.1:%s"\n  admin_listen: "127.0.0.1:%s"\n  backends:\n' "$1" "$2"
  shift 2
  for b in "$@"; do
    printf '    - addr: "127.0.0.1:%s"\n' "${b%%=*}"
    if [[ $b == *=* ]]; then printf '      tls: {sni: %s}\n' "${b#*=}"; fi
  done
}

# --- load ---------------------------------------------------------------------------------------
# chat_request STEM BYTES [STREAM=false]: writes STEM.json, a chat completion request of BYTES
# bytes or so (a system prompt and a lorem-ipsum user turn of BYTES - 150 characters), and
# STEM.lua, the wrk script that POSTs it.
chat_request() {
  python3 - "$1.json" "$2" "${3:-false}" <<'PY'
import json, sys
path, size, stream = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "true"
text = "lorem ipsum dolor sit amet, consectetur adipiscing elit. "
msgs = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": (text * (size // len(text) + 1))[: max(0, size - 150)]}]
open(path, "w").write(json.dumps({"model": "m", "stream": stream, "max_tokens": 2, "messages": msgs}))
PY
  wrk_post "$1.json" > "$1.lua"
}

# wrk_post BODY [HEADER=VALUE...]: on stdout, a wrk script POSTing the JSON file BODY, with the
# extra request headers.
wrk_post() {
  local body=$1 h; shift
  echo 'wrk.method = "POST"'
  echo 'wrk.headers["Content-Type"] = "application/json"'
  for h in "$@"; do echo "wrk.headers[\"${h%%=*}\"] = \"${h#*=}\""; done
  echo "local f = io.open(\"$body\", \"rb\"); wrk.body = f:read(\"*all\"); f:close()"
}

# --- /proc --------------------------------------------------------------------------------------
# cpu_ticks PID...: user + system CPU ticks of the processes (all their threads), summed.
cpu_ticks() {
  local t=0 p s
  for p in "$@"; do read -r -a s < "/proc/$p/stat"; t=$((t + s[13] + s[14])); done
  echo "$t"
}

# rss_kib PID... and peak_rss_kib PID...: resident memory now (VmRSS) and at its peak (VmHWM),
# KiB, summed over the processes (nginx: master and worker).
status_kib() {
  local key=$1 t=0 p v; shift
  for p in "$@"; do v=$(awk -v k="$key:" '$1 == k {print $2}' "/proc/$p/status"); t=$((t + v)); done
  echo "$t"
}
rss_kib() { status_kib VmRSS "$@"; }
peak_rss_kib() { status_kib VmHWM "$@"; }

# busy_ticks: busy CPU ticks of the whole machine since boot: user, nice, system, irq, softirq
# and steal. busy_ticks_no_steal: the same less steal.
busy_ticks() { stat_busy 1; }
busy_ticks_no_steal() { stat_busy 0; }
stat_busy() { # 1 to count steal, 0 not to
  local u n s i si st
  read -r _ u n s _ _ i si st _ < /proc/stat
  echo $((u + n + s + i + si + $1 * st))
}
