"""What every local run of processes shares (``epdctl up``, benchmarks, tests): loopback ports
and the run's private state file, ``runs/<name>/state.json``."""
