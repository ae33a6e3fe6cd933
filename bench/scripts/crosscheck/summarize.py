#!/usr/bin/env python3
"""Summarises the cross-check runs of kvbench replay against aiperf (crosscheck/run.sh).
Used by: docs/results/reliability.md (the run: bench/results/crosscheck)

TTFT p50 and output tok/s as each tool reports them, plus two diagnostics computed the same way
for both tools from their per-request files:
- dispatch gap: for each request after the first wave, the time from the latest completion
  before its send to the send (how quickly the closed loop refills a free slot);
- the simulator's own TTFT (`vllm:time_to_first_token_seconds` of the target server, scraped
  just before it was stopped into `<run>-sim-metrics.txt`): exact mean and median bucket.

    python3 bench/scripts/crosscheck/summarize.py RUN_DIR   # holding aiperf-*/ and kvbench-*/ runs
"""

import json
import re
import statistics
import sys
from pathlib import Path


def pct(v, p):
    v = sorted(v)
    r = p / 100 * (len(v) - 1)
    lo, hi = int(r), min(int(r) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (r - lo)


def gaps(spans, workers):
    """spans: (send, end) ms. Median refill delay of requests after the first wave."""
    spans = sorted(spans)
    ends = sorted(e for _, e in spans)
    out = []
    for s, _ in spans[workers:]:
        prev = [e for e in ends if e <= s]
        if prev:
            out.append(s - prev[-1])
    return statistics.median(out) if out else float("nan")


def sim_hist(path):
    """The simulator's own TTFT (server 0, the target): exact mean (sum / count) and the
    bucket holding the median."""
    if not path.exists():
        return None
    b, total, count = [], None, None
    for line in path.read_text().splitlines():
        m = re.match(r'vllm:time_to_first_token_seconds_bucket\{.*le="([^"]+)"\} (\d+)', line)
        if m:
            b.append((float(m.group(1)), int(m.group(2))))
        m = re.match(r"vllm:time_to_first_token_seconds_(sum|count)\{.*\} (\S+)", line)
        if m and m.group(1) == "sum":
            total = float(m.group(2))
        elif m:
            count = float(m.group(2))
    if not b or not count:
        return None
    lower, median = 0.0, "?"
    for le, c in b:
        if c >= b[-1][1] / 2:
            median = f"{lower * 1e3:.0f}-{le * 1e3:.0f}"
            break
        lower = le
    return f"mean {total / count * 1e3:.0f}, median in {median}"


def aiperf(d):
    j = json.loads((d / "profile_export_aiperf.json").read_text())
    recs = [json.loads(l) for l in open(d / "profile_export.jsonl")]
    spans = [(r["metadata"]["request_start_ns"] / 1e6, r["metadata"]["request_end_ns"] / 1e6) for r in recs]
    ttft = [r["metrics"]["time_to_first_token"]["value"] for r in recs]
    e2e = [r["metrics"]["request_latency"]["value"] for r in recs]
    return dict(
        ttft_p50=j["time_to_first_token"]["p50"],
        tok_s=j["output_token_throughput"]["avg"],
        e2e_p50=pct(e2e, 50),
        n=len(recs),
        ttft_mean=statistics.mean(ttft),
        spans=spans,
    )


def kvbench(d):
    j = json.loads((d / "report.json").read_text())
    s = j["summary"]
    recs = j["records"]
    ttft = [r["ttft_ms"] for r in recs if r.get("ttft_ms") is not None]
    spans = [(r["send_ms"], r["send_ms"] + r["e2e_ms"]) for r in recs]
    return dict(
        ttft_p50=s["ttft_p50_ms"],
        tok_s=s["output_tok_s"],
        e2e_p50=s["e2e_p50_ms"],
        ttft_mean=statistics.mean(ttft),
        n=len(recs),
        spans=spans,
    )


def main():
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    rows = []
    for d in sorted(root.iterdir()):
        if not d.is_dir() or d.name == "contaminated":
            continue
        if (d / "profile_export_aiperf.json").exists() and (d / "profile_export.jsonl").exists():
            r, tool = aiperf(d), "aiperf"
        elif (d / "report.json").exists():
            r, tool = kvbench(d), "kvbench"
        else:
            continue
        workers = 1 if "-c1-" in d.name else 8
        rows.append((d.name, tool, r, gaps(r["spans"], workers), sim_hist(root / f"{d.name}-sim-metrics.txt")))
    print("| run | tool | requests | TTFT p50 ms | output tok/s | TTFT mean ms | e2e p50 ms | dispatch gap p50 ms | simulator's TTFT ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, tool, r, g, h in rows:
        print(f"| {name} | {tool} | {r['n']} | {r['ttft_p50']:.0f} | {r['tok_s']:.1f} | {r['ttft_mean']:.0f} | {r['e2e_p50']:.0f} | {g:.1f} | {h or '-'} |")


if __name__ == "__main__":
    main()
