#!/usr/bin/env bash
# Stored-response chains through reloads, an upgrade and two replicas: does every
# `previous_response_id` and every call on a stored id reach the backend that stored it?
# Used by: docs/results/agents.md
#
# Two kvroute replicas (A and B) with the same backends and the same response-id key, in
# front of 3 simulated H100 servers (a fourth waits outside the fleet). kvbench drives
# `agentic --api responses --tool-calls --store` (TASKS sessions of TURNS steps, AT_ONCE at
# a time, a new one starting when one ends): coding-agent sessions that chain every step
# on the previous stored answer, turn k of a session through replica k mod 2, so every
# continuation crosses replicas. At a third of the run both replicas reload (SIGHUP) a config
# that adds the fourth server; at two thirds replica A is upgraded (`kvroute -u`, SIGQUIT to
# the old process). After the run, every stored id is read back (`GET /v1/responses/{id}`),
# alternately through A and B.
#
# Reports the continuations sent, those that failed or landed on another backend than their
# chain's first turn, and the id-only reads that did not find their response. Writes
# OUT/README.md (OUT default bench/runs/stored-chains). Needs release binaries:
#   cargo build --release --workspace && bench/scripts/stored_chains.sh
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"

DURATION_S=${DURATION_S:-120}
TASKS=${TASKS:-64}
AT_ONCE=${AT_ONCE:-16}
TURNS=${TURNS:-12}
BASE_PORT=${BASE_PORT:-19300}
BIN=${CARGO_TARGET_DIR:-target}/release
OUT=${OUT:-bench/runs/stored-chains}
need_tools "" curl python3
[ -x "$BIN/kvroute" ] && [ -x "$BIN/kvbench" ] || die "build first: cargo build --release --workspace"
rm -rf "$OUT" && mkdir -p "$OUT"
start_work stored-chains

# One process, four servers: each answers with its own index (`x-kvbench-server`).
"$BIN/kvbench" sim --servers 4 --base-port "$BASE_PORT" --profile h100-llama8b \
  > "$WORK/sim.log" 2>&1 &
sims=($((BASE_PORT)) $((BASE_PORT + 1)) $((BASE_PORT + 2)) $((BASE_PORT + 3)))
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$WORK/response-id.key"

# config NAME BACKEND...: replica NAME's config (its own ports, pid file and upgrade socket;
# everything else the same for both).
config() {
  local name=$1 listen admin; shift
  case $name in A) listen=$((BASE_PORT + 80)) admin=$((BASE_PORT + 90)) ;;
                *) listen=$((BASE_PORT + 81)) admin=$((BASE_PORT + 91)) ;; esac
  {
    printf 'version: 1\nthreads: 2\npid_file: %s/%s.pid\nupgrade_sock: %s/%s.sock\n' \
      "$WORK" "$name" "$WORK" "$name"
    printf 'grace_period_seconds: 30\ngraceful_shutdown_timeout_seconds: 30\n'
    kvroute_yaml "$listen" "$admin" "$@"
    printf '  routing:\n    response_id_key_file: "%s"\n' "$WORK/response-id.key"
  } > "$OUT/kvroute-$name.yaml"
}
config A "${sims[@]:0:3}"
config B "${sims[@]:0:3}"
RUST_LOG=warn "$BIN/kvroute" -c "$OUT/kvroute-A.yaml" 2> "$OUT/kvroute-A.log" &
A_PID=$!
RUST_LOG=warn "$BIN/kvroute" -c "$OUT/kvroute-B.yaml" 2> "$OUT/kvroute-B.log" &
B_PID=$!
A=http://127.0.0.1:$((BASE_PORT + 80))
B=http://127.0.0.1:$((BASE_PORT + 81))
wait_http 200 "http://127.0.0.1:$((BASE_PORT + 90))/readyz" \
  "http://127.0.0.1:$((BASE_PORT + 91))/readyz" || die "kvroute not ready"

"$BIN/kvbench" replay --target "$A" --replica-target "$B" --workload agentic --api responses \
  --tool-calls --store --tasks "$TASKS" --conversations "$AT_ONCE" --turns "$TURNS" \
  --system-tokens 8000 --question-tokens 200 --tool-tokens-max 4000 --think-ms 500 \
  --duration-s "$DURATION_S" --out "$OUT/replay" --label stored-chains \
  > "$WORK/replay.log" 2>&1 &
REPLAY_PID=$!

sleep $((DURATION_S / 3))
config A "${sims[@]}"
config B "${sims[@]}"
kill -HUP "$A_PID" "$B_PID"
echo "t=$((DURATION_S / 3))s: both replicas reloaded with a fourth backend"
sleep $((DURATION_S / 3))
RUST_LOG=warn "$BIN/kvroute" -c "$OUT/kvroute-A.yaml" -u 2>> "$OUT/kvroute-A.log" &
A_NEW=$!
sleep 1
kill -QUIT "$A_PID"
echo "t=$((2 * DURATION_S / 3))s: replica A upgraded (pid $A_PID -> $A_NEW)"
wait "$REPLAY_PID" || die "replay failed: $(tail -5 "$WORK/replay.log")"
curl -fs "http://127.0.0.1:$((BASE_PORT + 90))/metrics" > "$OUT/metrics-A.txt" || true

python3 - "$OUT" "$A" "$B" "$DURATION_S" "$TASKS" "$AT_ONCE" "$TURNS" <<'PY'
import json, sys, urllib.request, urllib.error
out, a, b, dur, tasks, at_once, turns = sys.argv[1:8]
records = json.load(open(f"{out}/replay/report.json"))["records"]
first = {}      # session -> backend of its first answered turn
by_id = {}      # stored id -> backend that answered it
for r in sorted(records, key=lambda r: r["send_ms"]):
    if r.get("response_id") and r.get("backend"):
        by_id[r["response_id"]] = r["backend"]
    if r.get("turn") == 0 and r.get("backend"):
        first[r["session"]] = r["backend"]
chained = [r for r in records if r.get("previous_response_id")]
failed = [r for r in chained if r.get("error")]
moved = [r for r in chained if not r.get("error") and r.get("backend") != by_id.get(r["previous_response_id"])]
others = [r for r in records if r.get("error") and not r.get("previous_response_id")]
# Every stored id read back, alternately through each replica.
missed = []
for i, (rid, backend) in enumerate(sorted(by_id.items())):
    base = (a, b)[i % 2]
    try:
        with urllib.request.urlopen(f"{base}/v1/responses/{rid}", timeout=10) as res:
            got = res.headers.get("x-kvbench-server")
            body = json.load(res)
            if body.get("id") != rid or got != backend:
                missed.append((rid, f"answered by {got} with id {body.get('id')}"))
    except urllib.error.HTTPError as e:
        missed.append((rid, f"HTTP {e.code}"))
backends = sorted({r["backend"] for r in records if r.get("backend")})
# Requests the upgraded process of replica A answered (its counters start at the upgrade).
upgraded = 0
try:
    for line in open(f"{out}/metrics-A.txt"):
        if line.startswith("kvroute_requests_total{"):
            upgraded += int(float(line.rsplit(" ", 1)[1]))
except OSError:
    pass
text = f"""# Stored-response chains through a reload, an upgrade and two replicas

`bench/scripts/stored_chains.sh` (DURATION_S={dur}, TASKS={tasks}, AT_ONCE={at_once},
TURNS={turns}): `agentic --api responses --tool-calls --store`, {tasks} sessions of {turns} steps,
{at_once} at once (a new one starts when one ends), each step a `previous_response_id` on the last
stored answer with only its new items, turn k through replica k mod 2 (A, B; one response-id
key, the same backends). Both replicas reload a fourth backend at {int(dur)//3} s; A is upgraded
(`-u`, SIGQUIT) at {2*int(dur)//3} s. Backends that answered: {", ".join(backends)}.

| requests | continuations | continuations failed | continuations on another backend | stored ids read back | reads that missed |
|---|---|---|---|---|---|
| {len(records)} | {len(chained)} | {len(failed)} | {len(moved)} | {len(by_id)} | {len(missed)} |

Other failed requests (not continuations): {len(others)}. The upgraded process of replica A
answered {upgraded} requests.
"""
for r in (failed + moved)[:10]:
    text += f"\n- continuation {r['id']} ({r['session']} turn {r.get('turn')}): {r.get('error') or 'answered by ' + str(r.get('backend'))}"
for rid, why in missed[:10]:
    text += f"\n- read of {rid}: {why}"
open(f"{out}/README.md", "w").write(text + "\n")
print(text)
PY
