"""Stage-level batching (HydraInfer): pure Python, never imports torch.

The simulator in ``epd_engine.profiler`` drives these same classes with a virtual clock.
"""

from epd_engine.scheduler.output import EncodeTask, ImageSlice, SchedulerOutput, TokenTask
from epd_engine.scheduler.scheduler import RequestEvent, Scheduler, SchedulerLimits

__all__ = [
    "EncodeTask",
    "ImageSlice",
    "RequestEvent",
    "Scheduler",
    "SchedulerLimits",
    "SchedulerOutput",
    "TokenTask",
]
