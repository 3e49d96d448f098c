"""The instance as one of many: pull-based migration (both sides), KV that moves while prefill
runs, the link to the router (registration, heartbeats) and the event stream to it."""
