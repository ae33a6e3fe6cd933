#!/usr/bin/env python3
"""Compact Markdown summary of a `kvbench compare` results.json: per workload, each policy's
TTFT p50/p90/p99, cache hit vs oracle, output tok/s and prefill balance, with each metric's
best value in bold.

    python3 bench/scripts/summarize_compare.py bench/results/n8/results.json
"""
import json
import sys


def fmt(v, d=0):
    return "n/a" if v is None else f"{v:.{d}f}"


def main(path):
    r = json.load(open(path))
    out = []
    for w in r["results"]:
        runs = w["runs"]
        out.append(f"**{w['workload']}**\n")
        out.append("| policy | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | cache hit / oracle | output tok/s | prefill max/mean |")
        out.append("|---|---|---|---|---|---|---|")
        best = {
            k: min(s[k] for _, s in runs if s[k] is not None)
            for k in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms")
        }
        best_hit = max((s["cache_hit_rate"] or 0) for _, s in runs)
        for label, s in runs:
            cells = []
            for k in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms"):
                v = fmt(s[k])
                cells.append(f"**{v}**" if s[k] == best[k] else v)
            hit = s["cache_hit_rate"] or 0
            oracle = s["oracle_hit_rate"]
            hit_s = f"{hit:.3f} / {fmt(oracle, 3)}"
            cells.append(f"**{hit_s}**" if hit == best_hit else hit_s)
            cells.append(f"{s['output_tok_s']:.0f}")
            mx, mean = s.get("prefill_share_max"), s.get("prefill_share_mean")
            cells.append(f"{mx / mean:.2f}" if mx and mean else "n/a")
            out.append(f"| {label} | " + " | ".join(cells) + " |")
        out.append("")
    print("\n".join(out))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/n8/results.json")
