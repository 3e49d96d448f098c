"""The workload a plan is made for: the requests offered in the window, not only those served.

The router records a request when it finishes, so under a backlog the window's finished
requests show the rate the fleet managed, not the rate offered: a loop planning on them saw
0.6-1.5 rps while 3.8-6.1 rps were sent (``make bench-elastic``) and wanted to scale down at
the peak. So the planner reads the window with the requests still in flight
(``RouterAPI.trace_window(..., in_flight=True)``). Their arrivals are known; their shapes
are not (the prompt only once the entry instance reports it, the output not until it ends),
so each takes the shape of a finished request of the window, in turn, with fresh image
hashes (a copy is not a cache hit) and no prefix ids.
"""

from __future__ import annotations

from collections.abc import Sequence

from epd_engine.contracts.trace import TraceRecord


def offered(records: Sequence[TraceRecord]) -> list[TraceRecord]:
    """``records`` with each one in flight given a finished one's shape (kept as known when
    none has finished); finished records unchanged."""
    finished = [r for r in records if not r.in_flight]
    out: list[TraceRecord] = []
    waiting = 0
    for record in records:
        if not record.in_flight:
            out.append(record)
            continue
        if finished:
            shape = finished[waiting % len(finished)]
            waiting += 1
            images = tuple(
                image.model_copy(update={"hash": f"{image.hash}~{record.request_id}"})
                for image in shape.images
            )
            record = record.model_copy(
                update={
                    "prompt_tokens": shape.prompt_tokens,
                    "images": images,
                    "output_tokens": max(shape.output_tokens, record.output_tokens),
                }
            )
        elif record.total_prompt_tokens == 0:  # not tokenized yet: a prompt has a token
            record = record.model_copy(update={"prompt_tokens": 1})
        out.append(record)
    return out
