"""Async scheduling: a step left in flight while the next one is scheduled and launched.

A synchronous step ends by reading its tokens back, so the GPU idles while the host
updates the requests, schedules and prepares the next step. With ``async_scheduling`` the
engine launches step N, updates the scheduler *provisionally* -- each sampled request gets
``PENDING_TOKEN`` as its last output token, so the counters, page growth and length limits
are those of after the step -- and returns; the next call schedules and launches step N+1
(a pending token is read from step N's draws on the device, ``ModelRunner._take_pending``)
and only then waits for step N's tokens and resolves them here.

What a resolution can find, per request of step N:
- its token: written over the placeholder; the event the provisional update made (a length
  finish included) now carries it;
- an EOS: the request stops here; step N+1 may already hold a draw past its end (and a
  placeholder for it): the placeholder goes, and that draw is dropped when N+1 resolves,
  as the request has ended by then;
- the request ended meanwhile (an abort, a stop string, an eviction, an EOS the step before):
  nothing is reported. A length finish does not count: the provisional update of this step
  (then its event says so) or of the next one made it, so the token is still the client's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from epd_engine.request import Request, RequestStatus
from epd_engine.scheduler import RequestEvent, Scheduler, SchedulerOutput
from epd_engine.worker.model_runner import LaunchedStep


@dataclass
class InflightStep:
    out: SchedulerOutput
    launched: LaunchedStep
    requests: dict[str, Request]  # every sampled request (finished ones leave the scheduler)
    events: dict[str, RequestEvent]  # what the provisional update reported, by request
    output_index: dict[str, int]  # where its placeholder sits in output_token_ids

    @property
    def request_ids(self) -> set[str]:
        return {t.request_id for t in self.out.token_tasks}


def resolve(step: InflightStep, scheduler: Scheduler) -> list[RequestEvent]:
    """Read ``step``'s tokens back (waits for the device) and report them."""
    drawn = step.launched.result()
    events = []
    for request_id, request in step.requests.items():
        provisional = step.events.get(request_id)
        if provisional is None:
            continue  # not running when the update came
        if request.status.finished and request.status is not RequestStatus.FINISHED_LENGTH:
            continue  # ended meanwhile
        token = drawn[request_id].token_id
        index = step.output_index[request_id]
        request.output_token_ids[index] = token
        if request.sampling.ignore_eos or token not in request.eos_token_ids:
            events.append(replace(provisional, new_token_id=token))
            continue
        del request.output_token_ids[index + 1 :]  # placeholders of draws past the end
        if request.status.finished:  # a length finish, here or in the next step: EOS first
            request.status = RequestStatus.FINISHED_STOPPED
        else:  # running, or preempted by the next step's schedule (waiting)
            scheduler.finish(request_id, RequestStatus.FINISHED_STOPPED)
        stopped = RequestStatus.FINISHED_STOPPED.finish_reason
        events.append(replace(provisional, new_token_id=token, finish_reason=stopped))
    return events
