#!/usr/bin/env bash
# Two worker threads on a 2-core machine: requests/s, CPU and futex calls per request, 1 thread then 2.
# Used by: docs/results/proxy-cost.md
#
# Where they cannot have cores of their own: proxies with `threads: 1` pinned to CPU 1 (wrk on
# CPU 0), then `threads: 2` sharing CPUs 0-1 with wrk and the nginx backend, 1 KB chat, wrk
# -c32. Loopback only.
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
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "$0")/lib.sh"
MODE=${1:?cpu or futex}; BARE=${2:?bare_pingora binary}; shift 2
[ $# -ge 1 ] || die "no kvroute binary"
KVS=("$@")
WS=${WS:-true}; ROUNDS=${ROUNDS:-2}; SECS=${SECS:-6}; ENVX=${ENVX:-}
need_tools "" nginx wrk taskset python3
CLEANUP_SIGNAL=KILL
start_work 2threads
BACKEND=18301
nginx_conf backend "$(chat_backend $BACKEND)"
start_nginx "$LOAD_CPU" backend
chat_request "$WORK/b" 1000

# start NAME THREADS WS: starts proxy NAME (bare, k1, k2) on its CPUs; sets P and PORT.
start() {
  local cores; cores=$([ "$2" = 1 ] && echo "$PROXY_CPU" || echo 0,1)
  { pingora_yaml p "$2"; echo "work_stealing: $3"; } > "$WORK/p.yaml"
  if [ "$1" = bare ]; then
    PORT=18330
    spawn "$cores" "$WORK/proxy.err" "$BARE" "$WORK/p.yaml" 127.0.0.1:$PORT 127.0.0.1:$BACKEND
  else
    local bin=${KVS[$(( ${1#k} - 1 ))]}
    PORT=18320
    kvroute_yaml $PORT $((PORT + 1)) $BACKEND >> "$WORK/p.yaml"
    # shellcheck disable=SC2086 # ENVX is a command prefix: one word each
    spawn "$cores" "$WORK/proxy.err" $ENVX "$bin" -c "$WORK/p.yaml"
  fi
  P=$SPAWNED
  wait_port "$PORT" 100 || { cat "$WORK/proxy.err" >&2; exit 1; }
  sleep 1
}
stop() { kill -INT "$P"; wait "$P" 2>/dev/null; P=; }
load() { # THREADS SECS OUT
  taskset -c "$([ "$1" = 1 ] && echo "$LOAD_CPU" || echo 0,1)" wrk -t"$1" -c32 -d"$2"s -s "$WORK/b.lua" \
    "http://127.0.0.1:$PORT/v1/chat/completions" > "$3"
}

names=(bare); for i in "${!KVS[@]}"; do names+=("k$((i + 1))"); done
case "$MODE" in
cpu)
  for _ in $(seq "$ROUNDS"); do for name in "${names[@]}"; do for ws in $WS; do for threads in 1 2; do
    start "$name" "$threads" "$ws"
    b=$(cpu_ticks "$P"); load "$threads" "$SECS" "$WORK/out.txt"; a=$(cpu_ticks "$P")
    awk -v p="$name" -v ws="$ws" -v t="$threads" -v ticks=$((a - b)) -v hz="$(getconf CLK_TCK)" \
      '/requests in/{n=$1} /Requests\/sec/{r=$2} /Non-2xx/{e=$NF}
       END{printf "%s ws=%s threads=%s rps=%s cpu_ms_per_req=%.4f non2xx=%s\n", p, ws, t, r, ticks/hz/n*1000, e+0}' "$WORK/out.txt"
    stop
  done; done; done; done
  ;;
futex)
  for name in "${names[@]}"; do for ws in $WS; do
    start "$name" 2 "$ws"
    load 2 "$SECS" "$WORK/out.txt" & WP=$!
    sleep 1
    perf stat -e syscalls:sys_enter_futex -p "$P" -o "$WORK/futex.txt" -- sleep 3 >/dev/null 2>&1
    wait "$WP"
    stop
    rps=$(awk '/Requests\/sec/{print $2}' "$WORK/out.txt")
    f=$(awk '/sys_enter_futex/{gsub(",", "", $1); print $1}' "$WORK/futex.txt")
    python3 -c "print('$name ws=$ws rps=$rps futex/req=%.3f' % ($f / ($rps * 3)))"
  done; done
  ;;
*) die "mode cpu or futex" ;;
esac
