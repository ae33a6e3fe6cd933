#!/usr/bin/env bash
# Prefill/decode disaggregation on the simulator: the same eight simulated H100 servers as one
# unified fleet (every server serves requests whole), and as two prefill + six decode servers
# where kvroute decides per request whether to prefill on a prefill server (vLLM's NIXL
# protocol, the KV moved at 25 GB/s); a long-prompt trace and a chat workload replayed
# through each. What happens to the streams' inter-token latency, and to TTFT?
# Used by: docs/results/disaggregation.md
#
# Runs (each on a fresh fleet): `unified` (8 servers, no disaggregation) and `split`
# (`--role prefill` x2, `--role decode` x6, `kvroute.disaggregation.protocol: vllm_nixl`), for
# each of WORKLOADS (default heavy_mix,sharegpt), DURATION_S wall seconds at time scale
# TIME_SCALE. Writes OUT/README.md (OUT default bench/runs/pd). Needs release binaries:
#   cargo build --release --workspace && bench/scripts/pd.sh
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"

DURATION_S=${DURATION_S:-90}
TIME_SCALE=${TIME_SCALE:-2}
WORKLOADS=${WORKLOADS:-heavy_mix,sharegpt}
CONVERSATIONS=${CONVERSATIONS:-64}
BASE_PORT=${BASE_PORT:-19500}
BIN=${CARGO_TARGET_DIR:-target}/release
OUT=${OUT:-bench/runs/pd}
LISTEN=127.0.0.1:$((BASE_PORT + 80))
ADMIN=127.0.0.1:$((BASE_PORT + 90))
rm -rf "$OUT" && mkdir -p "$OUT"
start_work pd

# run NAME WORKLOAD: one fleet, kvroute in front, one replay.
run() {
  local name=$1 workload=$2 dir="$OUT/$2/$1" sims=()
  mkdir -p "$dir"
  local common=(--profile h100-llama8b --time-scale "$TIME_SCALE" --pd-protocol vllm_nixl)
  if [ "$name" = unified ]; then
    "$BIN/kvbench" sim --servers 8 --base-port "$BASE_PORT" "${common[@]}" \
      > "$WORK/sim-$name-$workload.log" 2>&1 &
    sims+=($!)
  else
    "$BIN/kvbench" sim --servers 2 --base-port "$BASE_PORT" --role prefill "${common[@]}" \
      > "$WORK/sim-p-$name-$workload.log" 2>&1 &
    sims+=($!)
    "$BIN/kvbench" sim --servers 6 --base-port $((BASE_PORT + 2)) --role decode "${common[@]}" \
      > "$WORK/sim-d-$name-$workload.log" 2>&1 &
    sims+=($!)
  fi
  {
    printf 'version: 1\nthreads: 2\npid_file: %s/kvroute.pid\nupgrade_sock: %s/upgrade.sock\n' "$WORK" "$WORK"
    echo "grace_period_seconds: 0"
    kvroute_yaml "${LISTEN##*:}" "${ADMIN##*:}" $(seq "$BASE_PORT" $((BASE_PORT + 7)))
    if [ "$name" = split ]; then
      printf '  disaggregation:\n    protocol: vllm_nixl\n'
    fi
  } > "$dir/kvroute.yaml"
  if [ "$name" = split ]; then
    # The first two backends prefill, the other six decode.
    python3 - "$dir/kvroute.yaml" <<'PY'
import sys
path = sys.argv[1]
lines, seen = [], 0
for line in open(path):
    lines.append(line)
    if line.startswith("    - addr: "):
        lines.append("      role: prefill\n" if seen < 2 else "      role: decode\n")
        seen += 1
open(path, "w").write("".join(lines))
PY
  fi
  local p
  for p in $(seq "$BASE_PORT" $((BASE_PORT + 7))); do wait_port "$p"; done
  RUST_LOG=warn "$BIN/kvroute" -c "$dir/kvroute.yaml" 2> "$WORK/kvroute-$name-$workload.log" &
  local kv=$!
  wait_http 100 "http://$ADMIN/readyz" || true
  "$BIN/kvbench" replay --target "http://$LISTEN" --workload "$workload" \
    --time-scale "$TIME_SCALE" --duration-s "$DURATION_S" --conversations "$CONVERSATIONS" \
    --grace-s 120 --out "$dir" --label "$name" > "$WORK/replay-$name-$workload.log" 2>&1
  curl -fs "http://$ADMIN/metrics" > "$dir/metrics.txt"
  kill "$kv" "${sims[@]}"
  wait "$kv" "${sims[@]}" 2>/dev/null || true
}

IFS=, read -ra LIST <<< "$WORKLOADS"
for w in "${LIST[@]}"; do
  run unified "$w"
  run split "$w"
done

python3 - "$OUT" "$DURATION_S" "$TIME_SCALE" "$WORKLOADS" <<'PY'
import json, sys
out, duration, scale, workloads = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
def metric(path, name, label=None):
    total = 0.0
    for line in open(path):
        if line.startswith(name + "{") or line.startswith(name + " "):
            if label is None or label in line:
                total += float(line.rsplit(" ", 1)[1])
    return total
def fmt(v):
    return "-" if v is None else f"{v:.0f}"
rows = []
for w in workloads:
    base = None
    for run in ("unified", "split"):
        s = json.load(open(f"{out}/{w}/{run}/report.json"))["summary"]
        m = f"{out}/{w}/{run}/metrics.txt"
        split = metric(m, "kvroute_pd_decisions_total", 'outcome="split"')
        whole = metric(m, "kvroute_pd_decisions_total", 'outcome="whole"')
        legs = metric(m, "kvroute_pd_prefill_legs_total", 'outcome="ok"')
        hit = s.get("cache_hit_rate")
        rows.append(
            f"| {w} | {run} | {s['requests']} | {s['errors'] + s['timeouts']} | {fmt(s['ttft_p50_ms'])} | "
            f"{fmt(s['ttft_p90_ms'])} | {fmt(s['ttft_p99_ms'])} | {s['itl_p50_ms']:.1f} | {fmt(s.get('itl_p99_ms'))} | "
            f"{s['output_tok_s']:.0f} | {'-' if hit is None else f'{hit:.3f}'} | "
            + (f"{split:.0f} split / {whole:.0f} whole ({legs:.0f} legs ok)" if run == "split" else "-")
            + " |"
        )
readme = f"""# Prefill/decode disaggregation on the simulator

```sh
DURATION_S={duration} TIME_SCALE={scale} WORKLOADS={",".join(workloads)} bench/scripts/pd.sh
```

Eight `h100-llama8b` simulated servers; `unified`: all serve requests whole; `split`: two
`--role prefill`, six `--role decode`, kvroute with `disaggregation: {{protocol: vllm_nixl}}`
(KV moved at 25 GB/s, 131,072 bytes a token, 2 ms a transfer). Times are model time.

| workload | fleet | requests | errors | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | output tok/s | cache hit | decisions |
|---|---|---|---|---|---|---|---|---|---|---|---|
""" + "\n".join(rows) + "\n"
open(f"{out}/README.md", "w").write(readme)
print(readme)
PY
