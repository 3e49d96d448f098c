"""The day ``make bench-elastic`` replays, compressed: the request rate swings ``swing`` times
between night and noon, and the image share follows it (20 % at night, 80 % at noon), so the
load changes both in size and in kind, and with it the best method. Arrivals are a seeded
inhomogeneous Poisson process (thinning), so a run and its simulation see the same
requests."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from epd_engine.contracts.trace import ImageRef, TraceRecord

# Two kinds of request: chat over a long text (1,500 words, 32-token answers) and a short
# question on one image (40 words, 8-token answers: a caption, a label). With the H200 cost
# model their best methods differ (EP+D for text-heavy traffic, EPD for image-heavy, 1.3x
# apart at 8 GPUs), so the image share alone moves the best method. With 32-token answers
# for both, EP+D and ED+P ranked within one 5 % rate step at every share, and with 200-word
# prompts and 8-token answers for both EPD ranked first everywhere: no switch on either day.
TEXT_PROMPT_WORDS = 1500
IMAGE_PROMPT_WORDS = 40
TEXT_OUTPUT_TOKENS = 32
IMAGE_OUTPUT_TOKENS = 8


def prompt_words(image: bool) -> int:
    return IMAGE_PROMPT_WORDS if image else TEXT_PROMPT_WORDS


@dataclass(frozen=True)
class Day:
    length_s: float  # the whole day, compressed
    night_rps: float  # the lowest rate
    swing: float = 8.0  # noon's rate over night's
    night_image_share: float = 0.2
    noon_image_share: float = 0.8
    image_output_tokens: int = IMAGE_OUTPUT_TOKENS  # TEXT_OUTPUT_TOKENS: one answer length

    def output_tokens(self, image: bool) -> int:
        return self.image_output_tokens if image else TEXT_OUTPUT_TOKENS

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
    output_tokens: int


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
            image = rng.random() < day.image_share(t)
            out.append(Arrival(t, image, len(out), day.output_tokens(image)))


def record(a: Arrival, tokens_per_image: int, offset_s: float = 0.0) -> TraceRecord:
    """The simulator's view of an arrival (the live client sends the same shape)."""
    images: tuple[ImageRef, ...] = ()
    if a.image:
        images = (ImageRef(tokens=tokens_per_image, hash=f"img-{a.index}", width=336, height=336),)
    return TraceRecord(
        arrival_s=a.t_s - offset_s,
        prompt_tokens=prompt_words(a.image),
        images=images,
        output_tokens=a.output_tokens,
        request_id=f"r{a.index}",
    )


def window(arrived: list[Arrival], start_s: float, end_s: float) -> list[Arrival]:
    return [a for a in arrived if start_s <= a.t_s < end_s]
