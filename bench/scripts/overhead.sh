#!/usr/bin/env bash
# Proxy cost per request: kvroute beside bare Pingora, nginx, sglang-router and no proxy at all.
# Used by: docs/results/proxy-cost.md
#
# What kvroute adds per request, next to a bare Pingora proxy (the framework's floor:
# examples/bare_pingora.rs; and the same proxy reading the whole body before it forwards it, as
# kvroute must, `pingora_bare_buffered`; and that proxy with the upstream timeouts kvroute sets
# on every peer, `pingora_floor`: the floor for a proxy that places by the prompt and bounds
# each read from the engine), nginx round robin, sglang-router (round robin, when the peers'
# venv is installed: bench/scripts/install-peers.sh) and no proxy at all, against a backend that
# answers at once (an nginx `return`), on loopback only.
#
#   bench/scripts/overhead.sh [SECONDS=8] [OUT=bench/runs/overhead] [ROUNDS=3]
#
# ROUNDS=0 runs the scaling case alone.
#
# Needs nginx and wrk (Debian: apt-get install nginx wrk). Builds kvroute in release mode and
# runs it with its default config (the default policy). Each case runs wrk twice: 1 connection
# (latency: p50/p99 with no queueing) and 32 connections (throughput). The proxy under test is
# pinned to CPU 1 with one worker thread; wrk and the backend share CPU 0, so requests/s is per
# proxy core. CPU seconds per 1000 requests and peak RSS are read from /proc for the proxy
# process(es); idle RSS is read before the first request. ROUNDS interleaved rounds (every
# proxy in turn, then again), reported as medians; each run also records how much CPU other
# processes on the machine used meanwhile (busy ticks in /proc/stat less the proxy's, the
# backend's and wrk's), since single runs on a shared machine move by about 10%.
#
# Scaling (kvroute with `threads: 2` on two cores against `threads: 1` on one, wrk and the
# backend on cores of their own) needs 4 cores; on 2 or 3 it is estimated from kvroute's CPU per
# request with one thread and with two (see the scaling block below), and said so.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"
SECS=${1:-8}
OUT=${2:-bench/runs/overhead}
ROUNDS=${3:-3}
mkdir -p "$OUT"
need_tools "apt-get install nginx wrk" nginx wrk taskset python3
build_release -p kvroute --bin kvroute --example bare_pingora
KVROUTE=$(release_bin kvroute)
BARE=$(release_bin examples/bare_pingora)
start_work overhead

BACKEND_JSON=18301   # answers chat completions as JSON
BACKEND_SSE=18302    # answers chat completions as an SSE stream
NGINX_RR=18310
KV=18320
KV_ADMIN=18321
BARE_PORT=18330
BARE_BUF_PORT=18331  # the bare proxy reading the whole body first (BARE_BUFFER_BODY=1)
FLOOR_PORT=18332     # ... and with kvroute's upstream timeouts (BARE_TIMEOUTS=1)
SGL=18340
SGL_PROM=18341
SGL_PY=bench/.venv-peers/bin/python

# Streams are sent chunked, as vLLM and SGLang send them. nginx's return would set a
# Content-Length, which bare Pingora passes through in one write, while kvroute (which may strip
# the usage event it asked for) re-chunks: header, chunk and last chunk as three writes. The
# no-op sub_filter is what makes nginx drop the length and chunk the body.
SSE_BODY='data: {"choices":[{"delta":{"content":"o"},"index":0}]}\n\ndata: {"choices":[{"delta":{"content":"k"},"index":0}]}\n\ndata: [DONE]\n\n'
SSE_SERVER="  server {
    listen 127.0.0.1:$BACKEND_SSE;
    location / {
      default_type text/event-stream;
      sub_filter_types text/event-stream;
      sub_filter 'no-such-text' 'no-such-text';
      return 200 '$SSE_BODY';
    }
  }"
nginx_conf backend "$(chat_backend $BACKEND_JSON)" "$SSE_SERVER"
rr_conf() { nginx_conf rr "$(nginx_proxy "127.0.0.1:$NGINX_RR" "$1")"; } # $1 backend port
kv_conf() { # $1 backend port, $2 worker threads (default 1)
  { pingora_yaml kv "${2:-1}"; kvroute_yaml $KV $KV_ADMIN "$1"; } > "$WORK/kv.yaml"
}
for b in bare bare_buffered floor; do pingora_yaml $b 1 > "$WORK/$b.yaml"; done

start_nginx "$LOAD_CPU" backend
wait_port $BACKEND_JSON 100

for size in 1000 100000; do
  chat_request "$WORK/body_${size}_plain" $size false
  chat_request "$WORK/body_${size}_stream" $size true
done

RESULTS="$WORK/results.jsonl"
: > "$RESULTS"
declare -A IDLE_RSS
run_case() { # $1 proxy name, $2 url port, $3 body file stem, $4 round, $5.. pids to account
  local name=$1 port=$2 stem=$3 round=$4; shift 4
  local url="http://127.0.0.1:$port/v1/chat/completions" bk_pids
  read -r -a bk_pids <<< "$(nginx_pids backend)"
  if [ $# -gt 0 ] && [ -z "${IDLE_RSS[$name]:-}" ]; then IDLE_RSS[$name]=$(rss_kib "$@"); fi
  taskset -c "$LOAD_CPU" wrk -t1 -c1 -d"${SECS}s" --latency -s "$stem.lua" "$url" > "$WORK/lat.txt"
  local before; before=$(cpu_ticks "$@")
  local bk_before; bk_before=$(cpu_ticks "${bk_pids[@]}")
  local busy_before; busy_before=$(busy_ticks)
  /usr/bin/time -f "%U %S" -o "$WORK/wrk.time" \
    taskset -c "$LOAD_CPU" wrk -t1 -c32 -d"${SECS}s" --latency -s "$stem.lua" "$url" > "$WORK/thr.txt"
  local busy_after; busy_after=$(busy_ticks)
  local bk_after; bk_after=$(cpu_ticks "${bk_pids[@]}")
  local after; after=$(cpu_ticks "$@")
  local rss; rss=$(peak_rss_kib "$@")
  local others=$(( (busy_after - busy_before) - (after - before) - (bk_after - bk_before) ))
  python3 - "$name" "$stem" "$WORK/lat.txt" "$WORK/thr.txt" "$((after - before))" "$(getconf CLK_TCK)" "$rss" \
    "$round" "${IDLE_RSS[$name]:-0}" "$others" "$WORK/wrk.time" "$SECS" >> "$RESULTS" <<'PY'
import json, re, sys
name, stem, lat, thr, ticks, hz, rss, rnd, idle, others, wrk_time, secs = sys.argv[1:]
# Other processes' CPU during the throughput run, in cores: busy ticks less the proxy's, the
# backend's and wrk's own.
u, s = open(wrk_time).read().split()[-2:]
other_cores = max(0.0, int(others) / int(hz) - float(u) - float(s)) / float(secs)
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
    "idle_rss_mib": int(idle) / 1024 if name != "direct" else None,
    "round": int(rnd), "other_cpu_cores": other_cores,
}))
PY
  echo "  round $round $name $(basename "$stem"): done" >&2
}

SGL_VERSION=""
if [ -x "$SGL_PY" ] && "$SGL_PY" -c 'import sglang_router' 2>/dev/null; then
  SGL_VERSION=$("$SGL_PY" -c 'import importlib.metadata as m; print(m.version("sglang-router"))')
else
  echo "overhead.sh: sglang-router not installed ($SGL_PY); its rows are left out" >&2
fi

for round in $(seq "$ROUNDS"); do
for mode in plain stream; do
  backend=$BACKEND_JSON; [ $mode = stream ] && backend=$BACKEND_SSE
  rr_conf $backend; kv_conf $backend
  start_nginx "$PROXY_CPU" rr
  spawn "$PROXY_CPU" "$WORK/kv.err" "$KVROUTE" -c "$WORK/kv.yaml"; KPID=$SPAWNED
  spawn "$PROXY_CPU" "$WORK/bare.err" "$BARE" "$WORK/bare.yaml" "127.0.0.1:$BARE_PORT" "127.0.0.1:$backend"; BPID=$SPAWNED
  BARE_BUFFER_BODY=1 spawn "$PROXY_CPU" "$WORK/bare_buffered.err" \
    "$BARE" "$WORK/bare_buffered.yaml" "127.0.0.1:$BARE_BUF_PORT" "127.0.0.1:$backend"; BBPID=$SPAWNED
  BARE_BUFFER_BODY=1 BARE_TIMEOUTS=1 spawn "$PROXY_CPU" "$WORK/floor.err" \
    "$BARE" "$WORK/floor.yaml" "127.0.0.1:$FLOOR_PORT" "127.0.0.1:$backend"; FPID=$SPAWNED
  SPID=""
  if [ -n "$SGL_VERSION" ]; then
    taskset -c "$PROXY_CPU" "$SGL_PY" -m sglang_router.launch_router --host 127.0.0.1 --port $SGL \
      --policy round_robin --worker-urls "http://127.0.0.1:$backend" --log-level warn \
      --prometheus-host 127.0.0.1 --prometheus-port $SGL_PROM \
      --worker-startup-check-interval 1 >"$WORK/sgl.log" 2>&1 &
    SPID=$!
    wait_port $SGL 100
  fi
  for port in $NGINX_RR $KV $BARE_PORT $BARE_BUF_PORT $FLOOR_PORT; do wait_port "$port" 100; done
  sleep 0.5
  # Idle RSS is read at the first case: let background start-up work (token tables) finish.
  [ "$round" = 1 ] && sleep 2
  read -r -a RRPIDS <<< "$(nginx_pids rr)"
  for size in 1000 100000; do
    stem="$WORK/body_${size}_${mode}"
    run_case direct $backend "$stem" "$round"
    run_case nginx_rr $NGINX_RR "$stem" "$round" "${RRPIDS[@]}"
    run_case pingora_bare $BARE_PORT "$stem" "$round" "$BPID"
    run_case pingora_bare_buffered $BARE_BUF_PORT "$stem" "$round" "$BBPID"
    run_case pingora_floor $FLOOR_PORT "$stem" "$round" "$FPID"
    run_case kvroute $KV "$stem" "$round" "$KPID"
    # shellcheck disable=SC2046 # the router's pid and its children's, one argument each
    [ -n "$SPID" ] && run_case sglang_router_rr $SGL "$stem" "$round" "$SPID" $(pgrep -P "$SPID" | tr '\n' ' ')
  done
  # shellcheck disable=SC2086 # SPID is empty when sglang-router is not installed
  kill "$KPID" "$BPID" "$BBPID" "$FPID" $SPID; wait "$KPID" "$BPID" "$BBPID" "$FPID" $SPID 2>/dev/null || true
  stop_nginx rr; sleep 0.3
done
done

# Scaling: one kvroute worker thread on one core, then two on two, 1 KB chat; wrk and the
# backend keep cores of their own.
SCALING="$WORK/scaling.txt"
if [ "$(nproc)" -ge 4 ]; then
  for threads in 1 2; do
    kv_conf $BACKEND_JSON $threads
    cores=$([ "$threads" = 1 ] && echo 1 || echo 1,2)
    spawn "$cores" "$WORK/kv.err" "$KVROUTE" -c "$WORK/kv.yaml"; KPID=$SPAWNED
    wait_port $KV 100; sleep 0.5
    taskset -c 0,3 wrk -t2 -c64 -d"${SECS}s" -s "$WORK/body_1000_plain.lua" \
      "http://127.0.0.1:$KV/v1/chat/completions" | awk -v t="$threads" '/Requests\/sec/{print t, $2}' >> "$SCALING"
    kill "$KPID"; wait "$KPID" 2>/dev/null || true
  done
else
  # Two cores cannot hold two kvroute threads and a load generator apart. Estimate instead from
  # CPU per request, three ways per proxy: one thread pinned as above ("1p"); one thread
  # sharing both cores with wrk and the backend ("1s"); two threads sharing them the same way
  # ("2s"). If a request costs as much CPU with two threads running at once as with one under
  # the same sharing, nothing serialises them and two cores of their own would give 2x. 1p
  # against 2s is a lower bound (the two-thread cost also carries the sharing: preemption, cache
  # misses); 1s against 2s leaves the sharing on both sides, so what remains is what a second
  # thread costs. The bare Pingora proxy, measured the same ways, shows how much is the machine.
  # Interleaved, ROUNDS times (at least 3: single runs on this machine move by 10-30%).
  SCALE_ROUNDS=$(( ROUNDS > 3 ? ROUNDS : 3 ))
  for _ in $(seq "$SCALE_ROUNDS"); do
  for proxy in pingora_bare kvroute; do
  for mode in 1p 1s 2s; do
    threads=${mode%?}
    cores=$([ "$mode" = 1p ] && echo 1 || echo 0,1)
    if [ $proxy = kvroute ]; then
      kv_conf $BACKEND_JSON "$threads"; port=$KV
      spawn "$cores" "$WORK/kv.err" "$KVROUTE" -c "$WORK/kv.yaml"
    else
      sed "s/^threads: .*/threads: $threads/" "$WORK/bare.yaml" > "$WORK/bare_scale.yaml"; port=$BARE_PORT
      spawn "$cores" "$WORK/bare.err" "$BARE" "$WORK/bare_scale.yaml" "127.0.0.1:$BARE_PORT" "127.0.0.1:$BACKEND_JSON"
    fi
    KPID=$SPAWNED; wait_port $port 100; sleep 0.5
    before=$(cpu_ticks "$KPID")
    if [ "$mode" = 1p ]; then wcores=0; wthreads=1; else wcores=0,1; wthreads=2; fi
    taskset -c "$wcores" wrk -t"$wthreads" -c32 -d"${SECS}s" \
      -s "$WORK/body_1000_plain.lua" "http://127.0.0.1:$port/v1/chat/completions" > "$WORK/scale.txt"
    after=$(cpu_ticks "$KPID")
    awk -v p=$proxy -v m="$mode" -v ticks=$((after - before)) -v hz="$(getconf CLK_TCK)" \
      '/requests in/{n=$1} /Requests\/sec/{r=$2} END{printf "estimate %s %s %s %.4f\n", p, m, r, ticks/hz/n*1000}' \
      "$WORK/scale.txt" >> "$SCALING"
    kill "$KPID"; wait "$KPID" 2>/dev/null || true
  done
  done
  done
fi

python3 - "$RESULTS" "$OUT" "$SECS" "$ROUNDS" "$SCALING" "$SGL_VERSION" <<'PY'
import json, sys, os, statistics
runs = [json.loads(l) for l in open(sys.argv[1])]
out, secs, rounds, scaling, sgl = sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
keys = ["p50_ms_c1", "p99_ms_c1", "rps_c32", "p50_ms_c32", "p99_ms_c32", "cpu_s_per_1000",
        "peak_rss_mib", "idle_rss_mib", "other_cpu_cores"]
groups = {}
for r in runs:
    groups.setdefault((r["body_bytes"], r["stream"], r["proxy"]), []).append(r)
order = ["direct", "nginx_rr", "pingora_bare", "pingora_bare_buffered", "pingora_floor", "kvroute", "sglang_router_rr"]
rows = []
for (size, stream, proxy), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0], order.index(kv[0][2]))):
    row = {"proxy": proxy, "body_bytes": size, "stream": stream, "runs": len(rs),
           "non_2xx": sum(r["non_2xx"] for r in rs)}
    for k in keys:
        vals = [r[k] for r in rs if r.get(k) is not None]
        row[k] = statistics.median(vals) if vals else None
    row["rps_c32_runs"] = [r["rps_c32"] for r in rs]
    rows.append(row)
json.dump({"runs": runs, "medians": rows, "scaling": open(scaling).read()}, open(os.path.join(out, "overhead.json"), "w"), indent=1)
def f(v, d=2):
    return "n/a" if v is None else f"{v:.{d}f}"
def find(proxy, r):
    return next((x for x in rows if x["proxy"] == proxy and x["body_bytes"] == r["body_bytes"] and x["stream"] == r["stream"]), None)
others = max((r["other_cpu_cores"] for r in runs), default=0.0)
lines = [f"Proxy cost, loopback, wrk {secs} s per case, medians of {rounds} interleaved rounds; proxy pinned to 1 core (1 worker), wrk + backend on the other. "
         f"Other processes used at most {others:.2f} of a core during any throughput run (median per row below)." +
         (f" sglang-router {sgl}." if sgl else " sglang-router not installed here."), "",
         "| body | stream | proxy | p50 ms (c=1) | added p50 ms | p99 ms (c=1) | req/s (c=32) | req/s runs | vs nginx | vs bare Pingora | vs floor | p99 ms (c=32) | CPU s / 1000 req | idle / peak RSS MiB | other CPU (cores) | non-2xx |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
for r in rows:
    direct, nginx, bare = find("direct", r), find("nginx_rr", r), find("pingora_bare", r)
    proxied = r["proxy"] != "direct"
    added = r["p50_ms_c1"] - direct["p50_ms_c1"] if proxied else None
    ratio = r["rps_c32"] / nginx["rps_c32"] if proxied else None
    vs_bare = r["rps_c32"] / bare["rps_c32"] if bare and proxied else None
    floor = find("pingora_floor", r)
    vs_floor = r["rps_c32"] / floor["rps_c32"] if floor and proxied else None
    size = "1 KB" if r["body_bytes"] == 1000 else "100 KB"
    rss = f"{f(r['idle_rss_mib'],1)} / {f(r['peak_rss_mib'],1)}" if proxied else "n/a"
    each = ", ".join(f"{v:.0f}" for v in r["rps_c32_runs"])
    lines.append(f"| {size} | {'yes' if r['stream'] else 'no'} | {r['proxy']} | {f(r['p50_ms_c1'],3)} | {f(added,3)} | {f(r['p99_ms_c1'],3)} | {r['rps_c32']:.0f} | {each} | {f(ratio)} | {f(vs_bare)} | {f(vs_floor)} | {f(r['p99_ms_c32'])} | {f(r['cpu_s_per_1000'],3)} | {rss} | {f(r['other_cpu_cores'])} | {r['non_2xx']} |")
sc = open(scaling).read().strip()
lines += ["", "Scaling (kvroute, 1 KB chat, `threads: 1` on one core against `threads: 2` on two):", ""]
if sc.startswith("estimate"):
    v = {}
    for l in sc.splitlines():
        _, p, m, r, c = l.split()
        v.setdefault((p, m), []).append((float(r), float(c)))
    med = {k: (statistics.median(r for r, _ in xs), statistics.median(c for _, c in xs), len(xs)) for k, xs in v.items()}
    n = min(x[2] for x in med.values())
    lines.append(f"This machine has {os.cpu_count()} cores, too few to give two proxy threads and the load generator cores of their own "
                 "(that needs 4). Estimated from CPU per request instead (medians of " + str(n) + " interleaved runs): one thread pinned to one core "
                 "with wrk and the backend on the other (1p); one thread sharing both cores with wrk and the backend (1s); two threads sharing "
                 "them the same way (2s). Two cores of their own would give about 2 x (CPU per request, 1 thread) / (CPU per request, 2 threads) "
                 "one core's requests/s. Against 1p that is a lower bound (the two-thread cost also carries the core sharing: preemption, "
                 "cache misses); against 1s the sharing is on both sides, and what remains is what a second thread costs (locks, "
                 "shared cache lines). The bare Pingora proxy, measured the same ways, shows how much of it is the machine.")
    lines += ["", "| proxy | 1p: CPU s / 1000 req (req/s) | 1s | 2s | estimated 2-core scaling from 1p (lower bound) | from 1s |", "|---|---|---|---|---|---|"]
    for p in ("pingora_bare", "kvroute"):
        (r1, c1, _), (rs, cs, _), (r2, c2, _) = med[(p, "1p")], med[(p, "1s")], med[(p, "2s")]
        lines.append(f"| {p} | {c1:.4f} ({r1:.0f}) | {cs:.4f} ({rs:.0f}) | {c2:.4f} ({r2:.0f}) | {2 * c1 / c2:.2f}x | {2 * cs / c2:.2f}x |")
else:
    v = dict(l.split() for l in sc.splitlines())
    lines.append(f"1 thread {float(v['1']):.0f} req/s, 2 threads {float(v['2']):.0f} req/s: {float(v['2'])/float(v['1']):.2f}x")
open(os.path.join(out, "overhead.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
echo "written: $OUT/overhead.md $OUT/overhead.json" >&2
