"""Benchmarking: workload generators, arrivals, the load driver, SLO metrics, goodput, plots.

Pure-Python parts (workloads, arrivals, metrics, slo, goodput) import no torch, no HTTP client
and no matplotlib, so the simulator can reuse them.
"""
