"""A multi-turn conversation workload (issue 33): sessions of 2-4 turns, some with images.

Each record is a turn in the session form (``TraceRecord.session_id``: its own message
only; ``epdctl bench`` sends the conversation so far before it, the simulator builds the
same whole prompt). A session opens with a longer message (a question about a document or
a picture), then short follow-ups, some of which bring a new picture. Turns come round by
round: slot ``turn * sessions + session`` (one second each), so a session's next turn comes
a round after its last, which leaves the previous turn time to finish at any rate
``arrivals.at_rate`` scales the trace to -- a replay waits for it anyway, the simulator
does not.
"""

from __future__ import annotations

import hashlib

import numpy as np

from epd_engine.contracts.trace import ImageRef, TraceRecord
from epd_engine.workload.image_tokens import get_image_tokenizer

NAME = "multiturn"
TURNS = (2, 4)  # per session, inclusive
FIRST_PROMPT_TOKENS = (150, 400)
LATER_PROMPT_TOKENS = (20, 80)
OUTPUT_TOKENS = (16, 48)
FIRST_IMAGE_FRACTION = 0.5  # sessions that open with a picture
LATER_IMAGE_FRACTION = 0.25  # follow-ups that bring a new one
IMAGE_SIZE = (336, 336)


def conversations(
    num_requests: int, *, seed: int = 0, image_tokenizer: str = "llava-1.5"
) -> list[TraceRecord]:
    """About ``num_requests`` turns (the last session is cut short to fit), deterministic
    in ``seed``, in arrival order."""
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    while sum(lengths) < num_requests:
        lengths.append(int(rng.integers(TURNS[0], TURNS[1] + 1)))
    if lengths:
        lengths[-1] -= sum(lengths) - num_requests
    tokens = get_image_tokenizer(image_tokenizer)(*IMAGE_SIZE)
    records = []
    for session, length in enumerate(lengths):
        for turn in range(length):
            first = turn == 0
            low, high = FIRST_PROMPT_TOKENS if first else LATER_PROMPT_TOKENS
            with_image = rng.random() < (FIRST_IMAGE_FRACTION if first else LATER_IMAGE_FRACTION)
            picture = f"{NAME}/{seed}/{session}/{turn}"
            records.append(
                TraceRecord(
                    request_id=f"{NAME}-{seed}-s{session:04d}-t{turn}",
                    arrival_s=float(turn * len(lengths) + session),
                    prompt_tokens=int(rng.integers(low, high + 1)),
                    images=(_image(picture, tokens),) if with_image else (),
                    output_tokens=int(rng.integers(OUTPUT_TOKENS[0], OUTPUT_TOKENS[1] + 1)),
                    session_id=f"{NAME}-{seed}-s{session:04d}",
                )
            )
    return sorted(records, key=lambda r: r.arrival_s)


def _image(picture: str, tokens: int) -> ImageRef:
    digest = hashlib.sha256(picture.encode()).hexdigest()[:16]
    return ImageRef(tokens=tokens, hash=digest, width=IMAGE_SIZE[0], height=IMAGE_SIZE[1])
