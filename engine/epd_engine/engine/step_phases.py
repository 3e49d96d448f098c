"""Where an engine step's time goes, phase by phase (``epd_step_phase_seconds``).

- ``schedule``: the scheduler picks the batch.
- ``launch``: the host queues the step on the device: inputs, attention metadata, the
  forward's kernels (or its graph), the sampler. On a CPU the forward runs as it is queued,
  so this is the whole forward there.
- ``wait``: the host waits for the step's tokens: device time its own work did not cover.
  With async scheduling it waits for the step before, after queuing this one.
- ``update``: the scheduler takes the tokens; the step's bookkeeping.
- ``publish``: the engine thread between steps: outputs handed to the event loop,
  hand-offs, its inbox (not counted while it sleeps with nothing to run).

A GPU step is host-bound when schedule + launch + update + publish is as long as wait or
longer: the device then idles while the host prepares the next step.
"""

from __future__ import annotations

SCHEDULE = "schedule"
LAUNCH = "launch"
WAIT = "wait"
UPDATE = "update"
PUBLISH = "publish"
PHASES = (SCHEDULE, LAUNCH, WAIT, UPDATE, PUBLISH)


def step_kind(num_tokens: int, num_decodes: int, num_images: int) -> str:
    """``decode``: every request in the step decodes one token (the steady state of a
    batch); ``mixed``: anything else (a prefill chunk, an encode)."""
    return "decode" if num_images == 0 and 0 < num_tokens == num_decodes else "mixed"
