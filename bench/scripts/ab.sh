#!/usr/bin/env bash
# Paired A/B of two kvroute binaries on the proxy path: both run side by side (one worker
# thread each, pinned to CPU 1, default policy) in front of one nginx `return` backend; wrk on
# CPU 0 drives them in turn (old first in odd rounds, new first in even ones), ROUNDS rounds,
# 1 KB and 100 KB chat bodies:
# `wrk -c32 -d6s` (requests/s, and the proxy's CPU per request over that run, from
# /proc/PID/stat) then `wrk -c1 -d4s --latency` (p50). Prints every run and the medians, and
# each binary's peak RSS. Loopback only.
#
#   bench/scripts/ab.sh OLD_KVROUTE NEW_KVROUTE [ROUNDS=3] [OUT=bench/results/overhead-edge/ab.txt]
#
# Both run with RUST_LOG=warn (no access log) unless AB_RUST_LOG says otherwise:
# AB_RUST_LOG=info measures them as shipped, writing an access line a request (to a file here).
set -euo pipefail
cd "$(dirname "$0")/../.."
OLD=${1:?old kvroute binary}; NEW=${2:?new kvroute binary}
ROUNDS=${3:-3}; OUT=${4:-bench/results/overhead-edge/ab.txt}
for tool in nginx wrk taskset python3; do
  command -v "$tool" >/dev/null || { echo "ab.sh: $tool not found" >&2; exit 1; }
done
WORK=$(mktemp -d /tmp/kvroute-ab.XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done
  [ -f "$WORK/backend.pid" ] && kill "$(cat "$WORK/backend.pid")" 2>/dev/null || true
  sleep 0.3; rm -rf "$WORK"
}
trap cleanup EXIT
BACKEND=18701
cat > "$WORK/backend.conf" <<CONF
worker_processes 1;
pid $WORK/backend.pid;
error_log $WORK/backend.err warn;
events { worker_connections 4096; }
http {
  access_log off; keepalive_requests 1000000; client_max_body_size 10m; client_body_buffer_size 1m;
  server { listen 127.0.0.1:$BACKEND; location / { default_type application/json; return 200 '{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"completion_tokens":1,"total_tokens":11}}'; } }
}
CONF
for v in old new; do
  port=$([ $v = old ] && echo 18710 || echo 18720)
  cat > "$WORK/$v.yaml" <<CONF
version: 1
threads: 1
pid_file: $WORK/$v.pid
upgrade_sock: $WORK/$v.sock
grace_period_seconds: 0
graceful_shutdown_timeout_seconds: 1
kvroute:
  listen: "127.0.0.1:$port"
  admin_listen: "127.0.0.1:$((port + 1))"
  limits: {max_connections: 100000}
  backends: [{addr: "127.0.0.1:$BACKEND"}]
CONF
done
python3 - "$WORK" <<'PY'
import json, sys
w = sys.argv[1]
t = "lorem ipsum dolor sit amet, consectetur adipiscing elit. "
for size in (1000, 100000):
    msgs = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": (t * (size // len(t) + 1))[: size - 150]}]
    open(f"{w}/body{size}.json", "w").write(json.dumps({"model": "m", "stream": False, "max_tokens": 2, "messages": msgs}))
    open(f"{w}/b{size}.lua", "w").write(
        f'wrk.method="POST"\nwrk.headers["Content-Type"]="application/json"\n'
        f'local f=io.open("{w}/body{size}.json","rb"); wrk.body=f:read("*all"); f:close()\n')
PY
HZ=$(getconf CLK_TCK)
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; } # utime + stime, all threads
wait_port() { for _ in $(seq 200); do (exec 3<>/dev/tcp/127.0.0.1/$1) 2>/dev/null && return 0; sleep 0.05; done; echo "port $1 never opened" >&2; return 1; }
taskset -c 0 nginx -c "$WORK/backend.conf" -p "$WORK"
RUST_LOG=${AB_RUST_LOG:-warn} taskset -c 1 "$OLD" -c "$WORK/old.yaml" 2>"$WORK/old.err" & PIDS+=("$!")
RUST_LOG=${AB_RUST_LOG:-warn} taskset -c 1 "$NEW" -c "$WORK/new.yaml" 2>"$WORK/new.err" & PIDS+=("$!")
wait_port $BACKEND; wait_port 18710; wait_port 18720; sleep 1
mkdir -p "$(dirname "$OUT")"
{
  echo "# bench/scripts/ab.sh $OLD $NEW $ROUNDS"
  echo "# columns: round body_bytes build req_per_s_c32 p50_c1 cpu_us_per_req_c32"
} > "$OUT"
for round in $(seq "$ROUNDS"); do
  # Alternate which binary goes first: run in one fixed order, the second one measured up to
  # 1.13x faster at 1 KB than the same binary first (bench/results/overhead-17).
  order="old new"; [ $((round % 2)) = 0 ] && order="new old"
  for size in 1000 100000; do
    for v in $order; do
      port=$([ $v = old ] && echo 18710 || echo 18720)
      url="http://127.0.0.1:$port/v1/chat/completions"
      pid=${PIDS[0]}; [ $v = new ] && pid=${PIDS[1]}
      cpu0=$(cpu_ticks "$pid")
      res=$(taskset -c 0 wrk -t1 -c32 -d6s -s "$WORK/b$size.lua" "$url")
      cpu1=$(cpu_ticks "$pid")
      rps=$(awk '/Requests\/sec/{print $2}' <<<"$res")
      reqs=$(awk '/requests in/{print $1}' <<<"$res")
      cpu_us=$(awk -v t=$((cpu1 - cpu0)) -v n="$reqs" -v hz="$HZ" 'BEGIN{printf "%.1f", (n > 0 ? t / hz / n * 1e6 : 0)}')
      p50=$(taskset -c 0 wrk -t1 -c1 -d4s --latency -s "$WORK/b$size.lua" "$url" | awk '/ 50%/{print $2}')
      echo "$round $size $v $rps $p50 $cpu_us" | tee -a "$OUT"
    done
  done
done
# Peak RSS over the whole run, the 32-connection 100 KB runs included.
echo "# peak RSS MiB: old $(awk '/VmHWM/{printf "%.1f", $2/1024}' "/proc/${PIDS[0]}/status") new $(awk '/VmHWM/{printf "%.1f", $2/1024}' "/proc/${PIDS[1]}/status")" | tee -a "$OUT"
python3 - "$OUT" <<'PY' | tee -a "$OUT"
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if l[0].isdigit()]
def us(v):
    for unit, f in (("us", 1), ("ms", 1000), ("s", 1e6)):
        if v.endswith(unit):
            return float(v[: -len(unit)]) * f
for size in ("1000", "100000"):
    med = {b: (statistics.median(float(r[3]) for r in rows if r[1] == size and r[2] == b),
               statistics.median(us(r[4]) for r in rows if r[1] == size and r[2] == b),
               statistics.median(float(r[5]) for r in rows if r[1] == size and r[2] == b and len(r) > 5))
           for b in ("old", "new")}
    print(f"# medians, {int(size) // 1000} KB: req/s old {med['old'][0]:.0f} new {med['new'][0]:.0f} "
          f"({med['new'][0] / med['old'][0]:.2f}x); p50 old {med['old'][1]:.0f} us new {med['new'][1]:.0f} us; "
          f"CPU us/req old {med['old'][2]:.1f} new {med['new'][2]:.1f} ({med['new'][2] / med['old'][2]:.2f}x)")
PY
