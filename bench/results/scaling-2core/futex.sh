#!/usr/bin/env bash
# futex syscalls per request of kvroute or the bare Pingora proxy with two worker threads sharing
# CPUs 0-1 with wrk (-c32, 1 KB chat) and an nginx backend, counted by `perf stat` over 3 s.
#   futex.sh kvroute|bare true|false(work_stealing)   (KVBIN, BARE: the binaries; ENVX: a prefix
#   such as "env GLIBC_TUNABLES=glibc.malloc.tcache_count=1000" for kvroute)
set -u
W=$(mktemp -d /tmp/kvroute-futex.XXXXXX); BARE=${BARE:-/var/tmp/kvroute-lto/release/examples/bare_pingora}
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
conf="version: 1
threads: 2
work_stealing: $2
pid_file: $W/p.pid
upgrade_sock: $W/p.sock
grace_period_seconds: 0
graceful_shutdown_timeout_seconds: 1"
if [ $1 = kvroute ]; then
  printf '%s\nkvroute:\n  listen: "127.0.0.1:18320"\n  admin_listen: "127.0.0.1:18321"\n  backends:\n    - addr: "127.0.0.1:18301"\n' "$conf" > $W/kv.yaml
  RUST_LOG=warn ${ENVX:-} taskset -c 0,1 ${KVBIN:-/var/tmp/kvroute-lto/release/kvroute} -c $W/kv.yaml 2>$W/kv.err & P=$!; port=18320
else
  echo "$conf" > $W/bare.yaml
  RUST_LOG=warn taskset -c 0,1 $BARE $W/bare.yaml 127.0.0.1:18330 127.0.0.1:18301 2>$W/bare.err & P=$!; port=18330
fi
wait_port $port; sleep 1
taskset -c 0,1 wrk -t2 -c32 -d6s -s $W/b.lua http://127.0.0.1:$port/v1/chat/completions > $W/fx.txt &
WP=$!
sleep 1
timeout -s INT 4 perf stat -e syscalls:sys_enter_futex -p $P -o $W/fstat.txt -- sleep 3 2>/dev/null >/dev/null
wait $WP
kill -INT $P; wait $P 2>/dev/null
kill $(cat $W/backend.pid)
rps=$(awk '/Requests\/sec/{print $2}' $W/fx.txt)
f=$(awk '/sys_enter_futex/{gsub(",","",$1); print $1}' $W/fstat.txt)
python3 -c "print('$1 ws=$2 ${ENVX:-} rps=$rps futex/req=%.3f' % ($f/($rps*3)))"
