#!/usr/bin/env python3
"""TTFT quantiles and big misses per run of a `kvbench compare --keep-records` workload.

    bench/scripts/ttft_quantiles.py RESULTS_DIR/WORKLOAD [BIG_TOKENS=3000]

For each run (policy directory with a report.json holding records): TTFT at p40..p60 and
p85..p95, to show whether a percentile sits on a cliff of the distribution (where one run's
p50 or p90 can land on either side); and, grouping requests by their session id up to `-req`
(the tenant of hot_prefix), how many requests computed more than BIG_TOKENS uncached tokens
as their group's first request (a miss no router avoids) or later (a miss the router chose or
could not avoid), and how many of each were slower than the run's p90 boundary.
"""
import json
import os
import sys

QUANTILES = (0.40, 0.45, 0.50, 0.55, 0.60, 0.85, 0.90, 0.95)


def runs(workload_dir):
    for name in sorted(os.listdir(workload_dir)):
        path = os.path.join(workload_dir, name, "report.json")
        if os.path.exists(path):
            records = json.load(open(path)).get("records") or []
            if records:
                yield name, records


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    big = int(sys.argv[2]) if len(sys.argv) > 2 else 3000
    for name, records in runs(sys.argv[1]):
        records.sort(key=lambda r: r["send_ms"])
        ttft = sorted(r["ttft_ms"] for r in records if r.get("ttft_ms") is not None)
        n = len(ttft)
        qs = ", ".join(f"p{round(q * 100)} {ttft[min(n - 1, int(q * n))]:.0f}" for q in QUANTILES)
        print(f"{name}: {n} requests; TTFT ms {qs}")
        p90 = ttft[min(n - 1, int(0.9 * n))]
        seen, counts = set(), {}
        for r in records:
            # A trace without sessions (mooncake) makes every request its own group.
            group = (r.get("session") or f"request {r['id']}").split("-req")[0]
            first = group not in seen
            seen.add(group)
            if r["prompt_tokens"] - r["cached_tokens"] <= big:
                kind = "hit"
            else:
                kind = "first miss" if first else "later miss"
            total, slow = counts.get(kind, (0, 0))
            counts[kind] = (total + 1, slow + (r["ttft_ms"] >= p90))
        print("  " + "; ".join(f"{k}: {t} ({s} at or over p90)" for k, (t, s) in sorted(counts.items())))


if __name__ == "__main__":
    main()
