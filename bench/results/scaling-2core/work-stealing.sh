#!/usr/bin/env bash
# CPU per request of kvroute and the bare Pingora proxy with Pingora's work_stealing on and off, 1 KB chat:
# one worker thread pinned to CPU 1, then two sharing CPUs 0-1 with wrk and the backend.
#   work-stealing.sh KVROUTE BARE_PINGORA   (ROUNDS, SECS from the environment)
set -u
KV=${1:?kvroute}; BARE=${2:?bare_pingora}; SECS=${SECS:-6}; ROUNDS=${ROUNDS:-2}
W=$(mktemp -d /tmp/kvroute-scale.XXXXXX); rm -rf $W; mkdir -p $W
JSON_BODY='{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"completion_tokens":1,"total_tokens":11}}'
cat > $W/backend.conf <<CONF
worker_processes 1;
pid $W/backend.pid;
error_log $W/backend.err warn;
events { worker_connections 4096; }
http { access_log off; client_max_body_size 10m; client_body_buffer_size 1m; keepalive_requests 1000000;
  server { listen 127.0.0.1:18301; location / { default_type application/json; return 200 '$JSON_BODY'; } } }
CONF
taskset -c 0 nginx -c $W/backend.conf -p $W
python3 - $W <<'PY'
import json,sys
w=sys.argv[1]; text="lorem ipsum dolor sit amet, consectetur adipiscing elit. "
msgs=[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":(text*20)[:850]}]
open(f"{w}/b.json","w").write(json.dumps({"model":"m","stream":False,"max_tokens":2,"messages":msgs}))
open(f"{w}/b.lua","w").write(f'wrk.method="POST"\nwrk.headers["Content-Type"]="application/json"\nlocal f=io.open("{w}/b.json","rb"); wrk.body=f:read("*all"); f:close()\n')
PY
wait_port() { for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$1) 2>/dev/null && return 0; sleep 0.05; done; return 1; }
ticks() { awk '{print $14+$15}' /proc/$1/stat; }
for r in $(seq $ROUNDS); do
for proxy in bare kvroute; do
for ws in true false; do
for threads in 1 2; do
  cores=$([ $threads = 1 ] && echo 1 || echo 0,1)
  conf="version: 1
threads: $threads
work_stealing: $ws
pid_file: $W/p.pid
upgrade_sock: $W/p.sock
grace_period_seconds: 0
graceful_shutdown_timeout_seconds: 1"
  if [ $proxy = kvroute ]; then
    printf '%s\nkvroute:\n  listen: "127.0.0.1:18320"\n  admin_listen: "127.0.0.1:18321"\n  backends:\n    - addr: "127.0.0.1:18301"\n' "$conf" > $W/kv.yaml
    RUST_LOG=warn taskset -c $cores $KV -c $W/kv.yaml 2>$W/kv.err & P=$!; port=18320
  else
    echo "$conf" > $W/bare.yaml
    RUST_LOG=warn taskset -c $cores $BARE $W/bare.yaml 127.0.0.1:18330 127.0.0.1:18301 2>$W/bare.err & P=$!; port=18330
  fi
  wait_port $port; sleep 1
  b=$(ticks $P)
  taskset -c $([ $threads = 1 ] && echo 0 || echo 0,1) wrk -t$threads -c32 -d${SECS}s -s $W/b.lua http://127.0.0.1:$port/v1/chat/completions > $W/out.txt
  a=$(ticks $P)
  awk -v p=$proxy -v ws=$ws -v t=$threads -v ticks=$((a-b)) '/requests in/{n=$1} /Requests\/sec/{r=$2} /Non-2xx/{e=$NF} END{printf "%s ws=%s threads=%s rps=%s cpu_ms_per_req=%.4f non2xx=%s\n", p, ws, t, r, ticks/100/n*1000, e+0}' $W/out.txt
  kill -INT $P; wait $P 2>/dev/null
done; done; done; done
kill $(cat $W/backend.pid)
