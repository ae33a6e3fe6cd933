#!/usr/bin/env python3
"""How long one llama-server takes to prefill a prompt, by its length and the context it extends.

The simulator's `cpu-smollm2` stand-in prices a prompt as `40 ms + tokens / rate` whatever
context it extends (bench/src/sim/engine/profile.rs); this measures the real engine the same way
it is run in the real fleet (`-t 1 --parallel 2 -c 8192 --cache-ram 256`), on this machine, now:
cold prompts of several lengths, each extended three times (a later turn's new tokens on top of
a cached history), every request one slot's, `n_predict` 1. It prints the engine's own
`timings.prompt_n` and `prompt_ms` beside the tokens already cached ahead of the prompt, one
stream's decode per token at each cold prompt's context, and the least-squares fit (relative
error) of `prompt_ms = t_prompt + n / rate + t_ctx * sum over 512-token ubatches of
min(tokens, 60) * (context ahead + tokens / 2)`: attention over the context ahead costs each
query token of a ubatch, up to ~60 of them (past that the engine batches them; 60 fits best).

Usage: bench/scripts/llama_prefill_probe.py [VENV] [SEED]   (default bench/.venv-llama, 1)
Talks only to 127.0.0.1; stdlib only.
"""

import json
import random
import socket
import subprocess
import sys
import time
import urllib.request

venv = sys.argv[1] if len(sys.argv) > 1 else "bench/.venv-llama"
rng = random.Random(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
# One token each in SmolLM2's vocabulary, so a prompt's size in words is its size in tokens.
WORDS = ("the of and to in is was for on that with as by at from his her an which were are "
         "this be had not but they one have house water river city green light small large "
         "open close").split()


def text(n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


port = free_port()
base = f"http://127.0.0.1:{port}"


def post(path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


server = subprocess.Popen(
    [f"{venv}/bin/llama-server", "-m", f"{venv}/models/smollm2-135m-q4_1.gguf", "-t", "1",
     "--parallel", "2", "-c", "8192", "--cache-ram", "256", "--host", "127.0.0.1",
     "--port", str(port)],
    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    for _ in range(240):
        try:
            urllib.request.urlopen(base + "/health", timeout=1)
            break
        except OSError:
            time.sleep(0.5)
    else:
        sys.exit("llama-server did not become healthy")
    print("| new tokens | cached ahead | prompt_ms | ms per new token |")
    print("|---|---|---|---|")
    rows, decode = [], []

    def run(prompt):
        r = post("/completion", {"prompt": prompt, "n_predict": 1, "cache_prompt": True,
                                 "id_slot": 0})
        t = r["timings"]
        n, ms = t["prompt_n"], t["prompt_ms"]
        ahead = r["tokens_cached"] - n
        rows.append((n, ahead, ms))
        print(f"| {n} | {ahead} | {ms:.0f} | {ms / max(n, 1):.1f} |", flush=True)

    post("/completion", {"prompt": text(20), "n_predict": 1})  # warm-up, not printed
    for words in [30, 100, 300, 700, 1500, 2800]:
        prompt = text(words)
        run(prompt)
        r = post("/completion", {"prompt": prompt, "n_predict": 32, "cache_prompt": True,
                                 "id_slot": 0, "ignore_eos": True})
        decode.append((r["tokens_cached"], r["timings"]["predicted_per_token_ms"]))
        for extra in [20, 60, 200]:
            prompt += " " + text(extra)
            run(prompt)
finally:
    server.terminate()
    server.wait()

print("\n| context | decode ms per token (one stream) |\n|---|---|")
for ctx, ms in decode:
    print(f"| {ctx} | {ms:.1f} |")


def pairs(n, ahead, ubatch=512, queries=60):
    total, done = 0.0, 0
    while done < n:
        m = min(ubatch, n - done)
        total += min(m, queries) * (ahead + done + m / 2)
        done += m
    return total


# Weighted least squares (weights 1/ms: relative error) by the normal equations, 3 unknowns.
xs = [(1.0, float(n), pairs(n, a)) for n, a, _ in rows]
ys = [ms for *_, ms in rows]
ata = [[sum(x[i] * x[j] / y ** 2 for x, y in zip(xs, ys)) for j in range(3)] for i in range(3)]
aty = [sum(x[i] / y for x, y in zip(xs, ys)) for i in range(3)]
for col in range(3):  # Gauss-Jordan
    piv = ata[col][col]
    ata[col] = [v / piv for v in ata[col]]
    aty[col] /= piv
    for row in range(3):
        if row != col:
            f = ata[row][col]
            ata[row] = [v - f * w for v, w in zip(ata[row], ata[col])]
            aty[row] -= f * aty[col]
t_prompt, per_token, t_ctx = aty
errs = sorted(abs((t_prompt + n * per_token + t_ctx * pairs(n, a)) / ms - 1) for n, a, ms in rows)
print(f"\nfit: t_prompt {t_prompt:.1f} ms, rate {1000 / per_token:.0f} tokens/s, "
      f"t_ctx {t_ctx * 1e3:.2f} us per query-context pair; relative error median "
      f"{errs[len(errs) // 2]:.2f}, max {errs[-1]:.2f}")
