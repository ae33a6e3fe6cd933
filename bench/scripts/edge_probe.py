#!/usr/bin/env python3
"""Raw-socket edge probes against one kvroute listener on 127.0.0.1 (stdlib only).

Used by bench/scripts/edge_check.sh; each prints one line of JSON.

  edge_probe.py stalled-bodies PORT CONNS BYTES HOLD_S
      CONNS connections each declare a BYTES-byte chat body and send all of it but the last
      10 bytes, then hold HOLD_S seconds. Reports how each was answered while held (status
      line, or "held" when nothing came back).
  edge_probe.py parse-bomb PORT MESSAGES
      One chat body of MESSAGES one-character messages, sent whole. Reports the status.
  edge_probe.py smuggle PORT
      CL.TE, TE.CL and duplicate Content-Length requests; reports each status line.
"""
import json
import os
import socket
import sys
import time


# The model every probe's body names (the simulator's by default).
MODEL = os.environ.get("PROBE_MODEL", "sim-llama-8b").encode()


def connect(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def status_line(s, wait_s):
    s.settimeout(wait_s)
    try:
        data = s.recv(4096)
    except (socket.timeout, TimeoutError):
        return "held"
    except ConnectionError as e:
        return f"reset ({e.__class__.__name__})"
    if not data:
        return "closed"
    return data.split(b"\r\n", 1)[0].decode("latin-1")


def chat_head(port, length):
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def stalled_bodies(port, conns, size, hold_s):
    prefix = b'{"model":"' + MODEL + b'","messages":[{"role":"user","content":"'
    chunk = b"a" * (1 << 20)
    socks, answers = [], []
    for _ in range(conns):
        s = connect(port)
        s.sendall(chat_head(port, size))
        s.sendall(prefix)
        left = size - 10 - len(prefix)
        try:
            while left > 0:
                n = min(left, len(chunk))
                s.sendall(chunk[:n])
                left -= n
        except ConnectionError:
            pass
        socks.append(s)
    time.sleep(hold_s)
    for s in socks:
        answers.append(status_line(s, 0.5))
        s.close()
    return {"probe": "stalled-bodies", "conns": conns, "bytes": size, "answers": answers}


def parse_bomb(port, messages):
    one = b'{"role":"user","content":"a"},'
    body = b'{"model":"' + MODEL + b'","max_tokens":1,"messages":[' + one * (messages - 1) + one[:-1] + b"]}"
    s = connect(port)
    s.sendall(chat_head(port, len(body)) + body)
    answer = status_line(s, 60)
    s.close()
    return {"probe": "parse-bomb", "messages": messages, "bytes": len(body), "answer": answer}


def smuggle(port):
    body = b'{"model":"' + MODEL + b'","messages":[]}'
    cases = {
        "cl_te": (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n"
        ).encode() + body,
        "te_obfuscated": (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: xchunked\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body,
        "duplicate_cl": (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
            f"Content-Length: {len(body) + 5}\r\n\r\n"
        ).encode() + body,
        "no_host": (
            f"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body,
    }
    out = {}
    for name, raw in cases.items():
        s = connect(port)
        s.sendall(raw)
        out[name] = status_line(s, 10)
        s.close()
    return {"probe": "smuggle", "answers": out}


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    probe, port = argv[1], int(argv[2])
    if probe == "stalled-bodies":
        result = stalled_bodies(port, int(argv[3]), int(argv[4]), float(argv[5]))
    elif probe == "parse-bomb":
        result = parse_bomb(port, int(argv[3]))
    elif probe == "smuggle":
        result = smuggle(port)
    else:
        sys.exit(f"unknown probe {probe!r}\n{__doc__}")
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv)
