#!/usr/bin/env python3
"""Where a multi-turn run's slow first tokens come from: turns that changed backend.

Reads the report.json of runs made with `kvbench compare --keep-records` and prints, per run:
cache hit rate, TTFT p50/p90/p99, the share of requests with at least 256 uncached prompt
tokens, how many later turns went to another backend than the turn before them ("moves"), how
many of those came straight back on the next turn ("back"), and whether the moved turns missed.

    bench/scripts/turn_moves.py RESULTS_DIR [RESULTS_DIR ...]

A run's turn order is its requests' send order within each session (`records[].session`).
"""
import collections
import glob
import json
import os
import sys

BIG = 256  # uncached prompt tokens that make a first token slow (about 10 ms of prefill)


def uncached(x):
    return (x.get("prompt_tokens") or 0) - (x.get("cached_tokens") or 0)


def turns(records):
    by = collections.defaultdict(list)
    for x in sorted(records, key=lambda x: x["send_ms"]):
        if x.get("session"):
            by[x["session"]].append(x)
    return by.values()


def row(path):
    r = json.load(open(os.path.join(path, "report.json")))
    s = r["summary"]
    recs = [x for x in r["records"] if x.get("error") is None and x.get("ttft_ms") is not None]
    if not recs:
        return None
    moves = back = moved_big = 0
    for conv in turns(recs):
        for k in range(1, len(conv)):
            if conv[k].get("backend") != conv[k - 1].get("backend"):
                moves += 1
                moved_big += uncached(conv[k]) >= BIG
                if k + 1 < len(conv) and conv[k + 1].get("backend") == conv[k - 1].get("backend"):
                    back += 1
    big = sum(uncached(x) >= BIG for x in recs) / len(recs)
    return (
        f"hit {s['cache_hit_rate']:.3f}  TTFT p50/p90/p99 {s['ttft_p50_ms']:.1f}/"
        f"{s['ttft_p90_ms']:.1f}/{s['ttft_p99_ms']:.0f} ms  uncached>={BIG}: {big:.3f}  "
        f"moves {moves} (missed {moved_big}, back {back})"
    )


def each_run(argv, row, width=42):
    """Print `row(run_dir)` for every run under each results directory in `argv`."""
    if len(argv) < 2:
        sys.exit(sys.modules["__main__"].__doc__)
    for results in argv[1:]:
        for report in sorted(glob.glob(os.path.join(results, "*", "*", "report.json"))):
            run = os.path.dirname(report)
            name, workload, policy = run.split(os.sep)[-3:]
            line = row(run) or "no per-request records (run compare with --keep-records)"
            print(f"{name:8} {workload:10} {policy:{width}} {line}")


def main():
    each_run(sys.argv, row)


if __name__ == "__main__":
    main()
