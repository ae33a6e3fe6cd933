#!/usr/bin/env bash
# Soak: requests failed, in flight on killed backends, and kvroute's RSS over 10 minutes of kills.
# Used by: docs/results/reliability.md
#
# The Mooncake trace through kvroute at ~80% of a 4-server simulated H100 fleet's prefill
# capacity (the trace offers ~54k prompt tokens/s at 1x; 4 x 25k tok/s = 100k; 1.5x is ~80%)
# for DURATION_S seconds, killing one backend (kill -9) and restarting it every minute, in turn
# (KILL_EVERY_S=0: no kills), and freezing one (SIGSTOP, then SIGCONT FREEZE_S seconds later)
# at FREEZE_AT_S (FREEZE_S=0: no freeze). Every reply's text is checked against the
# simulator's deterministic one (`replay --check-text`): a stream continued on another backend
# must read as an unbroken one. API=chat|responses|messages|mixed picks the API the replay
# speaks (mixed: each conversation Responses or Messages); CUT_RATE drops that fraction of the
# simulators' streams once mid-response (a lost connection, the engine alive).
#
# Reports requests sent and failed, the in-flight count on each backend just before it was
# killed, streams migrated and their gaps, and kvroute's RSS at start and end. Writes
# OUT/README.md (OUT default bench/runs/soak). Needs release binaries:
#   cargo build --release --workspace && bench/scripts/soak.sh
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"

DURATION_S=${DURATION_S:-600}
SPEEDUP=${SPEEDUP:-1.5}
KILL_EVERY_S=${KILL_EVERY_S:-60}
FREEZE_AT_S=${FREEZE_AT_S:-90}
FREEZE_S=${FREEZE_S:-60}
# Server 3 is killed at 240 s and 480 s only: its freeze (90-150 s) never meets a kill.
FREEZE_IDX=${FREEZE_IDX:-3}
API=${API:-chat}
CUT_RATE=${CUT_RATE:-0}
BASE_PORT=${BASE_PORT:-19100}
N=4
BIN=${CARGO_TARGET_DIR:-target}/release
OUT=${OUT:-bench/runs/soak}
LISTEN=127.0.0.1:$((BASE_PORT + 80))
ADMIN=127.0.0.1:$((BASE_PORT + 90))
rm -rf "$OUT" && mkdir -p "$OUT"
RUN=$(mktemp -d)

declare -a SIM_PIDS
start_sim() {
  "$BIN/kvbench" sim --servers 1 --base-port $((BASE_PORT + $1)) --profile h100-llama8b \
    --cut-rate "$CUT_RATE" \
    >> "$RUN/sim$1.log" 2>&1 &
  SIM_PIDS[$1]=$!
}
# The simulators, kvroute and the replay; RUN (the simulators' logs) stays when a run fails.
trap stop_jobs EXIT

backends=()
for i in $(seq 0 $((N - 1))); do start_sim "$i"; backends+=($((BASE_PORT + i))); done
{
  printf 'version: 1\nthreads: 2\npid_file: %s/kvroute.pid\nupgrade_sock: %s/upgrade.sock\n' "$RUN" "$RUN"
  echo "grace_period_seconds: 0"
  kvroute_yaml "${LISTEN##*:}" "${ADMIN##*:}" "${backends[@]}"
  printf '  health_check:\n    interval_ms: 500\n'
} > "$OUT/kvroute.yaml"
RUST_LOG=warn "$BIN/kvroute" -c "$OUT/kvroute.yaml" 2> "$OUT/kvroute.log" &
KV_PID=$!
wait_http 100 "http://$ADMIN/readyz" || true
sleep 1
RSS_START=$(ps -o rss= -p "$KV_PID" | tr -d ' ')

"$BIN/kvbench" replay --target "http://$LISTEN" --workload mooncake --trace-speedup "$SPEEDUP" \
  --duration-s "$DURATION_S" --grace-s 120 --out "$OUT/replay" --label soak --check-text \
  --api "$API" \
  > "$RUN/replay.log" 2>&1 &
REPLAY_PID=$!

# RSS and requests in flight every 10 s: growth that tracks load is buffers, growth that does
# not come back down with it would be a leak.
(
  echo "t_s,rss_kib,inflight"
  s=0
  while kill -0 "$REPLAY_PID" 2>/dev/null; do
    inflight=$(curl -fs "http://$ADMIN/metrics" \
      | awk '$1 ~ /^kvroute_backend_inflight_requests/ { n += $2 } END { print n + 0 }')
    echo "$s,$(ps -o rss= -p "$KV_PID" | tr -d ' '),$inflight"
    sleep 10
    s=$((s + 10))
  done
) > "$OUT/rss.csv" &

if (( FREEZE_S > 0 )); then
  (
    sleep "$FREEZE_AT_S"
    kill -STOP "${SIM_PIDS[$FREEZE_IDX]}"
    echo "t=${FREEZE_AT_S}s froze 127.0.0.1:$((BASE_PORT + FREEZE_IDX)) for ${FREEZE_S}s"
    sleep "$FREEZE_S"
    kill -CONT "${SIM_PIDS[$FREEZE_IDX]}"
  ) &
  FREEZE="server $FREEZE_IDX frozen (SIGSTOP) at ${FREEZE_AT_S} s for ${FREEZE_S} s"
else
  FREEZE="no freeze"
fi

KILLS=""
t=0
while (( KILL_EVERY_S > 0 && t + KILL_EVERY_S < DURATION_S )); do
  sleep "$KILL_EVERY_S"
  t=$((t + KILL_EVERY_S))
  i=$(( (t / KILL_EVERY_S - 1) % N ))
  addr="127.0.0.1:$((BASE_PORT + i))"
  inflight=$(curl -fs "http://$ADMIN/metrics" \
    | awk -v b="kvroute_backend_inflight_requests{backend=\"$addr\"}" '$1 == b { print $2 }')
  kill -9 "${SIM_PIDS[$i]}"
  wait "${SIM_PIDS[$i]}" 2>/dev/null || true
  echo "t=${t}s killed $addr with ${inflight:-0} requests in flight"
  KILLS="$KILLS| ${t} | $addr | ${inflight:-0} |"$'\n'
  sleep 2
  start_sim "$i"
done
wait "$REPLAY_PID"
RSS_END=$(ps -o rss= -p "$KV_PID" | tr -d ' ')
curl -fs "http://$ADMIN/metrics" > "$OUT/metrics.txt"

python3 - "$OUT" "$RSS_START" "$RSS_END" "$DURATION_S" "$SPEEDUP" "$KILLS" "$KILL_EVERY_S" "$FREEZE" "$API" "$CUT_RATE" <<'PY'
import json, sys
out, rss0, rss1, dur, speedup, kills, every, freeze, api, cut_rate = sys.argv[1:11]
r = json.load(open(f"{out}/replay/report.json"))
s = r["summary"]
def metric(name):
    tot = 0.0
    for line in open(f"{out}/metrics.txt"):
        if line.startswith(name) and not line.startswith("#"):
            tot += float(line.rsplit(" ", 1)[1])
    return tot
cut = metric("kvroute_cut_streams_total")
migrated = metric('kvroute_migrations_total{outcome="migrated"}')
not_migrated = metric("kvroute_migrations_total") - migrated
mangled = sum(1 for rec in r.get("records", [])
              if "text differs from an unbroken stream" in (rec.get("error") or ""))
if r.get("records_omitted"):
    mangled = "n/a (records omitted)"
def gap_quantiles(cause, qs=(0.5, 0.99)):
    # From the histogram's cumulative buckets (all backends): the upper bound of the bucket
    # where each quantile falls.
    buckets = {}
    for line in open(f"{out}/metrics.txt"):
        if line.startswith("kvroute_migration_gap_seconds_bucket") and f'cause="{cause}"' in line:
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[le] = buckets.get(le, 0.0) + float(line.rsplit(" ", 1)[1])
    order = sorted(buckets, key=lambda le: float("inf") if le == "+Inf" else float(le))
    total = buckets.get("+Inf", 0.0)
    if total == 0:
        return "-"
    out_q = []
    for q in qs:
        le = next(le for le in order if buckets[le] >= q * total)
        out_q.append("<= " + ("inf" if le == "+Inf" else f"{float(le) * 1000:.0f} ms"))
    return f"{int(total)} ({', '.join(out_q)})"
gaps = {c: gap_quantiles(c) for c in ("connection", "silent", "engine_error", "backend_down")}
outcomes = {}
for line in open(f"{out}/metrics.txt"):
    if line.startswith("kvroute_migrations_total{"):
        label = line.split('outcome="', 1)[1].split('"', 1)[0]
        n = float(line.rsplit(" ", 1)[1])
        if n:
            outcomes[label] = outcomes.get(label, 0) + int(n)
outcomes = ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())) or "none"
failed_attempts = metric("kvroute_upstream_failures_total")
retried = metric('kvroute_retries_total{outcome="retried"}')
ejections = metric("kvroute_outlier_ejections_total")
rows = [l.strip().split(",") for l in open(f"{out}/rss.csv").readlines()[1:] if l.strip()]
rows = [(int(t), int(r), float(n)) for t, r, n in rows if r]
peak_at, peak_rss, peak_inflight = max(rows, key=lambda x: x[1]) if rows else (0, 0, 0)
peak_inflight = int(peak_inflight)
in_flight_at_kills = sum(int(float(row.split("|")[3])) for row in kills.strip().splitlines() if row)
text = f"""# Soak run

`bench/scripts/soak.sh` (DURATION_S={dur}, SPEEDUP={speedup}, KILL_EVERY_S={every}): the Mooncake trace at {speedup}x
through kvroute (kv_aware) to 4 simulated H100 servers, one killed (kill -9) and restarted
(2 s later) every {every} s in turn (0: none); {freeze}; API {api}; a fraction {cut_rate} of the
streams dropped once mid-response (CUT_RATE). Every reply's text checked against the
simulator's (`replay --check-text`).

| requests sent | failed (errors + timeouts) | of which text mangled | in flight on killed backends | streams migrated | cut, not migrated | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | cache hit | kvroute RSS start / end |
|---|---|---|---|---|---|---|---|---|---|---|
| {s['requests']} | {s['errors']} + {s['timeouts']} | {mangled} | {in_flight_at_kills} | {migrated:.0f} | {not_migrated:.0f} | {s['ttft_p50_ms']:.0f} | {s['ttft_p90_ms']:.0f} | {s['ttft_p99_ms']:.0f} | {s['cache_hit_rate']:.3f} | {int(rss0)//1024} / {int(rss1)//1024} MiB |

Migrated streams' gaps (last event before the failure to the first of the continuation,
kvroute's `kvroute_migration_gap_seconds`: count and the bucket bounds of p50, p99), by how
the backend failed: connection closed {gaps['connection']}; silent past the read deadline
{gaps['silent']}; engine error event {gaps['engine_error']}; cut while silent on a backend the
health check found down {gaps['backend_down']}.

Every migration decision (`kvroute_migrations_total` by outcome): {outcomes}.

Kills (time, backend, requests in flight on it just before):

| t s | backend | in flight |
|---|---|---|
{kills.strip()}

RSS and requests in flight every 10 s: `rss.csv` (peak RSS {peak_rss // 1024} MiB at
{peak_at} s with {peak_inflight} in flight; at the end {int(rss1)//1024} MiB).

kvroute counted {cut:.0f} streams cut mid-response, {failed_attempts:.0f} failed upstream
attempts, {retried:.0f} retries and {ejections:.0f} ejections. Full report: `replay/report.md`.
"""
open(f"{out}/README.md", "w").write(text)
print(text)
PY
rm -rf "$RUN"
