#!/usr/bin/env python3
# Used by: docs/results/proxy-cost.md (where the idle RSS of kvroute's code is)
"""Where a running process's resident memory is: each mapping's RSS, and for the executable's
code (its r-xp mapping) which pages are present, as runs of consecutive pages, read from
/proc/PID/pagemap (needs root). Few long runs mean the code that ran sits together; many runs
of about 64 KiB, the kernel's fault-around, mean it is scattered over the binary.

    bench/scripts/rss_map.py PID [MIN_KIB=100]
"""
import struct
import sys


def mappings(pid):
    """(header, rss KiB) per mapping, from /proc/PID/smaps."""
    out, header = [], None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split()[0]
            if "-" in first and not first.endswith(":"):
                header = line.rstrip()
            elif first == "Rss:":
                out.append((header, int(line.split()[1])))
    return out


def present_runs(pid, start, end):
    """Runs (first page, pages) of resident pages in [start, end)."""
    pages = (end - start) // 4096
    with open(f"/proc/{pid}/pagemap", "rb") as f:
        f.seek(start // 4096 * 8)
        data = f.read(pages * 8)
    runs, at = [], None
    for i in range(pages + 1):
        present = i < pages and struct.unpack_from("<Q", data, i * 8)[0] >> 63
        if present and at is None:
            at = i
        elif not present and at is not None:
            runs.append((at, i - at))
            at = None
    return runs


def main():
    pid = int(sys.argv[1])
    floor = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    exe = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0].decode()
    maps = mappings(pid)
    print(f"pid {pid}: {exe}")
    print(f"total RSS {sum(r for _, r in maps) / 1024:.1f} MiB; mappings of {floor} KiB or more:")
    for header, rss in sorted(maps, key=lambda m: -m[1]):
        if rss >= floor:
            fields = header.split()
            name = fields[5] if len(fields) > 5 else "[anon]"
            print(f"  {rss:7d} KiB  {fields[1]}  {name}")
    for header, _ in maps:
        fields = header.split()
        if fields[1] == "r-xp" and len(fields) > 5 and fields[5].endswith(exe.split("/")[-1]):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            runs = present_runs(pid, start, end)
            resident = sum(n for _, n in runs)
            longest = sorted((n for _, n in runs), reverse=True)[:8]
            print(
                f"code: {(end - start) // 1024} KiB mapped, {resident * 4} KiB resident in "
                f"{len(runs)} runs; longest runs (KiB): {[n * 4 for n in longest]}"
            )


if __name__ == "__main__":
    main()
