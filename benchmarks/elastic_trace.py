"""The day ``make bench-elastic`` replays, compressed: the request rate swings ``swing`` times
between night and noon, and the image share follows it (20 % at night, 80 % at noon), so the
load changes both in size and in kind. Arrivals are a seeded inhomogeneous Poisson process
(thinning), so a run and its simulation see the same requests."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from epd_engine.contracts.trace import ImageRef, TraceRecord

# Long text prompts and 32-token answers: with the H200 cost model the best method then
# depends on the image share and the fleet's size (ED+P, EP+D). With 200-word prompts and
# 8-token answers EPD ranked first at every share and size, so the day asked for no switch.
TEXT_PROMPT_WORDS = 1500
IMAGE_PROMPT_WORDS = 40
OUTPUT_TOKENS = 32


@dataclass(frozen=True)
class Day:
    length_s: float  # the whole day, compressed
    night_rps: float  # the lowest rate
    swing: float = 8.0  # noon's rate over night's
    night_image_share: float = 0.2
    noon_image_share: float = 0.8

    def phase(self, t_s: float) -> float:
        """0 at midnight (start and end), 1 at noon (the middle), a cosine between."""
        return (1 - math.cos(2 * math.pi * t_s / self.length_s)) / 2

    def rate_rps(self, t_s: float) -> float:
        return self.night_rps * (1 + (self.swing - 1) * self.phase(t_s))

    def image_share(self, t_s: float) -> float:
        span = self.noon_image_share - self.night_image_share
        return self.night_image_share + span * self.phase(t_s)

    @property
    def peak_rps(self) -> float:
        return self.night_rps * self.swing


@dataclass(frozen=True)
class Arrival:
    t_s: float
    image: bool
    index: int


def arrivals(day: Day, seed: int = 0) -> list[Arrival]:
    """The day's requests: Poisson at the peak rate, each kept with rate(t) / peak."""
    rng = random.Random(seed)
    out: list[Arrival] = []
    t = 0.0
    while True:
        t += rng.expovariate(day.peak_rps)
        if t >= day.length_s:
            return out
        if rng.random() < day.rate_rps(t) / day.peak_rps:
            out.append(Arrival(t, rng.random() < day.image_share(t), len(out)))


def record(a: Arrival, tokens_per_image: int, offset_s: float = 0.0) -> TraceRecord:
    """The simulator's view of an arrival (the live client sends the same shape)."""
    images: tuple[ImageRef, ...] = ()
    if a.image:
        images = (ImageRef(tokens=tokens_per_image, hash=f"img-{a.index}", width=336, height=336),)
    words = IMAGE_PROMPT_WORDS if a.image else TEXT_PROMPT_WORDS
    return TraceRecord(
        arrival_s=a.t_s - offset_s,
        prompt_tokens=words,
        images=images,
        output_tokens=OUTPUT_TOKENS,
        request_id=f"r{a.index}",
    )


def window(arrived: list[Arrival], start_s: float, end_s: float) -> list[Arrival]:
    return [a for a in arrived if start_s <= a.t_s < end_s]
