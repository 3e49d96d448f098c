"""The per-request p90 gap behind the SLO counter: numpy's percentile, computed without it
(``metrics.percentile_90`` runs on the event loop once per finished request)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from epd_engine.metrics import percentile_90


@pytest.mark.parametrize("n", [1, 2, 3, 9, 10, 11, 64, 257])
def test_percentile_90_is_numpys_linear_percentile(n: int) -> None:
    rng = random.Random(n)
    for _ in range(50):
        values = [rng.expovariate(100.0) for _ in range(n)]
        assert percentile_90(values) == pytest.approx(float(np.percentile(values, 90)), rel=1e-12)


def test_ties_and_order_do_not_matter() -> None:
    assert percentile_90([0.5, 0.1, 0.1, 0.9]) == pytest.approx(
        np.percentile([0.1, 0.1, 0.5, 0.9], 90)
    )
