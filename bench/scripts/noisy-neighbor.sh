#!/usr/bin/env bash
# Noisy neighbor: one tenant floods a saturated fleet with long prompts while four others send
# steady short chat; what do the four see, with the router queue's fair share (least attained
# service first) and without it (first come first served)?
# Used by: docs/results/tenants.md
#
# Two simulated H100 servers (`kvbench sim --profile h100-llama8b`) behind kvroute with
# `limits.backend_max_inflight: 4`, so requests past eight in flight wait in kvroute's router
# queue rather than in the engines'. The flooder (`x-tenant-id: flood`) runs FLOOD_WORKERS
# closed-loop workers of 8-30k-token prompts; each steady tenant (`steady-0`..`steady-3`) one
# worker of ~500-token prompts. Two runs of DURATION_S seconds each, on a fresh fleet:
# `fair` (the default config) and `fifo` (`tenants.fair_share` weights 0: no tenant is ever
# charged, so the queue is first come first served inside a band). Writes
# OUT/README.md (OUT default bench/runs/noisy-neighbor). Needs release binaries:
#   cargo build --release --workspace && bench/scripts/noisy-neighbor.sh
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"

DURATION_S=${DURATION_S:-60}
SERVERS=${SERVERS:-8}
# Past the fleet's places (4 a server), so the flood always has requests waiting.
FLOOD_WORKERS=${FLOOD_WORKERS:-$((SERVERS * 6))}
BASE_PORT=${BASE_PORT:-19300}
BIN=${CARGO_TARGET_DIR:-target}/release
OUT=${OUT:-bench/runs/noisy-neighbor}
LISTEN=127.0.0.1:$((BASE_PORT + 80))
ADMIN=127.0.0.1:$((BASE_PORT + 90))
rm -rf "$OUT" && mkdir -p "$OUT"
start_work noisy-neighbor

# Prompts: unique text per request (nothing cached), sized in the simulator's tokens (4 bytes).
python3 - "$WORK" <<'PY'
import json, random, sys
work = sys.argv[1]
rng = random.Random(7)
words = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud".split()
def text(tokens, tag):
    out, n = [tag], len(tag)
    while n < tokens * 4:
        w = rng.choice(words)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)
with open(f"{work}/flood.jsonl", "w") as f:
    for i in range(1500):
        f.write(json.dumps({"text": text(rng.randint(8000, 30000), f"flood {i}"), "output_length": 16}) + "\n")
for t in range(4):
    with open(f"{work}/steady-{t}.jsonl", "w") as f:
        for i in range(400):
            f.write(json.dumps({"text": text(500, f"steady {t} {i}"), "output_length": 64}) + "\n")
PY

run() {
  local name=$1 tenants=$2 flood=$3 dir="$OUT/$1"
  mkdir -p "$dir"
  "$BIN/kvbench" sim --servers "$SERVERS" --base-port "$BASE_PORT" --profile h100-llama8b \
    > "$WORK/sim-$name.log" 2>&1 &
  local sim=$!
  {
    printf 'version: 1\nthreads: 2\npid_file: %s/kvroute.pid\nupgrade_sock: %s/upgrade.sock\n' "$WORK" "$WORK"
    echo "grace_period_seconds: 0"
    kvroute_yaml "${LISTEN##*:}" "${ADMIN##*:}" $(seq "$BASE_PORT" $((BASE_PORT + SERVERS - 1)))
    printf '  limits:\n    backend_max_inflight: 4\n    queue_timeout_ms: 120000\n'
    printf '%s' "$tenants"
  } > "$dir/kvroute.yaml"
  local p
  for p in $(seq "$BASE_PORT" $((BASE_PORT + SERVERS - 1))); do wait_port "$p"; done
  RUST_LOG=warn "$BIN/kvroute" -c "$dir/kvroute.yaml" 2> "$WORK/kvroute-$name.log" &
  local kv=$!
  wait_http 100 "http://$ADMIN/readyz" || true
  local pids=()
  if (( flood > 0 )); then
    "$BIN/kvbench" replay --target "http://$LISTEN" --workload prompts --file "$WORK/flood.jsonl" \
      --conversations "$flood" --duration-s "$DURATION_S" --grace-s 120 \
      --header x-tenant-id:flood --out "$dir/flood" --label flood > "$WORK/replay-$name-flood.log" 2>&1 &
    pids+=($!)
  fi
  # The flood first fills the fleet and the queue; then the steady tenants arrive.
  sleep 3
  for t in 0 1 2 3; do
    "$BIN/kvbench" replay --target "http://$LISTEN" --workload prompts \
      --file "$WORK/steady-$t.jsonl" --conversations 1 --duration-s "$((DURATION_S - 3))" \
      --grace-s 120 --header "x-tenant-id:steady-$t" --out "$dir/steady-$t" --label "steady-$t" \
      > "$WORK/replay-$name-steady-$t.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  curl -fs "http://$ADMIN/metrics" > "$dir/metrics.txt"
  kill "$kv" "$sim"
  wait "$kv" "$sim" 2>/dev/null || true
}

NAMES=$'  tenants:\n    names: [flood, steady-0, steady-1, steady-2, steady-3]\n'
run solo "$NAMES" 0
run fair "$NAMES" "$FLOOD_WORKERS"
run fifo "$NAMES"$'    fair_share:\n      prompt_weight: 0\n      completion_weight: 0\n' "$FLOOD_WORKERS"

python3 - "$OUT" "$DURATION_S" "$FLOOD_WORKERS" "$SERVERS" <<'PY'
import json, os, sys
out, duration, workers, servers = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
def summary(run, who):
    return json.load(open(f"{out}/{run}/{who}/report.json"))["summary"]
def queue_wait(run, tenant):
    s = c = 0.0
    for line in open(f"{out}/{run}/metrics.txt"):
        if line.startswith("kvroute_tenant_queue_wait_seconds_") and 'outcome="admitted"' in line:
            labels = line.split("{", 1)[1].split("}", 1)[0]
            if f'tenant="{tenant}"' not in labels:
                continue
            v = float(line.rsplit(" ", 1)[1])
            if line.startswith("kvroute_tenant_queue_wait_seconds_sum"):
                s += v
            elif line.startswith("kvroute_tenant_queue_wait_seconds_count"):
                c += v
    return s, c
rows = []
p99 = {}
for run in ("solo", "fair", "fifo"):
    if not os.path.exists(f"{out}/{run}/flood"):
        rows.append(f"| {run} | flood | - | - | - | - | - |")
    else:
      f = summary(run, "flood")
      rows.append(f"| {run} | flood | {f['requests']} | {f['errors'] + f['timeouts']} | {f['ttft_p50_ms']:.0f} | {f['ttft_p90_ms']:.0f} | {f['ttft_p99_ms']:.0f} |")
    for t in range(4):
        s = summary(run, f"steady-{t}")
        p99[(run, t)] = s["ttft_p99_ms"]
        rows.append(f"| {run} | steady-{t} | {s['requests']} | {s['errors'] + s['timeouts']} | {s['ttft_p50_ms']:.0f} | {s['ttft_p90_ms']:.0f} | {s['ttft_p99_ms']:.0f} |")
waits = []
for run in ("solo", "fair", "fifo"):
    for tenant in ("flood", "steady-0", "steady-1", "steady-2", "steady-3"):
        s, c = queue_wait(run, tenant)
        waits.append(f"{run}: {tenant} waited in the router queue {c:.0f} times, mean {1000 * s / c if c else 0:.0f} ms")
ratios = []
for run in ("fair", "fifo"):
    r = [p99[(run, t)] / p99[("solo", t)] for t in range(4)]
    ratios.append(f"{run}: the steady tenants' TTFT p99 is {', '.join(f'{x:.2f}x' for x in r)} their solo run's")
readme = f"""# Noisy neighbor

`bench/scripts/noisy-neighbor.sh` (DURATION_S={duration}, SERVERS={servers}, FLOOD_WORKERS={workers}):
{servers} simulated H100 servers behind kvroute with `limits.backend_max_inflight: 4`; tenant `flood` runs {workers}
closed-loop workers of 8-30k-token prompts (16 output tokens), tenants `steady-0`..`steady-3` one
worker each of ~500-token prompts (64 output tokens), starting 3 s after the flood. `solo`:
the steady tenants alone (no flood). `fair`: the
default config (least attained service first inside a band); `fifo`:
`tenants.fair_share` weights 0 (no tenant is charged: first come first served). Configs:
`solo/kvroute.yaml`, `fair/kvroute.yaml`, `fifo/kvroute.yaml`.

| run | tenant | requests | failed | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms |
|---|---|---|---|---|---|---|
""" + "\n".join(rows) + "\n\n" + "\n".join(f"- {w}" for w in ratios + waits) + "\n"
open(f"{out}/README.md", "w").write(readme)
print(readme)
PY
