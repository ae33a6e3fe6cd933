#!/usr/bin/env python3
"""Medians over repeated `kvbench compare` runs of the same command: per workload and policy,
the median of each metric across the runs, with every run's value after it.

    bench/scripts/median_compare.py bench/results/peers-rep-{1,2,3}/results.json

Single runs move: a percentile that sits where a workload's distribution steps (hot_prefix's
p90, mooncake's p50; `ttft_quantiles.py`) lands on either side of the step from run to run.
"""
import json
import statistics
import sys

METRICS = (
    ("TTFT p50 ms", "ttft_p50_ms", 0),
    ("TTFT p90 ms", "ttft_p90_ms", 0),
    ("TTFT p99 ms", "ttft_p99_ms", 0),
    ("e2e p99 ms", "e2e_p99_ms", 0),
    ("cache hit", "cache_hit_rate", 3),
    ("goodput req/s", "goodput_rps", 2),
)


def main(paths):
    if not paths:
        sys.exit(__doc__)
    # (workload, policy) -> metric -> [value per run]
    table, workloads, policies = {}, [], {}
    for path in paths:
        for w in json.load(open(path))["results"]:
            if w["workload"] not in workloads:
                workloads.append(w["workload"])
            for label, summary in w["runs"]:
                policies.setdefault(w["workload"], [])
                if label not in policies[w["workload"]]:
                    policies[w["workload"]].append(label)
                cell = table.setdefault((w["workload"], label), {})
                for _, key, _ in METRICS:
                    cell.setdefault(key, []).append(summary.get(key))
    print(f"Medians of {len(paths)} runs (each run's value in brackets).\n")
    print("| workload | policy | " + " | ".join(name for name, _, _ in METRICS) + " |")
    print("|---|---|" + "---|" * len(METRICS))
    for w in workloads:
        for p in policies[w]:
            cells = []
            for _, key, digits in METRICS:
                vals = [v for v in table[(w, p)][key] if v is not None]
                if not vals:
                    cells.append("n/a")
                    continue
                runs = ", ".join(f"{v:.{digits}f}" for v in vals)
                cells.append(f"{statistics.median(vals):.{digits}f} ({runs})")
            print(f"| {w} | {p} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
