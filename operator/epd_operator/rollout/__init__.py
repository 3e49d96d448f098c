"""How to get to a plan, on any backend: pool identity, the rollout/drain state machine, one
pass of it (driver), and every router replica addressed one by one."""
