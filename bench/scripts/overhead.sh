#!/usr/bin/env bash
# Proxy cost: what kvroute adds per request, next to a bare Pingora proxy (the framework's
# floor: examples/bare_pingora.rs), nginx round robin and no proxy at all, against a backend
# that answers at once (an nginx `return`), on loopback only.
#
#   bench/scripts/overhead.sh [SECONDS=10] [OUT=bench/results/overhead]
#
# Needs nginx and wrk (Debian: apt-get install nginx wrk). Builds kvroute in release mode.
# Each case runs wrk twice: 1 connection (latency: p50/p99 with no queueing) and 32 connections
# (throughput). The proxy under test is pinned to CPU 1 with one worker thread; wrk and the
# backend share CPU 0, so requests/s is per proxy core. CPU seconds per 1000 requests and peak
# RSS are read from /proc for the proxy process(es).
set -euo pipefail
cd "$(dirname "$0")/../.."
SECS=${1:-10}
OUT=${2:-bench/results/overhead}
mkdir -p "$OUT"
for tool in nginx wrk taskset python3; do
  command -v "$tool" >/dev/null || { echo "overhead.sh: $tool not found (apt-get install nginx wrk)" >&2; exit 1; }
done
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/tmp/kvroute-target}
cargo build --release -q -p kvroute --bin kvroute --example bare_pingora
KVROUTE="$CARGO_TARGET_DIR/release/kvroute"
BARE="$CARGO_TARGET_DIR/release/examples/bare_pingora"

WORK=$(mktemp -d /tmp/kvroute-overhead.XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done
  [ -f "$WORK/backend.pid" ] && kill "$(cat "$WORK/backend.pid")" 2>/dev/null || true
  [ -f "$WORK/rr.pid" ] && kill "$(cat "$WORK/rr.pid")" 2>/dev/null || true
  sleep 0.3
  rm -rf "$WORK"
}
trap cleanup EXIT

BACKEND_JSON=18301   # answers chat completions as JSON
BACKEND_SSE=18302    # answers chat completions as an SSE stream
NGINX_RR=18310
KV=18320
KV_ADMIN=18321
BARE_PORT=18330

JSON_BODY='{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"completion_tokens":1,"total_tokens":11}}'
SSE_BODY='data: {"choices":[{"delta":{"content":"o"},"index":0}]}\n\ndata: {"choices":[{"delta":{"content":"k"},"index":0}]}\n\ndata: [DONE]\n\n'

cat > "$WORK/backend.conf" <<CONF
worker_processes 1;
pid $WORK/backend.pid;
error_log $WORK/backend.err warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_max_body_size 10m;
  client_body_buffer_size 1m;
  keepalive_requests 1000000;
  server {
    listen 127.0.0.1:$BACKEND_JSON;
    location / { default_type application/json; return 200 '$JSON_BODY'; }
  }
  server {
    listen 127.0.0.1:$BACKEND_SSE;
    location / { default_type text/event-stream; return 200 '$SSE_BODY'; }
  }
}
CONF

rr_conf() { # $1 backend port
cat > "$WORK/rr.conf" <<CONF
worker_processes 1;
pid $WORK/rr.pid;
error_log $WORK/rr.err warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_max_body_size 10m;
  client_body_buffer_size 1m;
  keepalive_requests 1000000;
  upstream fleet { server 127.0.0.1:$1; keepalive 64; }
  server {
    listen 127.0.0.1:$NGINX_RR;
    location / {
      proxy_pass http://fleet;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering on;
    }
  }
}
CONF
}

kv_conf() { # $1 backend port
cat > "$WORK/kv.yaml" <<CONF
version: 1
threads: 1
pid_file: $WORK/kv.pid
upgrade_sock: $WORK/kv.sock
grace_period_seconds: 0
graceful_shutdown_timeout_seconds: 1
kvroute:
  listen: "127.0.0.1:$KV"
  admin_listen: "127.0.0.1:$KV_ADMIN"
  backends:
    - addr: "127.0.0.1:$1"
  routing:
    policy: bounded_hash
CONF
}

cat > "$WORK/bare.yaml" <<CONF
version: 1
threads: 1
pid_file: $WORK/bare.pid
upgrade_sock: $WORK/bare.sock
grace_period_seconds: 0
graceful_shutdown_timeout_seconds: 1
CONF

wait_port() { for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$1) 2>/dev/null && return 0; sleep 0.05; done; echo "port $1 never opened" >&2; return 1; }

taskset -c 0 nginx -c "$WORK/backend.conf" -p "$WORK"
wait_port $BACKEND_JSON

python3 - "$WORK" <<'PY'
import json, sys
work = sys.argv[1]
for size in (1000, 100000):
    for stream in (False, True):
        msgs = [{"role": "system", "content": "You are a helpful assistant."}]
        text = "lorem ipsum dolor sit amet, consectetur adipiscing elit. "
        user = (text * (size // len(text) + 1))[: max(0, size - 150)]
        msgs.append({"role": "user", "content": user})
        body = json.dumps({"model": "m", "stream": stream, "max_tokens": 2, "messages": msgs})
        name = f"{work}/body_{size}_{'stream' if stream else 'plain'}.json"
        open(name, "w").write(body)
        lua = f"""wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local f = io.open("{name}", "rb"); wrk.body = f:read("*all"); f:close()
"""
        open(name.replace(".json", ".lua"), "w").write(lua)
PY

cpu_ticks() { local t=0; for p in "$@"; do read -r -a s < "/proc/$p/stat"; t=$((t + s[13] + s[14])); done; echo $t; }
peak_rss_kib() { local m=0; for p in "$@"; do v=$(awk '/VmHWM/{print $2}' "/proc/$p/status"); [ "$v" -gt "$m" ] && m=$v; done; echo $m; }

RESULTS="$WORK/results.jsonl"
: > "$RESULTS"
run_case() { # $1 proxy name, $2 url port, $3 body file stem, $4.. pids to account
  local name=$1 port=$2 stem=$3; shift 3
  local url="http://127.0.0.1:$port/v1/chat/completions"
  taskset -c 0 wrk -t1 -c1 -d"${SECS}s" --latency -s "$stem.lua" "$url" > "$WORK/lat.txt"
  local before; before=$( [ $# -gt 0 ] && cpu_ticks "$@" || echo 0)
  taskset -c 0 wrk -t1 -c32 -d"${SECS}s" --latency -s "$stem.lua" "$url" > "$WORK/thr.txt"
  local after; after=$( [ $# -gt 0 ] && cpu_ticks "$@" || echo 0)
  local rss; rss=$( [ $# -gt 0 ] && peak_rss_kib "$@" || echo 0)
  python3 - "$name" "$stem" "$WORK/lat.txt" "$WORK/thr.txt" "$((after - before))" "$(getconf CLK_TCK)" "$rss" >> "$RESULTS" <<'PY'
import json, re, sys
name, stem, lat, thr, ticks, hz, rss = sys.argv[1:]
def parse(path):
    t = open(path).read()
    def ms(v, unit):
        return float(v) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]
    pct = {m.group(1): ms(m.group(2), m.group(3)) for m in re.finditer(r"^\s+(\d+)%\s+([\d.]+)(us|ms|s)", t, re.M)}
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", t).group(1))
    total = int(re.search(r"(\d+) requests in", t).group(1))
    m = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", t)
    errors = int(m.group(1)) if m else 0
    return pct, rps, total, errors
lp, lrps, _, lerr = parse(lat)
tp, trps, total, terr = parse(thr)
base = stem.rsplit("/", 1)[-1]
_, size, mode = base.split("_")
cpu_s = int(ticks) / int(hz)
print(json.dumps({
    "proxy": name, "body_bytes": int(size), "stream": mode == "stream",
    "p50_ms_c1": lp.get("50"), "p99_ms_c1": lp.get("99"),
    "rps_c32": trps, "p50_ms_c32": tp.get("50"), "p99_ms_c32": tp.get("99"),
    "requests_c32": total, "non_2xx": lerr + terr,
    "cpu_s_per_1000": (cpu_s / total * 1000) if total and name != "direct" else None,
    "peak_rss_mib": int(rss) / 1024 if name != "direct" else None,
}))
PY
  echo "  $name $(basename "$stem"): done" >&2
}

for mode in plain stream; do
  backend=$BACKEND_JSON; [ $mode = stream ] && backend=$BACKEND_SSE
  rr_conf $backend; kv_conf $backend
  taskset -c 1 nginx -c "$WORK/rr.conf" -p "$WORK"
  RUST_LOG=warn taskset -c 1 "$KVROUTE" -c "$WORK/kv.yaml" 2>"$WORK/kv.err" &
  KPID=$!; PIDS+=("$KPID")
  RUST_LOG=warn taskset -c 1 "$BARE" "$WORK/bare.yaml" "127.0.0.1:$BARE_PORT" "127.0.0.1:$backend" 2>"$WORK/bare.err" &
  BPID=$!; PIDS+=("$BPID")
  wait_port $NGINX_RR; wait_port $KV; wait_port $BARE_PORT
  sleep 0.5
  # nginx workers do not carry the config path in their command line: take the master's children.
  RRMASTER=$(cat "$WORK/rr.pid")
  RRPIDS="$RRMASTER $(pgrep -P "$RRMASTER" | tr '\n' ' ')"
  for size in 1000 100000; do
    stem="$WORK/body_${size}_${mode}"
    run_case direct $backend "$stem"
    # shellcheck disable=SC2086
    run_case nginx_rr $NGINX_RR "$stem" $RRPIDS
    run_case pingora_bare $BARE_PORT "$stem" "$BPID"
    run_case kvroute $KV "$stem" "$KPID"
  done
  kill "$KPID" "$BPID"; wait "$KPID" "$BPID" 2>/dev/null || true
  kill "$(cat "$WORK/rr.pid")"; sleep 0.3
done

python3 - "$RESULTS" "$OUT" "$SECS" <<'PY'
import json, sys, os
rows = [json.loads(l) for l in open(sys.argv[1])]
out, secs = sys.argv[2], sys.argv[3]
json.dump(rows, open(os.path.join(out, "overhead.json"), "w"), indent=1)
def f(v, d=2):
    return "n/a" if v is None else f"{v:.{d}f}"
lines = [f"Proxy cost, loopback, wrk {secs}s per case; proxy pinned to 1 core (1 worker), wrk + backend on the other.", "",
         "| body | stream | proxy | p50 ms (c=1) | added p50 ms | p99 ms (c=1) | req/s (c=32) | vs nginx | vs bare Pingora | p99 ms (c=32) | CPU s / 1000 req | peak RSS MiB | non-2xx |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
for r in rows:
    direct = next(x for x in rows if x["proxy"] == "direct" and x["body_bytes"] == r["body_bytes"] and x["stream"] == r["stream"])
    nginx = next(x for x in rows if x["proxy"] == "nginx_rr" and x["body_bytes"] == r["body_bytes"] and x["stream"] == r["stream"])
    added = r["p50_ms_c1"] - direct["p50_ms_c1"] if r["proxy"] != "direct" else None
    ratio = r["rps_c32"] / nginx["rps_c32"] if r["proxy"] != "direct" else None
    bare = next((x for x in rows if x["proxy"] == "pingora_bare" and x["body_bytes"] == r["body_bytes"] and x["stream"] == r["stream"]), None)
    vs_bare = r["rps_c32"] / bare["rps_c32"] if bare and r["proxy"] != "direct" else None
    size = "1 KB" if r["body_bytes"] == 1000 else "100 KB"
    lines.append(f"| {size} | {'yes' if r['stream'] else 'no'} | {r['proxy']} | {f(r['p50_ms_c1'],3)} | {f(added,3)} | {f(r['p99_ms_c1'],3)} | {r['rps_c32']:.0f} | {f(ratio)} | {f(vs_bare)} | {f(r['p99_ms_c32'])} | {f(r['cpu_s_per_1000'],3)} | {f(r['peak_rss_mib'],1)} | {r['non_2xx']} |")
open(os.path.join(out, "overhead.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
echo "written: $OUT/overhead.md $OUT/overhead.json" >&2
