"""Which plan: Fixed or Auto choice with hysteresis, the heuristic, the decide half of a
reconcile pass, the profiler on the live trace, the cost model a deployment plans with, and
the live workload from Prometheus."""
