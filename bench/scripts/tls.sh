#!/usr/bin/env bash
# TLS and HTTP/2 cost: kvroute's TLS listener beside nginx terminating TLS, per proxy core.
# Used by: docs/results/proxy-cost.md
#
# kvroute's TLS listener beside nginx terminating TLS with the same certificate (ECDSA P-256,
# made here), in front of the same backend (an nginx `return` that answers a chat completion at
# once), on loopback only.
#
#   bench/scripts/tls.sh [SECONDS=8] [ROUNDS=3] [OUT=bench/runs/tls]
#
# Needs nginx, wrk, h2load and openssl (Debian: apt-get install nginx wrk nghttp2-client
# openssl). Builds kvroute in release mode. Both proxies run pinned to CPU 1 with one worker
# (kvroute `threads: 1`, nginx `worker_processes 1`); the load generators and the backend share
# CPU 0, so every rate is per proxy core. Each figure is the median of ROUNDS runs, the
# proxies taking turns within each round. Cases, all with a 1 KB chat body:
#   - keepalive: wrk, 1 connection kept alive: p50 latency; "added" is p50 minus the p50 of
#     the backend reached directly (plaintext);
#   - handshakes: wrk, 16 connections, `Connection: close`: every request opens a connection
#     with a full TLS handshake (wrk never resumes a session), so requests/s = handshakes/s;
#   - h2: h2load, 8 connections x 16 concurrent streams, HTTP/2 over TLS: requests/s;
#   - h1load: h2load --h1, 128 connections, HTTP/1.1 over TLS: the same load generator and
#     concurrency without HTTP/2, so the h2 row can be read against it.
# Also recorded: the CPU share other processes used while it ran (from /proc/stat).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"
SECS=${1:-8}
ROUNDS=${2:-3}
OUT=${3:-bench/runs/tls}
mkdir -p "$OUT"
need_tools "apt-get install nginx wrk nghttp2-client" nginx wrk h2load openssl taskset python3
build_release -p kvroute --bin kvroute
KVROUTE=$(release_bin kvroute)
start_work tls

BACKEND=18401
NGINX_TLS=18410
KV_TLS=18420
KV_PLAIN=18421
KV_ADMIN=18422

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
  -subj /CN=localhost -addext "subjectAltName=IP:127.0.0.1,DNS:localhost" \
  -keyout "$WORK/key.pem" -out "$WORK/cert.pem" 2>/dev/null

nginx_conf backend "$(chat_backend $BACKEND)"
# (listen ... http2 rather than http2 on: Debian 12's nginx 1.22 predates the latter)
nginx_conf front "$(nginx_proxy "127.0.0.1:$NGINX_TLS ssl http2" $BACKEND \
  "ssl_certificate $WORK/cert.pem;" "ssl_certificate_key $WORK/key.pem;" "ssl_protocols TLSv1.2 TLSv1.3;")"
{
  pingora_yaml kv 1
  kvroute_yaml $KV_PLAIN $KV_ADMIN $BACKEND
  printf '  tls:\n    listen: "127.0.0.1:%s"\n    cert: %s\n    key: %s\n' $KV_TLS "$WORK/cert.pem" "$WORK/key.pem"
  printf '  limits:\n    max_connections: 100000\n'
} > "$WORK/kv.yaml"

chat_request "$WORK/body" 1000   # and body.lua, the kept-alive wrk script
wrk_post "$WORK/body.json" Connection=close > "$WORK/close.lua"

start_nginx "$LOAD_CPU" backend
start_nginx "$PROXY_CPU" front
spawn "$PROXY_CPU" "$WORK/kv.err" "$KVROUTE" -c "$WORK/kv.yaml"
for port in $BACKEND $NGINX_TLS $KV_TLS $KV_PLAIN; do wait_port "$port"; done
wait_http 100 "127.0.0.1:$KV_ADMIN/readyz" || true

RAW="$OUT/raw.jsonl"
: > "$RAW"
record() { # proxy case tool-output-file
  python3 - "$@" "$SECS" >> "$RAW" <<'PY'
import json, re, sys
proxy, case, path, secs = sys.argv[1:]
t = open(path).read()
def ms(v, unit):
    return float(v) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]
row = {"proxy": proxy, "case": case}
if case in ("h2", "h1load"):
    row["rps"] = float(re.search(r"finished in [\d.]+\w+, ([\d.]+) req/s", t).group(1))
    row["ok"] = int(re.search(r"(\d+) succeeded", t).group(1))
    row["failed"] = int(re.search(r"(\d+) failed", t).group(1))
    m = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", t)
    row["non_2xx"] = sum(int(x) for x in m.groups()[1:]) if m else None
else:
    pct = {m.group(1): ms(m.group(2), m.group(3)) for m in re.finditer(r"^\s+(\d+)%\s+([\d.]+)(us|ms|s)", t, re.M)}
    row["rps"] = float(re.search(r"Requests/sec:\s+([\d.]+)", t).group(1))
    row["p50_ms"] = pct.get("50")
    row["p99_ms"] = pct.get("99")
    m = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", t)
    row["non_2xx"] = int(m.group(1)) if m else 0
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", t)
    row["socket_errors"] = sum(int(x) for x in m.groups()) if m else 0
print(json.dumps(row))
PY
}

URL="/v1/chat/completions"
# Outside noise: how busy the machine is with everything started and no load running.
quiet_busy=$(busy_ticks_no_steal); sleep 3; quiet_busy=$(( $(busy_ticks_no_steal) - quiet_busy ))
start_busy=$(busy_ticks_no_steal); start_t=$(date +%s.%N)
for round in $(seq "$ROUNDS"); do
  echo "round $round/$ROUNDS" >&2
  # keep-alive latency: the backend directly, then each proxy in turn
  taskset -c "$LOAD_CPU" wrk -t1 -c1 -d"${SECS}s" --latency -s "$WORK/body.lua" "http://127.0.0.1:$BACKEND$URL" > "$WORK/o.txt"
  record direct keepalive "$WORK/o.txt"
  for p in "nginx:https://127.0.0.1:$NGINX_TLS" "kvroute:https://127.0.0.1:$KV_TLS" "kvroute_plain:http://127.0.0.1:$KV_PLAIN"; do
    taskset -c "$LOAD_CPU" wrk -t1 -c1 -d"${SECS}s" --latency -s "$WORK/body.lua" "${p#*:}$URL" > "$WORK/o.txt"
    record "${p%%:*}" keepalive "$WORK/o.txt"
  done
  for p in "nginx:https://127.0.0.1:$NGINX_TLS" "kvroute:https://127.0.0.1:$KV_TLS"; do
    taskset -c "$LOAD_CPU" wrk -t1 -c16 -d"${SECS}s" --latency -s "$WORK/close.lua" "${p#*:}$URL" > "$WORK/o.txt"
    record "${p%%:*}" handshakes "$WORK/o.txt"
  done
  for p in "nginx:https://127.0.0.1:$NGINX_TLS" "kvroute:https://127.0.0.1:$KV_TLS"; do
    taskset -c "$LOAD_CPU" h2load -D "$SECS" -c 8 -m 16 -t 1 -d "$WORK/body.json" \
      -H "content-type: application/json" "${p#*:}$URL" > "$WORK/o.txt" 2>&1
    grep -qi "application protocol: h2" "$WORK/o.txt" || { echo "h2load did not negotiate h2 with ${p%%:*}" >&2; cat "$WORK/o.txt" >&2; exit 1; }
    record "${p%%:*}" h2 "$WORK/o.txt"
  done
  # The same load generator over HTTP/1.1 (as many connections as h2 has streams): whether
  # HTTP/2 itself costs a proxy anything.
  for p in "nginx:https://127.0.0.1:$NGINX_TLS" "kvroute:https://127.0.0.1:$KV_TLS"; do
    taskset -c "$LOAD_CPU" h2load --h1 -D "$SECS" -c 128 -t 1 -d "$WORK/body.json" \
      -H "content-type: application/json" "${p#*:}$URL" > "$WORK/o.txt" 2>&1
    record "${p%%:*}" h1load "$WORK/o.txt"
  done
done
end_busy=$(busy_ticks_no_steal); end_t=$(date +%s.%N)

python3 - "$RAW" "$OUT/summary.md" "$SECS" "$ROUNDS" "$start_busy" "$end_busy" "$start_t" "$end_t" "$(getconf CLK_TCK)" "$(nproc)" "$quiet_busy" <<'PY'
import json, statistics, sys
raw, out, secs, rounds, b0, b1, t0, t1, hz, ncpu, quiet = sys.argv[1:]
quiet_share = int(quiet) / int(hz) / 3.0 / int(ncpu)
rows = [json.loads(l) for l in open(raw)]
def med(proxy, case, key):
    v = [r[key] for r in rows if r["proxy"] == proxy and r["case"] == case and r.get(key) is not None]
    return statistics.median(v) if v else None
errors = sum((r.get("non_2xx") or 0) + (r.get("socket_errors") or 0) + (r.get("failed") or 0) for r in rows)
busy = (int(b1) - int(b0)) / int(hz) / (float(t1) - float(t0)) / int(ncpu)
d = med("direct", "keepalive", "p50_ms")
lines = [f"TLS and HTTP/2, median of {rounds} interleaved rounds of {secs} s, proxy pinned to one core; "
         f"both cores {busy:.0%} busy on average over the run (every process: the proxies, the backend and the load generators themselves, which keep CPU 0 near full; so not a measure of outside noise alone; with no load, just before: {quiet_share:.0%}); "
         f"errors (non-2xx, socket, failed): {errors}", "",
         "| case | nginx (TLS) | kvroute (TLS) | kvroute / nginx |", "|---|---|---|---|"]
def row(label, case, key, fmt, added=False):
    n, k = med("nginx", case, key), med("kvroute", case, key)
    if added:
        n, k = n - d, k - d
    lines.append(f"| {label} | {fmt.format(n)} | {fmt.format(k)} | {k / n:.2f}x |")
row("added p50 per request, kept-alive connection (ms)", "keepalive", "p50_ms", "{:.3f}", added=True)
row("new connections (full handshake + 1 request) per second per core", "handshakes", "rps", "{:,.0f}")
row("HTTP/2 requests per second per core (8 conns x 16 streams)", "h2", "rps", "{:,.0f}")
row("HTTP/1.1 over TLS, same load generator, 128 conns: requests per second per core", "h1load", "rps", "{:,.0f}")
kp = med("kvroute_plain", "keepalive", "p50_ms")
lines += ["", f"Backend reached directly: p50 {d:.3f} ms. kvroute on its plaintext listener, same run: "
          f"added p50 {kp - d:.3f} ms, so TLS adds {med('kvroute', 'keepalive', 'p50_ms') - kp:.3f} ms to kvroute's p50."]
open(out, "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
