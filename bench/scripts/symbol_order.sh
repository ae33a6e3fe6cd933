#!/usr/bin/env bash
# The functions a release kvroute runs, idle then on requests, for the linker to place together.
# Used by: docs/results/proxy-cost.md (idle RSS); writes link/symbol-order.txt, which build.rs reads.
#
# Writes link/symbol-order.txt, the functions build.rs has the linker place side by side in a
# release kvroute: first those it runs from start until it idles, then those its requests add.
# - The idle phase covers configuration, Pingora's server, tokio and OpenSSL, and the health
#   checks and scrapes of four backends: two simulated engines (`kvbench sim`) and two closed
#   TLS ports.
# - The request phase sends chat completions, streamed and not, 1 KB and 100 KB, and a
#   conversation's second turn.
#
# Run it again after a dependency or compiler upgrade. The list names functions by their
# mangled names; a name the binary no longer has is skipped, so a stale list only costs memory.
#
#   bench/scripts/symbol_order.sh [IDLE_SECONDS=15]
#
# Needs valgrind (callgrind records every function that runs, however briefly) and curl.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"
IDLE=${1:-15}
need_tools "apt-get install valgrind curl" valgrind callgrind_control curl python3
# Apart, and kvroute as it is installed (README: `cargo build --release -p kvroute`): built
# together, the two packages' dependencies are built with the union of their features, and
# many functions then have other mangled names.
build_release -p kvbench
build_release -p kvroute --bin kvroute
BIN=$(release_bin kvroute)
start_work order

"$(release_bin kvbench)" sim --servers 2 --base-port 19610 --ttft-ms 1 --itl-ms 1 \
  >"$WORK/sim.log" 2>&1 &
{ pingora_yaml kv 1; kvroute_yaml 19580 19581 19610 19611 19622=engine2.internal 19623=engine3.internal; } > "$WORK/kv.yaml"
RUST_LOG=error valgrind --tool=callgrind --demangle=no --callgrind-out-file="$WORK/cg.out" \
  "$BIN" -c "$WORK/kv.yaml" >"$WORK/valgrind.log" 2>&1 & KV=$!
sleep "$IDLE"
kill -0 "$KV" 2>/dev/null || { cat "$WORK/valgrind.log" >&2; exit 1; }
callgrind_control --dump=idle "$KV" >/dev/null

chat() { # $1 stream (true/false), $2 approximate bytes of prompt
  python3 - "$1" "$2" <<'PY'
import json, sys
stream, size = sys.argv[1] == "true", int(sys.argv[2])
text = ("The key/value cache holds attention state; \"prefix caching\" reuses it.\n" * (size // 70 + 1))[:size]
print(json.dumps({"model": "sim-llama-8b", "stream": stream, "max_tokens": 8,
                  "messages": [{"role": "system", "content": "Answer briefly."},
                               {"role": "user", "content": text},
                               {"role": "assistant", "content": "Noted."},
                               {"role": "user", "content": "And then?"}]}))
PY
}
for stream in false true; do
  for size in 1000 100000; do
    chat "$stream" "$size" > "$WORK/body.json"
    for _ in 1 2 3 4 5; do
      curl -s -o /dev/null --max-time 30 -H 'content-type: application/json' \
        --data-binary @"$WORK/body.json" http://127.0.0.1:19580/v1/chat/completions || true
    done
  done
done
curl -s -o /dev/null --max-time 30 http://127.0.0.1:19581/metrics || true
sleep 2
kill -INT "$KV"; wait "$KV" 2>/dev/null || true

nm "$BIN" | awk 'NF == 3 && $2 ~ /^[tTwW]$/ {print $3}' | sort -u > "$WORK/defined"
mkdir -p link
python3 - "$WORK/defined" "$WORK"/cg.out.* "$WORK/cg.out" > link/symbol-order.txt <<'PY'
import re, sys
defined = set(open(sys.argv[1]).read().split())

def ran(path):
    names, refs = {}, set()
    for line in open(path, errors="replace"):
        m = re.match(r"^(c?fn)=\((\d+)\)(?: (.*))?$", line.rstrip("\n"))
        if m:
            kind, ref, name = m.groups()
            if name:
                names[ref] = name
            if kind == "fn":
                refs.add(ref)
    return {names[r] for r in refs if names.get(r) in defined}

idle = ran(sys.argv[2])
requests = set().union(*(ran(p) for p in sys.argv[3:])) - idle
print("# Functions a release kvroute runs from start until idle, then those its requests add,")
print("# placed side by side by the linker (build.rs). Written by bench/scripts/symbol_order.sh;")
print(f"# do not edit by hand. {len(idle)} idle, {len(requests)} requests.")
print("\n".join(sorted(idle) + sorted(requests)))
PY
head -3 link/symbol-order.txt | tail -1
