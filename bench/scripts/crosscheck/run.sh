#!/usr/bin/env bash
# Cross-check of kvbench replay against aiperf: TTFT and output tok/s, each tool on a fresh simulator.
# Used by: docs/results/reliability.md (the run: bench/results/crosscheck)
#
# The cross-check as it was run: aiperf and kvbench replay alternating against a fresh
# `kvbench sim` (cold cache) each time. Raw output goes to $OUT (default /tmp/xcheck); a run
# during which cargo or rustc was seen (2-core machine) is discarded and repeated. Then
# summarize.py prints the table.
# Needs: the release build (BIN, default under CARGO_TARGET_DIR or target/), aiperf (AIPERF,
# default `aiperf` on PATH), $HF_HOME laid out as in bench/results/crosscheck/README.md,
# and F=/tmp/xcheck-prompts.jsonl from bench/scripts/make_prompts.py.
set -u
# shellcheck source-path=SCRIPTDIR source=../lib.sh
. "$(dirname "$0")/../lib.sh"
BIN=${BIN:-$DEFAULT_TARGET_DIR/release/kvbench}
AIPERF=${AIPERF:-aiperf}
F=${F:-/tmp/xcheck-prompts.jsonl}
OUT=${OUT:-/tmp/xcheck}
export HF_HOME=${HF_HOME:-/tmp/xcheck-hf} HF_HUB_OFFLINE=1
mkdir -p "$OUT"
trap stop_jobs EXIT

start_sim() {
  "$BIN" sim --servers 2 --base-port 18401 --time-scale 1 > "$OUT/sim-$1.log" 2>&1 &
  SIM=$!
  wait_http 100 http://127.0.0.1:18401/health http://127.0.0.1:18402/health && return 0
  echo "sim did not start" >&2; return 1
}
stop_sim() { curl -s http://127.0.0.1:18401/metrics > "$OUT/$1-sim-metrics.txt"; kill "$SIM"; wait "$SIM" 2> /dev/null; }
aiperf_run() { # name count concurrency [extra aiperf flags]
  local name=$1 n=$2 c=$3; shift 3
  "$AIPERF" profile --model sim-llama-8b --tokenizer local/bpe8k \
    --url http://127.0.0.1:18401 --endpoint-type chat --streaming \
    --input-file "$F" --custom-dataset-type single_turn --dataset-sampling-strategy sequential \
    --concurrency "$c" --request-count "$n" --extra-inputs ignore_eos:true \
    --no-server-metrics --ui none --artifact-dir "$OUT/$name" "$@"
}
kvbench_run() { # name count concurrency
  "$BIN" replay --target http://127.0.0.1:18401 --workload prompts --file "$F" \
    --conversations "$3" --max-requests "$2" --out "$OUT/$1"
}
busy() { pgrep -x cargo > /dev/null || pgrep -x rustc > /dev/null; }
quiet() { local n=0; while [ $n -lt 10 ]; do if busy; then n=0; else n=$((n + 1)); fi; sleep 1; done; }
clean() { # name cmd...: repeat until no build ran during the run
  local name=$1 try mon; shift
  for try in 1 2 3 4 5 6; do
    quiet; rm -f "$OUT/busy.flag"
    (while true; do busy && touch "$OUT/busy.flag"; sleep 0.5; done) & mon=$!
    start_sim "$name"; "$@" > "$OUT/$name.out" 2>&1; stop_sim "$name"
    kill "$mon"; wait "$mon" 2> /dev/null
    if [ ! -e "$OUT/busy.flag" ]; then echo "$(date +%T) $name ok"; return 0; fi
    echo "$(date +%T) $name try $try: a build ran, discarded"
    mkdir -p "$OUT/contaminated"; rm -rf "$OUT/contaminated/$name-$try"*
    mv "$OUT/$name" "$OUT/contaminated/$name-$try"; mv "$OUT/$name.out" "$OUT/contaminated/$name-$try.out"
  done
}

for r in 1 2 3 m8; do
  clean "aiperf-$r" aiperf_run "aiperf-$r" 200 8 --use-server-token-count
  clean "kvbench-$r" kvbench_run "kvbench-$r" 200 8
done
clean aiperf-tokenizer aiperf_run aiperf-tokenizer 200 8
for r in 1 2; do
  clean "aiperf-c1-$r" aiperf_run "aiperf-c1-$r" 60 1 --use-server-token-count
  clean "kvbench-c1-$r" kvbench_run "kvbench-c1-$r" 60 1
done
python3 "$(dirname "$0")/summarize.py" "$OUT"
