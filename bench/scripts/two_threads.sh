#!/usr/bin/env bash
# Two worker threads on a 2-core machine, where they cannot have cores of their own: proxies
# with `threads: 1` pinned to CPU 1 (wrk on CPU 0), then `threads: 2` sharing CPUs 0-1 with wrk
# and the nginx backend, 1 KB chat, wrk -c32. Loopback only.
#
#   bench/scripts/two_threads.sh cpu BARE KVROUTE [KVROUTE2]
#       requests/s and the proxy's CPU ms per request, 1 thread then 2, for the bare Pingora
#       proxy (examples/bare_pingora) and each kvroute binary (named k1, k2 in the output).
#   bench/scripts/two_threads.sh futex BARE KVROUTE
#       futex syscalls per request with 2 threads (`perf stat -e syscalls:sys_enter_futex`).
#
# Environment: WS, the values of Pingora's `work_stealing` to run (default "true"; e.g.
# "true false"); ROUNDS (default 2, cpu only); SECS per run (default 6); ENVX, a command prefix
# for the kvroute runs (e.g. "env GLIBC_TUNABLES=glibc.malloc.tcache_count=1000").
set -u
MODE=${1:?cpu or futex}; BARE=${2:?bare_pingora binary}; shift 2
[ $# -ge 1 ] || { echo "two_threads.sh: no kvroute binary" >&2; exit 1; }
KVS=("$@")
WS=${WS:-true}; ROUNDS=${ROUNDS:-2}; SECS=${SECS:-6}; ENVX=${ENVX:-}
for tool in nginx wrk taskset python3; do
  command -v "$tool" >/dev/null || { echo "two_threads.sh: $tool not found" >&2; exit 1; }
done
W=$(mktemp -d /tmp/kvroute-2threads.XXXXXX)
P=
cleanup() {
  [ -n "$P" ] && kill -9 "$P" 2>/dev/null
  [ -f "$W/backend.pid" ] && kill "$(cat "$W/backend.pid")" 2>/dev/null
  rm -rf "$W"
}
trap cleanup EXIT

JSON_BODY='{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"completion_tokens":1,"total_tokens":11}}'
cat > "$W/backend.conf" <<CONF
worker_processes 1;
pid $W/backend.pid;
error_log $W/backend.err warn;
events { worker_connections 4096; }
http { access_log off; client_max_body_size 10m; client_body_buffer_size 1m; keepalive_requests 1000000;
  server { listen 127.0.0.1:18301; location / { default_type application/json; return 200 '$JSON_BODY'; } } }
CONF
taskset -c 0 nginx -c "$W/backend.conf" -p "$W"
python3 - "$W" <<'PY'
import json, sys
w = sys.argv[1]; text = "lorem ipsum dolor sit amet, consectetur adipiscing elit. "
msgs = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": (text * 20)[:850]}]
open(f"{w}/b.json", "w").write(json.dumps({"model": "m", "stream": False, "max_tokens": 2, "messages": msgs}))
open(f"{w}/b.lua", "w").write(f'wrk.method="POST"\nwrk.headers["Content-Type"]="application/json"\n'
                              f'local f=io.open("{w}/b.json","rb"); wrk.body=f:read("*all"); f:close()\n')
PY

wait_port() { for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$1) 2>/dev/null && return 0; sleep 0.05; done; return 1; }
ticks() { awk '{print $14+$15}' "/proc/$1/stat"; }

# start NAME THREADS WS: starts proxy NAME (bare, k1, k2) on its CPUs; sets P and PORT.
start() {
  local cores; cores=$([ "$2" = 1 ] && echo 1 || echo 0,1)
  local conf="version: 1
threads: $2
work_stealing: $3
pid_file: $W/p.pid
upgrade_sock: $W/p.sock
grace_period_seconds: 0
graceful_shutdown_timeout_seconds: 1"
  if [ "$1" = bare ]; then
    echo "$conf" > "$W/bare.yaml"
    RUST_LOG=warn taskset -c "$cores" "$BARE" "$W/bare.yaml" 127.0.0.1:18330 127.0.0.1:18301 2>"$W/proxy.err" &
    P=$!; PORT=18330
  else
    local bin=${KVS[$(( ${1#k} - 1 ))]}
    printf '%s\nkvroute:\n  listen: "127.0.0.1:18320"\n  admin_listen: "127.0.0.1:18321"\n  backends:\n    - addr: "127.0.0.1:18301"\n' "$conf" > "$W/kv.yaml"
    # shellcheck disable=SC2086
    RUST_LOG=warn $ENVX taskset -c "$cores" "$bin" -c "$W/kv.yaml" 2>"$W/proxy.err" &
    P=$!; PORT=18320
  fi
  wait_port "$PORT" || { cat "$W/proxy.err" >&2; exit 1; }
  sleep 1
}
stop() { kill -INT "$P"; wait "$P" 2>/dev/null; P=; }
load() { # THREADS SECS OUT
  taskset -c "$([ "$1" = 1 ] && echo 0 || echo 0,1)" wrk -t"$1" -c32 -d"$2"s -s "$W/b.lua" \
    "http://127.0.0.1:$PORT/v1/chat/completions" > "$3"
}

names=(bare); for i in "${!KVS[@]}"; do names+=("k$((i + 1))"); done
case "$MODE" in
cpu)
  for r in $(seq "$ROUNDS"); do for name in "${names[@]}"; do for ws in $WS; do for threads in 1 2; do
    start "$name" "$threads" "$ws"
    b=$(ticks "$P"); load "$threads" "$SECS" "$W/out.txt"; a=$(ticks "$P")
    awk -v p="$name" -v ws="$ws" -v t="$threads" -v ticks=$((a - b)) -v hz="$(getconf CLK_TCK)" \
      '/requests in/{n=$1} /Requests\/sec/{r=$2} /Non-2xx/{e=$NF}
       END{printf "%s ws=%s threads=%s rps=%s cpu_ms_per_req=%.4f non2xx=%s\n", p, ws, t, r, ticks/hz/n*1000, e+0}' "$W/out.txt"
    stop
  done; done; done; done
  ;;
futex)
  for name in "${names[@]}"; do for ws in $WS; do
    start "$name" 2 "$ws"
    load 2 "$SECS" "$W/out.txt" & WP=$!
    sleep 1
    perf stat -e syscalls:sys_enter_futex -p "$P" -o "$W/futex.txt" -- sleep 3 >/dev/null 2>&1
    wait "$WP"
    stop
    rps=$(awk '/Requests\/sec/{print $2}' "$W/out.txt")
    f=$(awk '/sys_enter_futex/{gsub(",", "", $1); print $1}' "$W/futex.txt")
    python3 -c "print('$name ws=$ws rps=$rps futex/req=%.3f' % ($f / ($rps * 3)))"
  done; done
  ;;
*) echo "two_threads.sh: mode cpu or futex" >&2; exit 1 ;;
esac
