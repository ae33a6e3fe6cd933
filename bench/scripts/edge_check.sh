#!/usr/bin/env bash
# Edge check: the probes of issue 38 as a repeatable run against kvroute in front of three
# simulated servers, all on 127.0.0.1.
# Used by: docs/results/edge.md
#
#   bench/scripts/edge_check.sh [KVROUTE=release kvroute] [OUT=bench/runs/edge]
#
# - parse bomb (first): one 29 MB body of 10^6 one-character messages; the status and
#   kvroute's peak RSS (VmHWM) above idle;
# - body memory: 8 connections each declare a 30 MB chat body and stall 10 bytes before its
#   end, held 5 s; kvroute's RSS above idle at its peak, and how each was answered;
# - smuggling: CL.TE, an obfuscated Transfer-Encoding, duplicate Content-Length, no Host.
# Writes OUT/README.md (the table) and OUT/*.json (each probe's answers).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"
need_tools "Debian: python3, curl" python3 curl

KVROUTE=${1:-$(release_bin kvroute)}
KVBENCH=${KVBENCH:-$(release_bin kvbench)}
OUT=${2:-bench/runs/edge}
BASE_PORT=${BASE_PORT:-19300}
LISTEN=$((BASE_PORT + 80)); ADMIN=$((BASE_PORT + 90))
PROBE="python3 bench/scripts/edge_probe.py"
rm -rf "$OUT" && mkdir -p "$OUT"
start_work edge

spawn "" "$WORK/sim.err" "$KVBENCH" sim --servers 3 --base-port "$BASE_PORT" --profile h100-llama8b
for p in "$BASE_PORT" $((BASE_PORT + 1)) $((BASE_PORT + 2)); do
  wait_port "$p" || die "the simulator never listened: $(cat "$WORK/sim.err")"
done
{
  pingora_yaml kv 2
  kvroute_yaml "$LISTEN" "$ADMIN" "$BASE_PORT" $((BASE_PORT + 1)) $((BASE_PORT + 2))
  printf '  health_check:\n    interval_ms: 500\n'
} > "$OUT/kvroute.yaml"
spawn "" "$WORK/kvroute.err" "$KVROUTE" -c "$OUT/kvroute.yaml"; KV_PID=$SPAWNED
wait_http 100 "http://127.0.0.1:$ADMIN/readyz" || die "kvroute never ready: $(cat "$WORK/kvroute.err")"
curl -sf "http://127.0.0.1:$LISTEN/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"model":"sim-llama-8b","max_tokens":1,"messages":[{"role":"user","content":"warm"}]}' >/dev/null
sleep 1
rss() { awk -v k="$2:" '$1 == k {print $2}' "/proc/$1/status"; }
IDLE=$(rss "$KV_PID" VmRSS)

# Parse bomb, first: the peak RSS (VmHWM) it leaves is its own.
$PROBE parse-bomb "$LISTEN" 1000000 > "$OUT/parse-bomb.json"
HWM_AFTER=$(rss "$KV_PID" VmHWM)
BOMB_MIB=$(( (HWM_AFTER - IDLE) / 1024 ))
BOMB=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["answer"])' "$OUT/parse-bomb.json")

sleep 1
# Body memory: the highest RSS while the stalled bodies are held.
$PROBE stalled-bodies "$LISTEN" 8 30000000 5 > "$OUT/stalled-bodies.json" &
PROBE_PID=$!
PEAK=$IDLE
while kill -0 "$PROBE_PID" 2>/dev/null; do
  r=$(rss "$KV_PID" VmRSS); [ "$r" -gt "$PEAK" ] && PEAK=$r
  sleep 0.2
done
wait "$PROBE_PID"
STALLED_MIB=$(( (PEAK - IDLE) / 1024 ))
ANSWERS=$(python3 -c 'import json,sys,collections; a=json.load(open(sys.argv[1]))["answers"]; print(", ".join(f"{n} x {k}" for k,n in collections.Counter(a).items()))' "$OUT/stalled-bodies.json")

$PROBE smuggle "$LISTEN" > "$OUT/smuggle.json"
SMUGGLE=$(python3 -c 'import json,sys; a=json.load(open(sys.argv[1]))["answers"]; print("; ".join(f"{k}: {v}" for k,v in a.items()))' "$OUT/smuggle.json")
kill -0 "$KV_PID" || die "kvroute died: $(tail -5 "$WORK/kvroute.err")"

{
  echo "# Edge check"
  echo
  echo "kvroute idle RSS ${IDLE} KiB."
  echo
  echo "| probe | answered | kvroute RSS above idle |"
  echo "|---|---|---|"
  echo "| 8 x 30 MB bodies stalled 10 bytes short, 5 s | $ANSWERS | ${STALLED_MIB} MiB at peak |"
  echo "| 29 MB body of 10^6 tiny messages | $BOMB | ${BOMB_MIB} MiB peak (VmHWM) |"
  echo "| smuggling | $SMUGGLE | |"
} > "$OUT/README.md"
cat "$OUT/README.md"
