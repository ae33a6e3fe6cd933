#!/usr/bin/env bash
# The cross-check as it was run: aiperf and kvbench replay alternating against a fresh
# `kvbench sim` (cold cache) each time. Raw output goes to $OUT (default /tmp/xcheck); a run
# during which cargo or rustc was seen (2-core machine) is discarded and repeated.
# Needs: the release build, /opt/aiperf-venv, $HF_HOME laid out as in README.md, and
# F=/tmp/xcheck-prompts.jsonl from bench/scripts/make_prompts.py.
set -u
BIN=${BIN:-/var/tmp/kvroute-target/release/kvbench}
F=${F:-/tmp/xcheck-prompts.jsonl}
OUT=${OUT:-/tmp/xcheck}
export HF_HOME=${HF_HOME:-/tmp/xcheck-hf} HF_HUB_OFFLINE=1
mkdir -p "$OUT"

start_sim() {
  "$BIN" sim --servers 2 --base-port 18401 --time-scale 1 > "$OUT/sim-$1.log" 2>&1 &
  SIM=$!
  for _ in $(seq 100); do
    curl -sf http://127.0.0.1:18401/health > /dev/null && curl -sf http://127.0.0.1:18402/health > /dev/null && return 0
    sleep 0.1
  done
  echo "sim did not start" >&2; return 1
}
stop_sim() { curl -s http://127.0.0.1:18401/metrics > "$OUT/$1-sim-metrics.txt"; kill $SIM; wait $SIM 2> /dev/null; }
aiperf_run() { # name count concurrency [extra aiperf flags]
  local name=$1 n=$2 c=$3; shift 3
  /opt/aiperf-venv/bin/aiperf profile --model sim-llama-8b --tokenizer local/bpe8k \
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
  local name=$1; shift
  for try in 1 2 3 4 5 6; do
    quiet; rm -f "$OUT/busy.flag"
    (while true; do busy && touch "$OUT/busy.flag"; sleep 0.5; done) & local mon=$!
    start_sim "$name"; "$@" > "$OUT/$name.out" 2>&1; stop_sim "$name"
    kill $mon; wait $mon 2> /dev/null
    if [ ! -e "$OUT/busy.flag" ]; then echo "$(date +%T) $name ok"; return 0; fi
    echo "$(date +%T) $name try $try: a build ran, discarded"
    mkdir -p "$OUT/contaminated"; rm -rf "$OUT/contaminated/$name-$try"*
    mv "$OUT/$name" "$OUT/contaminated/$name-$try"; mv "$OUT/$name.out" "$OUT/contaminated/$name-$try.out"
  done
}

for r in 1 2 3 m8; do
  clean aiperf-$r aiperf_run aiperf-$r 200 8 --use-server-token-count
  clean kvbench-$r kvbench_run kvbench-$r 200 8
done
clean aiperf-tokenizer aiperf_run aiperf-tokenizer 200 8
for r in 1 2; do
  clean aiperf-c1-$r aiperf_run aiperf-c1-$r 60 1 --use-server-token-count
  clean kvbench-c1-$r kvbench_run kvbench-c1-$r 60 1
done
python3 "$(dirname "$0")/summarize.py" "$OUT"
