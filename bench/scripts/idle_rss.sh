#!/usr/bin/env bash
# Idle RSS of two kvroute binaries, side by side: each starts in turn (old, new, ROUNDS times)
# with one worker thread and four backends, all plaintext, then two of them TLS; its RSS and
# its anonymous and file-backed parts are read from /proc 3 s after start (after the first
# health checks and scrapes). The backends are closed loopback ports: checks and scrapes fail
# at connect, and build everything they build for a live engine. Prints every run and medians.
#
#   bench/scripts/idle_rss.sh OLD_KVROUTE NEW_KVROUTE [ROUNDS=5] [OUT=bench/results/idle-rss/rss.txt]
set -euo pipefail
cd "$(dirname "$0")/../.."
OLD=${1:?old kvroute binary}; NEW=${2:?new kvroute binary}
ROUNDS=${3:-5}; OUT=${4:-bench/results/idle-rss/rss.txt}
mkdir -p "$(dirname "$OUT")"
WORK=$(mktemp -d /tmp/kvroute-rss.XXXXXX)
KPID=
cleanup() { [ -n "$KPID" ] && kill -9 "$KPID" 2>/dev/null; rm -rf "$WORK"; }
trap cleanup EXIT
conf() { # $1 file, $2 how many backends are TLS
  { printf 'version: 1\nthreads: 1\npid_file: %s/kv.pid\nupgrade_sock: %s/kv.sock\n' "$WORK" "$WORK"
    printf 'grace_period_seconds: 0\ngraceful_shutdown_timeout_seconds: 1\nkvroute:\n'
    printf '  listen: "127.0.0.1:19480"\n  admin_listen: "127.0.0.1:19481"\n  backends:\n'
    for i in 1 2 3 4; do
      printf '    - addr: "127.0.0.1:1950%s"\n' "$i"
      if [ "$i" -le "$2" ]; then printf '      tls: {sni: engine%s.internal}\n' "$i"; fi
    done; } > "$1"
}
conf "$WORK/plain.yaml" 0; conf "$WORK/tls.yaml" 2
: > "$WORK/runs.txt"
for r in $(seq "$ROUNDS"); do
  for c in plain tls; do
    for b in old new; do
      bin=$OLD; [ $b = new ] && bin=$NEW
      RUST_LOG=error "$bin" -c "$WORK/$c.yaml" 2>"$WORK/err" & KPID=$!
      sleep 3
      kill -0 "$KPID" 2>/dev/null || { echo "idle_rss.sh: $bin exited:" >&2; cat "$WORK/err" >&2; exit 1; }
      echo "$c $b $(awk '/^(VmRSS|RssAnon|RssFile):/{printf "%s ", $2}' "/proc/$KPID/status")" >> "$WORK/runs.txt"
      kill -INT "$KPID"; wait "$KPID" 2>/dev/null || true; KPID=
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
