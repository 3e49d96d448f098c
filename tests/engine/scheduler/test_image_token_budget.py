"""The image budget counts image tokens, not images: a Qwen2-VL image costs a few dozen to
thousands of tokens, so a budget of N images would let N large ones into one iteration."""

from __future__ import annotations

import pytest

from epd_engine.config import Role
from epd_engine.scheduler import Scheduler, SchedulerLimits

from .factories import make_request, make_scheduler, run_step


def _encoded_tokens(scheduler: Scheduler, steps: int) -> list[list[int]]:
    return [[t.num_tokens for t in run_step(scheduler)[0].encodes] for _ in range(steps)]


def test_many_small_images_share_an_iteration_a_large_one_goes_alone() -> None:
    s = make_scheduler(image_token_budget=16, num_image_blocks=64)
    r = make_request(image_hashes=("a", "b", "c", "d", "big"), image_tokens=(4, 4, 4, 4, 16))
    s.add(r)
    assert _encoded_tokens(s, 2) == [[4, 4, 4, 4], [16]]  # counting images: all five at once
    assert r.num_encoded_images == 5


def test_an_image_larger_than_the_budget_is_encoded_alone_not_starved() -> None:
    s = make_scheduler(image_token_budget=8, num_image_blocks=64)
    first = make_request(image_hashes=("small",), image_tokens=(4,))
    large = make_request(image_hashes=("large", "after"), image_tokens=(40, 4))
    s.add(first)
    s.add(large)
    # the large image does not fit beside the small one; next iteration it goes alone, and
    # the image after it waits (it would overrun a budget already spent)
    assert _encoded_tokens(s, 3) == [[4], [40], [4]]
    assert large.num_encoded_images == 2


def test_budget_in_tokens_admits_images_across_requests_until_spent() -> None:
    s = make_scheduler(role=Role.E, image_token_budget=12, num_image_blocks=64)
    requests = [make_request(image_hashes=(f"i{k}",), image_tokens=(4,)) for k in range(5)]
    for request in requests:
        s.add(request)
    assert [len(step) for step in _encoded_tokens(s, 2)] == [3, 2]


@pytest.mark.parametrize("field", ["token_budget", "image_token_budget", "max_num_running"])
def test_limits_refuse_a_budget_below_one(field: str) -> None:
    values = {"token_budget": 8, "image_token_budget": 8, "max_num_running": 4}
    values[field] = 0
    with pytest.raises(ValueError, match=f"{field} must be >= 1, got 0"):
        SchedulerLimits(max_model_len=64, **values)
