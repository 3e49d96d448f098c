"""Fit the cost model's coefficients to measured iterations (numpy least squares, no torch).

Each sample is a ``BatchShape`` and the iteration time measured for it. Coefficients are
non-negative (a cost never shrinks as a batch grows): features that would come out negative
are dropped and the rest refitted. Knees are chosen from a grid by least relative error.
On a shared host a measurement can only come out *slower* than the hardware (another
process took the CPU), so ``robust`` drops samples over ``OUTLIER_RATIO`` x the fit and refits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from epd_engine.profiler.cost_model import BatchShape, EncodeCoeffs, LanguageCoeffs

_C = TypeVar("_C", EncodeCoeffs, LanguageCoeffs)

KNEE_GRID_TOKENS = (0, 8, 16, 32, 64, 128, 256, 512, 1024)
OUTLIER_RATIO = 2.0


@dataclass(frozen=True)
class Sample:
    shape: BatchShape
    seconds: float
    kind: str  # encode | language | mixed


def _nonneg_lstsq(features: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares weighted by 1/target (relative error), coefficients >= 0."""
    weights = 1.0 / np.maximum(target, 1e-9)
    active = list(range(features.shape[1]))
    coeffs = np.zeros(features.shape[1])
    while active:
        a = features[:, active] * weights[:, None]
        solution, *_ = np.linalg.lstsq(a, target * weights, rcond=None)
        if (solution >= 0).all():
            coeffs[:] = 0
            coeffs[active] = solution
            return coeffs
        active.pop(int(np.argmin(solution)))
    return coeffs


def _relative_error(predicted: np.ndarray, target: np.ndarray) -> float:
    return float(np.mean(np.abs(predicted - target) / np.maximum(target, 1e-9)))


def fit_encode(samples: Sequence[Sample]) -> tuple[EncodeCoeffs, float]:
    """(coefficients, mean relative error) from encode-only samples."""
    tokens = np.array([s.shape.image_tokens for s in samples], dtype=float)
    target = np.array([s.seconds for s in samples])
    best: tuple[float, EncodeCoeffs] | None = None
    for knee in sorted({0.0, *(tokens.tolist())}):
        x = np.stack([np.ones_like(tokens), np.maximum(tokens, knee)], axis=1)
        c = _nonneg_lstsq(x, target)
        err = _relative_error(x @ c, target)
        if best is None or err < best[0] - 1e-12:
            best = (
                err,
                EncodeCoeffs(fixed_s=float(c[0]), per_token_s=float(c[1]), knee_tokens=knee),
            )
    assert best is not None, "no encode samples"
    return best[1], best[0]


def _language_features(shapes: Sequence[BatchShape], knee: float) -> np.ndarray:
    return np.array(
        [
            [1.0, max(s.num_tokens, knee), s.prefill_kpairs, s.decode_kcontext, s.num_sampled]
            for s in shapes
        ]
    )


def fit_language(samples: Sequence[Sample]) -> tuple[LanguageCoeffs, float]:
    shapes = [s.shape for s in samples]
    target = np.array([s.seconds for s in samples])
    best: tuple[float, LanguageCoeffs] | None = None
    for knee in KNEE_GRID_TOKENS:
        x = _language_features(shapes, knee)
        c = _nonneg_lstsq(x, target)
        err = _relative_error(x @ c, target)
        if best is None or err < best[0] - 1e-12:
            coeffs = LanguageCoeffs(
                fixed_s=float(c[0]),
                per_token_s=float(c[1]),
                knee_tokens=float(knee),
                per_kpair_s=float(c[2]),
                per_kcontext_s=float(c[3]),
                per_sample_s=float(c[4]),
            )
            best = (err, coeffs)
    assert best is not None, "no language samples"
    return best[1], best[0]


def fit_overlap(samples: Sequence[Sample], encode: EncodeCoeffs, language: LanguageCoeffs) -> float:
    """Share of the shorter stage hidden when an iteration runs encode and tokens together."""
    shares = []
    for s in samples:
        e = encode.at(s.shape.image_tokens)
        lm = language.at(
            s.shape.num_tokens, s.shape.prefill_kpairs, s.shape.decode_kcontext, s.shape.num_sampled
        )
        if min(e, lm) > 0:
            shares.append((e + lm - s.seconds) / min(e, lm))
    return float(np.clip(np.median(shares), 0.0, 1.0)) if shares else 0.0


def robust(
    fit: Callable[[Sequence[Sample]], tuple[_C, float]],
    predict: Callable[[_C, BatchShape], float],
    samples: Sequence[Sample],
    rounds: int = 3,
) -> tuple[_C, float, int]:
    """(coefficients, mean relative error on the kept samples, number dropped as too slow)."""
    kept = list(samples)
    coeffs, error = fit(kept)
    for _ in range(rounds):
        ratio = {id(s): s.seconds / max(predict(coeffs, s.shape), 1e-12) for s in kept}
        slow = sorted(
            (s for s in kept if ratio[id(s)] > OUTLIER_RATIO), key=lambda s: -ratio[id(s)]
        )
        slow = slow[: max(0, min(len(kept) // 4, len(kept) - 3))]  # never drop most of them
        if not slow:
            break
        dropped = {id(s) for s in slow}
        kept = [s for s in kept if id(s) not in dropped]
        coeffs, error = fit(kept)
    return coeffs, error, len(samples) - len(kept)
