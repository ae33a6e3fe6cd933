#!/usr/bin/env bash
# Idle RSS of two kvroute binaries, side by side, and its anonymous and file-backed parts.
# Used by: docs/results/proxy-cost.md
#
# Each starts in turn (old, new, ROUNDS times) with one worker thread and four backends, all
# plaintext, then two of them TLS; its RSS and its anonymous and file-backed parts are read
# from /proc 3 s after start (after the first health checks and scrapes). The backends are
# closed loopback ports: checks and scrapes fail at connect, and build everything they build
# for a live engine. Prints every run and medians.
#
#   bench/scripts/idle_rss.sh OLD_KVROUTE NEW_KVROUTE [ROUNDS=5] [OUT=bench/runs/idle-rss/rss.txt]
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"
OLD=${1:?old kvroute binary}; NEW=${2:?new kvroute binary}
ROUNDS=${3:-5}; OUT=${4:-bench/runs/idle-rss/rss.txt}
mkdir -p "$(dirname "$OUT")"
CLEANUP_SIGNAL=KILL
start_work rss
conf() { # $1 file, $2 how many backends are TLS
  local backends=() i
  for i in 1 2 3 4; do
    if [ "$i" -le "$2" ]; then backends+=("1950$i=engine$i.internal"); else backends+=("1950$i"); fi
  done
  { pingora_yaml kv 1; kvroute_yaml 19480 19481 "${backends[@]}"; } > "$1"
}
conf "$WORK/plain.yaml" 0; conf "$WORK/tls.yaml" 2
: > "$WORK/runs.txt"
for _ in $(seq "$ROUNDS"); do
  for c in plain tls; do
    for b in old new; do
      bin=$OLD; [ $b = new ] && bin=$NEW
      SPAWN_LOG=error spawn "" "$WORK/err" "$bin" -c "$WORK/$c.yaml"; KPID=$SPAWNED
      sleep 3
      kill -0 "$KPID" 2>/dev/null || { echo "idle_rss.sh: $bin exited:" >&2; cat "$WORK/err" >&2; exit 1; }
      echo "$c $b $(awk '/^(VmRSS|RssAnon|RssFile):/{printf "%s ", $2}' "/proc/$KPID/status")" >> "$WORK/runs.txt"
      kill -INT "$KPID"; wait "$KPID" 2>/dev/null || true
    done
  done
done
python3 - "$WORK/runs.txt" "$OLD" "$NEW" > "$OUT" <<'PY'
import sys, statistics as st, collections
runs, old, new = sys.argv[1:]
d = collections.defaultdict(list)
print(f"old: {old}\nnew: {new}\nruns (config binary VmRSS RssAnon RssFile, KiB):")
for line in open(runs):
    print("  " + line.strip())
    c, b, *v = line.split()
    d[(c, b)].append([int(x) / 1024 for x in v])
print("medians, MiB (RSS = anonymous + file-backed):")
for c in ("plain", "tls"):
    for b in ("old", "new"):
        m = [st.median(col) for col in zip(*d[(c, b)])]
        print(f"  {c:5} {b}: RSS {m[0]:.1f}  anon {m[1]:.1f}  file {m[2]:.1f}")
PY
cat "$OUT"
