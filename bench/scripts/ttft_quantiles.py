#!/usr/bin/env python3
"""TTFT quantiles and big misses per run of `kvbench compare --keep-records`.

    bench/scripts/ttft_quantiles.py RESULTS_DIR [RESULTS_DIR ...]

For each run: TTFT at p40..p60 and p85..p95, to show whether a percentile sits on a cliff of
the distribution (where one run's p50 or p90 can land on either side); and, grouping requests
by their session id up to `-req` (the tenant of hot_prefix), how many requests computed more
than BIG_TOKENS (3,000) uncached tokens as their group's first request (a miss no router
avoids) or later (a miss the router chose or could not avoid), and how many of each were at
or over the run's p90.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from turn_moves import each_run, uncached  # noqa: E402

QUANTILES = (0.40, 0.45, 0.50, 0.55, 0.60, 0.85, 0.90, 0.95)
BIG_TOKENS = 3000


def row(run):
    records = json.load(open(os.path.join(run, "report.json"))).get("records") or []
    if not records:
        return None
    records.sort(key=lambda r: r["send_ms"])
    ttft = sorted(r["ttft_ms"] for r in records if r.get("ttft_ms") is not None)
    n = len(ttft)
    qs = ", ".join(f"p{round(q * 100)} {ttft[min(n - 1, int(q * n))]:.0f}" for q in QUANTILES)
    p90 = ttft[min(n - 1, int(0.9 * n))]
    seen, counts = set(), {}
    for r in records:
        # A trace without sessions (mooncake) makes every request its own group.
        group = (r.get("session") or f"request {r['id']}").split("-req")[0]
        first = group not in seen
        seen.add(group)
        if uncached(r) <= BIG_TOKENS:
            kind = "hit"
        else:
            kind = "first miss" if first else "later miss"
        total, slow = counts.get(kind, (0, 0))
        counts[kind] = (total + 1, slow + (r["ttft_ms"] >= p90))
    kinds = "; ".join(f"{k}: {t} ({s} at or over p90)" for k, (t, s) in sorted(counts.items()))
    return f"{n} requests; TTFT ms {qs}\n    {kinds}"


def main():
    each_run(sys.argv, row, width=28)


if __name__ == "__main__":
    main()
