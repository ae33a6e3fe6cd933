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
# - smuggling: CL.TE, an obfuscated Transfer-Encoding, duplicate Content-Length, no Host;
# - HTTP/2 floods (h2c): rapid reset, a CONTINUATION flood, a SETTINGS flood; how each
#   connection ended;
# - slow readers: other clients (ShareGPT chat, CONVERSATIONS closed-loop conversations, for
#   LOAD_S seconds) alone, then beside `kvbench probe slow-readers` (10 h2c connections x 128
#   zero-window streams, each a real streamed chat request, replaced as soon as it ends); the
#   other clients' success rate and TTFT p50/p99 in both runs;
# - TLS: the listener serves a throwaway P-256 certificate from a throwaway CA, with an OCSP
#   response from that CA stapled; a full testssl.sh scan (when installed; Debian: testssl.sh),
#   its findings above LOW, the server's apart from the certificate's own (cert_*: untrusted,
#   short-lived, no CRL); sslyze (when SSLYZE names it or it is on PATH; from PyPI:
#   `python3 -m venv V && V/bin/pip install sslyze`), trusting the throwaway CA: compliance
#   with Mozilla's intermediate profile, the OCSP staple, TLS 1.2 session resumption.
# Writes OUT/README.md (the table) and OUT/*.json (each probe's answers).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"
need_tools "Debian: python3, curl, openssl" python3 curl openssl

KVROUTE=${1:-$(release_bin kvroute)}
KVBENCH=${KVBENCH:-$(release_bin kvbench)}
OUT=${2:-bench/runs/edge}
LOAD_S=${LOAD_S:-40}
CONVERSATIONS=${CONVERSATIONS:-8}
BASE_PORT=${BASE_PORT:-19300}
LISTEN=$((BASE_PORT + 80)); ADMIN=$((BASE_PORT + 90)); TLS=$((BASE_PORT + 43))
PROBE="python3 bench/scripts/edge_probe.py"
rm -rf "$OUT" && mkdir -p "$OUT"
start_work edge
# A CA, a leaf it signs and that CA's OCSP answer about the leaf ("good" for a day).
EC=(-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes)
openssl req -x509 "${EC[@]}" -days 30 -subj "/CN=kvroute edge check CA" \
  -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign \
  -keyout "$WORK/ca.key" -out "$WORK/ca.pem" 2>/dev/null
openssl req "${EC[@]}" -subj /CN=localhost -keyout "$WORK/key.pem" -out "$WORK/leaf.csr" 2>/dev/null
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n' > "$WORK/leaf.ext"
openssl x509 -req -in "$WORK/leaf.csr" -CA "$WORK/ca.pem" -CAkey "$WORK/ca.key" -set_serial 1000 \
  -days 30 -extfile "$WORK/leaf.ext" -out "$WORK/leaf.pem" 2>/dev/null
cat "$WORK/leaf.pem" "$WORK/ca.pem" > "$WORK/cert.pem"
printf 'V\t301231235959Z\t\t03E8\tunknown\t/CN=localhost\n' > "$WORK/index.txt"
openssl ocsp -no_nonce -issuer "$WORK/ca.pem" -cert "$WORK/leaf.pem" -reqout "$WORK/ocsp.req" 2>/dev/null
openssl ocsp -index "$WORK/index.txt" -rsigner "$WORK/ca.pem" -rkey "$WORK/ca.key" -CA "$WORK/ca.pem" \
  -reqin "$WORK/ocsp.req" -respout "$WORK/ocsp.der" -ndays 1 >/dev/null 2>&1

spawn "" "$WORK/sim.err" "$KVBENCH" sim --servers 3 --base-port "$BASE_PORT" --profile h100-llama8b
for p in "$BASE_PORT" $((BASE_PORT + 1)) $((BASE_PORT + 2)); do
  wait_port "$p" || die "the simulator never listened: $(cat "$WORK/sim.err")"
done
{
  pingora_yaml kv 2
  kvroute_yaml "$LISTEN" "$ADMIN" "$BASE_PORT" $((BASE_PORT + 1)) $((BASE_PORT + 2))
  printf '  h2c: true\n  health_check:\n    interval_ms: 500\n'
  printf '  tls:\n    listen: "127.0.0.1:%s"\n    cert: %s/cert.pem\n    key: %s/key.pem\n' "$TLS" "$WORK" "$WORK"
  printf '    ocsp_response: %s/ocsp.der\n' "$WORK"
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
$PROBE h2-floods "$LISTEN" > "$OUT/h2-floods.json"
FLOODS=$(python3 -c 'import json,sys; a=json.load(open(sys.argv[1]))["answers"]; print("; ".join(f"{k}: {v}" for k,v in a.items()))' "$OUT/h2-floods.json")
kill -0 "$KV_PID" || die "kvroute died: $(tail -5 "$WORK/kvroute.err")"

# Slow readers: the other clients alone, then beside the attack (started 5 s before them).
others() {
  "$KVBENCH" replay --target "http://127.0.0.1:$LISTEN" --workload sharegpt \
    --file bench/data/sharegpt_demo.jsonl --conversations "$CONVERSATIONS" \
    --duration-s "$LOAD_S" --grace-s 20 --out "$OUT/$1" --label "$1" > "$WORK/$1.log" 2>&1 \
    || die "replay $1 failed: $(tail -5 "$WORK/$1.log")"
}
others calm
"$KVBENCH" probe slow-readers --target "127.0.0.1:$LISTEN" --conns 10 --streams 128 \
  --duration-s $((LOAD_S + 30)) > "$OUT/slow-readers.json" 2> "$WORK/probe.err" &
ATTACK_PID=$!
sleep 5
others attacked
ATTACK_RSS=$(rss "$KV_PID" VmRSS)
wait "$ATTACK_PID" || die "the probe failed: $(cat "$WORK/probe.err")"
kill -0 "$KV_PID" || die "kvroute died under the slow readers: $(tail -5 "$WORK/kvroute.err")"
SLOW=$(python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
rows = []
for run in ("calm", "attacked"):
    s = json.load(open(f"{out}/{run}/report.json"))["summary"]
    ok = s["requests"] - s["errors"] - s["timeouts"]
    rows.append((run, s["requests"], ok, s["ttft_p50_ms"], s["ttft_p99_ms"]))
calm_p99 = rows[0][4]
for run, n, ok, p50, p99 in rows:
    if p99 is None:
        print(f"| other clients, {run} | {ok}/{n} succeeded | no TTFT (nothing succeeded) |")
        continue
    print(f"| other clients, {run} | {ok}/{n} succeeded | TTFT p50 {p50:.0f} ms, p99 {p99:.0f} ms "
          f"({p99 / calm_p99:.2f}x calm) |")
a = json.load(open(f"{out}/slow-readers.json"))
ends = ", ".join(f"{n} {k}" for k, n in a["outcomes"].items())
print(f"| the attack: {a['conns']} x {a['streams']} zero-window streams | {a['opened']} opened: {ends} | |")
PY
)

# TLS: testssl.sh's findings above LOW.
TLS_SCAN="not run (testssl.sh not installed)"
if command -v testssl >/dev/null; then
  testssl --quiet --color 0 --warnings off --jsonfile "$OUT/testssl.json" --ip one \
    "127.0.0.1:$TLS" > "$WORK/testssl.txt" 2>&1 || true
  TLS_SCAN=$(python3 - "$OUT/testssl.json" <<'PY'
import json, sys
above = [f for f in json.load(open(sys.argv[1])) if f["severity"] in ("MEDIUM", "HIGH", "CRITICAL")]
server = [f"{f['severity']} {f['id']}: {f['finding']}" for f in above if not f["id"].startswith("cert_")]
cert = [f"{f['severity']} {f['id']}" for f in above if f["id"].startswith("cert_")]
print(f"server: {'; '.join(server) or 'nothing above LOW'}; the throwaway certificate's own: {', '.join(cert) or 'none'}")
PY
)
fi

# TLS: sslyze, trusting the throwaway CA.
SSLYZE=${SSLYZE:-$(command -v sslyze || true)}
SSLYZE_SCAN="not run (sslyze not installed)"
if [ -n "$SSLYZE" ]; then
  "$SSLYZE" --mozilla_config=intermediate --certinfo_ca_file "$WORK/ca.pem" --resum \
    --json_out "$OUT/sslyze.json" "127.0.0.1:$TLS" > "$WORK/sslyze.txt" 2>&1 || true
  SSLYZE_SCAN=$(python3 - "$OUT/sslyze.json" "$WORK/sslyze.txt" <<'PY'
import json, sys
scan = json.load(open(sys.argv[1]))["server_scan_results"][0]["scan_result"]
text = open(sys.argv[2]).read()
tail = text.split("COMPLIANCE AGAINST", 1)[-1]
verdict = [l.strip() for l in tail.splitlines() if "127.0.0.1" in l or l.strip().startswith("*")]
cert = scan["certificate_info"]["result"]["certificate_deployments"][0]
ocsp = cert["ocsp_response"]
staple = f"OCSP staple {ocsp['response_status']} {ocsp.get('certificate_status', '')}, trusted {cert['ocsp_response_is_trusted']}" if ocsp else "no OCSP staple"
resum = scan["session_resumption"]["result"] or {}
tickets = resum.get("tls_ticket_resumption_result", "?")
ids = f"{resum.get('session_id_successful_resumptions_count', '?')}/{resum.get('session_id_attempted_resumptions_count', '?')}"
print(f"Mozilla intermediate: {' '.join(verdict) or 'no verdict'}; {staple}; TLS 1.2 resumption by ticket {tickets}, by session id {ids}")
PY
)
fi

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
  echo "| HTTP/2 floods | $FLOODS | |"
  echo "| testssl.sh, full scan | $TLS_SCAN | |"
  echo "| sslyze | $SSLYZE_SCAN | |"
  echo
  echo "Slow readers (kvroute RSS at the end of the attacked run: $(( (ATTACK_RSS - IDLE) / 1024 )) MiB above idle):"
  echo
  echo "| run | answered | latency |"
  echo "|---|---|---|"
  echo "$SLOW"
} > "$OUT/README.md"
cat "$OUT/README.md"
