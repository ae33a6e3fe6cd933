#!/usr/bin/env python3
"""How much of a run's TTFT tail is its opening burst: a closed-loop workload (sharegpt,
multi_model) starts every conversation at once, so its first turns all arrive in the first
few milliseconds and queue behind each other wherever they land. Per run: TTFT p50/p90/p99
over all requests and over those sent after the first SECONDS of model time, how many of the
requests at or above the p99 were sent in that opening, and the e2e p99 both ways.

Reads the report.json of runs made with `kvbench compare --keep-records`.

    bench/scripts/opening_burst.py [--after-s SECONDS] RESULTS_DIR [RESULTS_DIR ...]
"""
import glob
import json
import os
import sys


def q(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(p * len(v)))] if v else float("nan")


def row(path, after_ms):
    recs = json.load(open(path)).get("records") or []
    ok = [x for x in recs if x["status"] == 200]
    if not ok:
        return None
    ttft = [x["ttft_ms"] for x in ok]
    p99 = q(ttft, 0.99)
    tail = [x for x in ok if x["ttft_ms"] >= p99]
    late = [x for x in ok if x["send_ms"] >= after_ms]
    lt = [x["ttft_ms"] for x in late]
    return (
        f"{q(ttft, .5):.0f}/{q(ttft, .9):.0f}/{p99:.0f}",
        f"{q(lt, .5):.0f}/{q(lt, .9):.0f}/{q(lt, .99):.0f}",
        f"{sum(x['send_ms'] < after_ms for x in tail)} of {len(tail)}",
        f"{q([x['e2e_ms'] for x in ok], .99):.0f}",
        f"{q([x['e2e_ms'] for x in late], .99):.0f}",
        f"{len(ok) - len(late)}",
    )


def main(args):
    after_s = 2.0
    if args[:1] == ["--after-s"]:
        after_s, args = float(args[1]), args[2:]
    if not args:
        sys.exit(__doc__)
    print(f"| run | workload | policy | TTFT p50/p90/p99 ms, all | sent after {after_s:g} s "
          f"| p99 tail sent before | e2e p99, all | after | requests before |")
    print("|---|---|---|---|---|---|---|---|---|")
    for d in args:
        for path in sorted(glob.glob(os.path.join(d, "*", "*", "report.json"))):
            name, workload, policy = os.path.dirname(path).split(os.sep)[-3:]
            r = row(path, after_s * 1000)
            line = " | ".join(r) if r else "no per-request records (--keep-records)"
            print(f"| {name} | {workload} | {policy} | {line} |")


if __name__ == "__main__":
    main(sys.argv[1:])
