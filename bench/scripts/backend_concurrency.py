#!/usr/bin/env python3
"""How evenly a run spread its requests in flight over the backends, and what that did to
decode speed: per run, the e2e p99 and the requests at or above it (their output tokens, TTFT
and mean inter-token time), the mean inter-token time of requests with at least 300 output
tokens, and per-backend concurrency (requests in flight, 100 ms bins of model time, the middle
60% of the run): max/mean across backends over time, and each backend's mean.

Reads the report.json of runs made with `kvbench compare --keep-records`.

    bench/scripts/backend_concurrency.py RESULTS_DIR [RESULTS_DIR ...]
"""
import collections
import json
import os
import statistics as st
import sys

from turn_moves import each_run


def q(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(p * len(v)))]


def itl(x):
    return (x["e2e_ms"] - x["ttft_ms"]) / max(1, x["completion_tokens"] - 1)


def row(path):
    r = json.load(open(os.path.join(path, "report.json")))
    recs = [x for x in r.get("records", []) if x.get("error") is None and x.get("ttft_ms") is not None]
    if not recs:
        return None
    p99 = q([x["e2e_ms"] for x in recs], 0.99)
    tail = [x for x in recs if x["e2e_ms"] >= p99]
    long = [x for x in recs if (x["completion_tokens"] or 0) >= 300]
    t0 = min(x["send_ms"] for x in recs)
    bins = int((max(x["send_ms"] + x["e2e_ms"] for x in recs) - t0) / 100) + 1
    by = collections.defaultdict(lambda: [0] * bins)
    for x in recs:
        for i in range(int((x["send_ms"] - t0) / 100), int((x["send_ms"] + x["e2e_ms"] - t0) / 100) + 1):
            by[x["backend"]][i] += 1
    lo, hi = int(bins * 0.2), int(bins * 0.8)
    ratios = []
    for i in range(lo, hi):
        c = [v[i] for v in by.values()]
        if sum(c):
            ratios.append(max(c) / (sum(c) / len(c)))
    means = sorted(round(st.mean(v[lo:hi]), 1) for v in by.values())
    long_itl = "/".join(f"{q([itl(x) for x in long], p):.2f}" for p in (0.5, 0.9, 0.99)) if long else "n/a"
    return (
        f"e2e p99 {p99:.0f} ms; at or above it: {len(tail)} requests, output tokens median "
        f"{st.median(x['completion_tokens'] for x in tail):.0f}, TTFT median "
        f"{st.median(x['ttft_ms'] for x in tail):.0f} ms, mean ITL median {st.median(itl(x) for x in tail):.2f} ms; "
        f">=300 tokens mean ITL p50/p90/p99 {long_itl} ms; in flight max/mean p50 {q(ratios, 0.5):.2f} "
        f"p90 {q(ratios, 0.9):.2f}; per backend {means}"
    )


if __name__ == "__main__":
    each_run(sys.argv, row)
