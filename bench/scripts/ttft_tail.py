#!/usr/bin/env python3
"""What a run's TTFT tail is made of: slow prefills (misses) or waiting.

Reads the report.json of runs made with `kvbench compare --keep-records` and prints, per run:
TTFT p90, the TTFT p50/p90/p99 of requests with fewer than 256 uncached prompt tokens (their
TTFT is mostly waiting: if it does not move between runs, queueing did not either), how many
requests had at least 256 uncached tokens, and where those come from within their
conversation: its first turn, a turn that stayed on the previous turn's backend, a turn that
moved to a backend the conversation had not used ("moved_new"), or back to one it had used
("moved_back").

    bench/scripts/ttft_tail.py RESULTS_DIR [RESULTS_DIR ...]
"""
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from turn_moves import BIG, each_run, uncached  # noqa: E402


def pct(values, q):
    return values[min(len(values) - 1, int(len(values) * q))]


def row(path):
    r = json.load(open(os.path.join(path, "report.json")))
    recs = [x for x in r.get("records", []) if x.get("error") is None and x.get("ttft_ms") is not None]
    if not recs:
        return None
    ttft = sorted(x["ttft_ms"] for x in recs)
    small = sorted(x["ttft_ms"] for x in recs if uncached(x) < BIG)
    by = collections.defaultdict(list)
    for x in sorted(recs, key=lambda x: x["send_ms"]):
        by[x.get("session")].append(x)
    kinds = collections.Counter()
    for session, conv in by.items():
        for k, x in enumerate(conv):
            if uncached(x) < BIG:
                continue
            if session is None:
                kinds["no_session"] += 1
            elif k == 0:
                kinds["first"] += 1
            elif x["backend"] == conv[k - 1]["backend"]:
                kinds["stayed"] += 1
            elif x["backend"] in {y["backend"] for y in conv[: k - 1]}:
                kinds["moved_back"] += 1
            else:
                kinds["moved_new"] += 1
    big = sum(kinds.values())
    small_q = "/".join(f"{pct(small, q):.1f}" for q in (0.5, 0.9, 0.99)) if small else "-"
    detail = " ".join(f"{k} {kinds[k]}" for k in ("first", "stayed", "moved_new", "moved_back", "no_session") if kinds[k])
    return (
        f"n {len(recs)}  TTFT p90 {pct(ttft, 0.9):.1f} ms  small-uncached TTFT p50/p90/p99 {small_q} ms  "
        f">={BIG} uncached {big} ({big / len(recs):.3f}): {detail}"
    )


def main():
    each_run(sys.argv, row, width=46)


if __name__ == "__main__":
    main()
