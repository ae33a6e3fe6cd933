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
  edge_probe.py h2-floods PORT
      On h2c (prior knowledge), one connection each: rapid reset (1,000 streams opened and
      reset at once), a CONTINUATION flood (a header block that never ends, 1 MiB of
      CONTINUATION frames), a SETTINGS flood (10,000 SETTINGS frames, no ACK read). Reports
      how each connection ended: the GOAWAY's error code, closed, or still open after 10 s.
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


H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
GOAWAY_CODES = {0: "NO_ERROR", 1: "PROTOCOL_ERROR", 2: "INTERNAL_ERROR", 3: "FLOW_CONTROL_ERROR",
                6: "FRAME_SIZE_ERROR", 7: "REFUSED_STREAM", 11: "ENHANCE_YOUR_CALM",
                9: "COMPRESSION_ERROR"}


def frame(kind, flags, stream, payload=b""):
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def literal(name, value):
    """An HPACK literal header field without indexing, new name (RFC 7541 6.2.2)."""
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def request_block(port):
    return (literal(b":method", b"POST") + literal(b":scheme", b"http")
            + literal(b":path", b"/v1/chat/completions")
            + literal(b":authority", f"127.0.0.1:{port}".encode()))


def h2_ending(s, wait_s):
    """Read until a GOAWAY, the close, or wait_s: how the connection ended."""
    s.settimeout(wait_s)
    buf = b""
    deadline = time.time() + wait_s
    while time.time() < deadline:
        try:
            data = s.recv(65536)
        except (socket.timeout, TimeoutError):
            break
        except ConnectionError:
            return "reset"
        if not data:
            return "closed"
        buf += data
        while len(buf) >= 9:
            n = int.from_bytes(buf[:3], "big")
            if len(buf) < 9 + n:
                break
            if buf[3] == 7:
                code = int.from_bytes(buf[9 + 4:9 + 8], "big")
                return "GOAWAY " + GOAWAY_CODES.get(code, str(code))
            buf = buf[9 + n:]
    return "still open"


def h2_floods(port):
    out = {}
    # Rapid reset: HEADERS then RST_STREAM(CANCEL), 1,000 times.
    s = connect(port)
    s.sendall(H2_PREFACE + frame(4, 0, 0))
    block = request_block(port)
    burst = b"".join(frame(1, 0x4, sid, block) + frame(3, 0, sid, (8).to_bytes(4, "big"))
                     for sid in range(1, 2001, 2))
    try:
        s.sendall(burst)
    except ConnectionError:
        pass
    out["rapid_reset"] = h2_ending(s, 10)
    s.close()
    # CONTINUATION flood: HEADERS without END_HEADERS, then CONTINUATION frames without end.
    s = connect(port)
    s.sendall(H2_PREFACE + frame(4, 0, 0) + frame(1, 0, 1, block))
    filler = literal(b"x-flood", b"a" * 100)
    try:
        for _ in range(1024):
            s.sendall(frame(9, 0, 1, filler * 9))
    except ConnectionError:
        pass
    out["continuation_flood"] = h2_ending(s, 10)
    s.close()
    # SETTINGS flood: SETTINGS frames, never reading the ACKs.
    s = connect(port)
    s.sendall(H2_PREFACE)
    settings = frame(4, 0, 0, (3).to_bytes(2, "big") + (100).to_bytes(4, "big"))
    try:
        s.sendall(settings * 10000)
    except ConnectionError:
        pass
    out["settings_flood"] = h2_ending(s, 10)
    s.close()
    return {"probe": "h2-floods", "answers": out}


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
    elif probe == "h2-floods":
        result = h2_floods(port)
    else:
        sys.exit(f"unknown probe {probe!r}\n{__doc__}")
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv)
