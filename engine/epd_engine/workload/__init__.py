"""Workloads as DESIGN.md §4 traces: paper-shaped generators, arrival processes, length
distributions, multi-turn sessions, peer trace formats, visual tokens per image (no torch)."""
