#!/usr/bin/env python3
# Used by: crosscheck/run.sh (its prompts file, F), for docs/results/reliability.md
"""Writes single-turn prompts as JSONL, one `{"text": ..., "output_length": N}` per line.

That is aiperf's `single_turn` custom-dataset format and what `kvbench replay --workload
prompts` reads, so one file drives both tools. The text is deterministic for a given seed
(its own xorshift generator, not Python's `random`, so it is the same on every Python) and
every prompt is unique from its first word, so no two prompts share a cached prefix.

    python3 bench/scripts/make_prompts.py --out /tmp/prompts.jsonl
"""

import argparse
import json
import sys

WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when "
    "will more no if out so said what up its about into than them can only other new some "
    "could time these two may then do first any my now such like our over man me even most "
    "made after also did many before must through back years where much your way well down "
    "should because each just those people how too little state good very make world still "
    "own see men work long get here between both life being under never day same another "
    "know while last might us great old year off come since against go came right used take "
    "three system program question during number course house city group problem fact "
    "market water light model cache server request token memory engine router latency "
    "history river mountain garden window letter music language science nature village"
).split()

MASK = (1 << 64) - 1


class XorShift:
    def __init__(self, seed):
        # splitmix64 of the seed, so small neighbouring seeds give unrelated streams.
        z = (seed + 0x9E3779B97F4A7C15) & MASK
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        self.s = (z ^ (z >> 31)) or 1

    def next(self):
        x = self.s
        x ^= (x << 13) & MASK
        x ^= x >> 7
        x ^= (x << 17) & MASK
        self.s = x
        return x

    def below(self, n):
        return self.next() % n


def prompt(seed, index, min_words, max_words):
    rng = XorShift(seed * 1_000_003 + index)
    n = min_words + rng.below(max_words - min_words + 1)
    words = [f"Document {index}:"]
    for i in range(n):
        w = WORDS[rng.below(len(WORDS))]
        words.append(w + ("." if i % 17 == 16 else ""))
    return " ".join(words)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=400)
    ap.add_argument("--min-words", type=int, default=2000)
    ap.add_argument("--max-words", type=int, default=4000)
    ap.add_argument("--output-length", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="-", help="file to write, or - for stdout")
    a = ap.parse_args()
    if a.count < 1 or a.min_words < 1 or a.max_words < a.min_words or a.output_length < 1:
        ap.error("need --count >= 1, 1 <= --min-words <= --max-words, --output-length >= 1")
    out = sys.stdout if a.out == "-" else open(a.out, "w", encoding="utf-8")
    with out:
        for i in range(a.count):
            text = prompt(a.seed, i, a.min_words, a.max_words)
            out.write(json.dumps({"text": text, "output_length": a.output_length}) + "\n")


if __name__ == "__main__":
    main()
