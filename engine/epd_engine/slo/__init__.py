"""What "good" means: per-request outcomes and their statistics, SLO attainment (HydraInfer's
definition) and goodput, shared by the benchmarks and the profiler (no torch)."""
