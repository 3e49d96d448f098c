"""Summarise collapsed stacks (sample_stacks.py, or py-spy's raw format): per thread, the
share of samples spent busy, and the functions that take the most of it.

    python tools/profiling/summarize_stacks.py STACKS.txt [--thread epd-engine] [--top 40]

Samples whose innermost frame is a wait (select, sleep, a lock or condition wait, a queue
get) count as idle.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

IDLE_LEAVES = ("select", "sleep", "wait (threading", "Condition.wait", "Queue.get", "_worker")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stacks")
    parser.add_argument("--thread", help="only threads whose name contains this")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    per_thread: collections.Counter[str] = collections.Counter()
    busy: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    leaf: collections.Counter[str] = collections.Counter()
    for line in Path(args.stacks).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        thread, n = frames[0], int(count)
        per_thread[thread] += n
        if any(idle in frames[-1] for idle in IDLE_LEAVES):
            continue
        busy[thread] += n
        if args.thread and args.thread not in thread:
            continue
        leaf[frames[-1]] += n
        for name in {f.split(" (")[0] for f in frames[1:]}:
            inclusive[name] += n
    for thread, n in per_thread.most_common(12):
        print(f"{busy[thread] / n:6.1%} busy  {n:7d} samples  {thread}")
    total = sum(busy[t] for t in busy if not args.thread or args.thread in t) or 1
    print(f"\ninclusive, share of busy samples ({total}):")
    for name, n in inclusive.most_common(args.top):
        print(f"{n / total:6.1%}  {name}")
    print("\nself (innermost line):")
    for name, n in leaf.most_common(args.top // 2):
        print(f"{n / total:6.1%}  {name}")


if __name__ == "__main__":
    main()
