#!/usr/bin/env bash
# Paired A/B of two kvroute binaries on the proxy path: requests/s, p50 and CPU per request.
# Used by: docs/results/proxy-cost.md
#
# Both run side by side (one worker thread each, pinned to CPU 1, default policy) in front of
# one nginx `return` backend; wrk on CPU 0 drives them in turn (old first in odd rounds, new
# first in even ones), ROUNDS rounds, 1 KB and 100 KB chat bodies:
# `wrk -c32 -d6s` (requests/s, and the proxy's CPU per request over that run, from
# /proc/PID/stat) then `wrk -c1 -d4s --latency` (p50). Prints every run and the medians, and
# each binary's peak RSS. Loopback only.
#
#   bench/scripts/ab.sh OLD_KVROUTE NEW_KVROUTE [ROUNDS=3] [OUT=bench/runs/ab/ab.txt]
#
# Both run with RUST_LOG=warn (no access log) unless AB_RUST_LOG says otherwise:
# AB_RUST_LOG=info measures them as shipped, writing an access line a request (to a file here).
# AB_H2C=1 drives them over HTTP/2 with prior knowledge (h2c on, h2load -c32 -m1 for req/s
# and CPU, and h2load -c1's mean request time in the p50 column).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"
OLD=${1:?old kvroute binary}; NEW=${2:?new kvroute binary}
ROUNDS=${3:-3}; OUT=${4:-bench/runs/ab/ab.txt}
need_tools "" nginx wrk taskset python3
H2C=${AB_H2C:-0}
[ "$H2C" = 1 ] && need_tools "Debian: nghttp2-client" h2load
start_work ab
BACKEND=18701
declare -A PORT=([old]=18710 [new]=18720) PID
nginx_conf backend "$(chat_backend $BACKEND)"
for v in old new; do
  {
    pingora_yaml "$v" 1
    kvroute_yaml "${PORT[$v]}" $((PORT[$v] + 1)) $BACKEND
    echo "  limits: {max_connections: 100000}"
    [ "$H2C" = 1 ] && echo "  h2c: true"
  } > "$WORK/$v.yaml"
done
for size in 1000 100000; do chat_request "$WORK/body$size" $size; done
HZ=$(getconf CLK_TCK)
start_nginx "$LOAD_CPU" backend
SPAWN_LOG=${AB_RUST_LOG:-warn} spawn "$PROXY_CPU" "$WORK/old.err" "$OLD" -c "$WORK/old.yaml"; PID[old]=$SPAWNED
SPAWN_LOG=${AB_RUST_LOG:-warn} spawn "$PROXY_CPU" "$WORK/new.err" "$NEW" -c "$WORK/new.yaml"; PID[new]=$SPAWNED
for port in $BACKEND "${PORT[@]}"; do wait_port "$port"; done; sleep 1
mkdir -p "$(dirname "$OUT")"
{
  echo "# AB_H2C=$H2C bench/scripts/ab.sh $OLD $NEW $ROUNDS"
  echo "# columns: round body_bytes build req_per_s_c32 p50_c1 cpu_us_per_req_c32"
} > "$OUT"
for round in $(seq "$ROUNDS"); do
  # Alternate which binary goes first: run in one fixed order, the second one measured up to
  # 1.13x faster at 1 KB than the same binary first (bench/results/overhead-17).
  order="old new"; [ $((round % 2)) = 0 ] && order="new old"
  for size in 1000 100000; do
    for v in $order; do
      url="http://127.0.0.1:${PORT[$v]}/v1/chat/completions"
      cpu0=$(cpu_ticks "${PID[$v]}")
      if [ "$H2C" = 1 ]; then
        h2() { taskset -c "$LOAD_CPU" h2load -m1 -H 'content-type: application/json' -d "$WORK/body$size.json" "$@" "$url"; }
        res=$(h2 -c32 -D6)
        rps=$(awk '/^finished in/{print $4}' <<<"$res")
        reqs=$(awk '/^requests:/{print $8}' <<<"$res")
      else
        res=$(taskset -c "$LOAD_CPU" wrk -t1 -c32 -d6s -s "$WORK/body$size.lua" "$url")
        rps=$(awk '/Requests\/sec/{print $2}' <<<"$res")
        reqs=$(awk '/requests in/{print $1}' <<<"$res")
      fi
      cpu1=$(cpu_ticks "${PID[$v]}")
      cpu_us=$(awk -v t=$((cpu1 - cpu0)) -v n="$reqs" -v hz="$HZ" 'BEGIN{printf "%.1f", (n > 0 ? t / hz / n * 1e6 : 0)}')
      if [ "$H2C" = 1 ]; then
        p50=$(h2 -c1 -D4 | awk '/^time for request:/{print $6}')
      else
        p50=$(taskset -c "$LOAD_CPU" wrk -t1 -c1 -d4s --latency -s "$WORK/body$size.lua" "$url" | awk '/ 50%/{print $2}')
      fi
      echo "$round $size $v $rps $p50 $cpu_us" | tee -a "$OUT"
    done
  done
done
# Peak RSS over the whole run, the 32-connection 100 KB runs included.
mib() { awk -v k="$1" 'BEGIN{printf "%.1f", k / 1024}'; }
echo "# peak RSS MiB: old $(mib "$(peak_rss_kib "${PID[old]}")") new $(mib "$(peak_rss_kib "${PID[new]}")")" | tee -a "$OUT"
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
