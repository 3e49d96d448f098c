from __future__ import annotations

import pytest

from epd_engine.profiler.cost_model import BatchShape, EncodeCoeffs, LanguageCoeffs
from epd_engine.profiler.fit import Sample, fit_encode, fit_language, fit_overlap, robust


def test_fit_recovers_known_language_coefficients() -> None:
    truth = LanguageCoeffs(
        fixed_s=0.002,
        per_token_s=1e-5,
        knee_tokens=64,
        per_kpair_s=3e-6,
        per_kcontext_s=2e-4,
        per_sample_s=1e-4,
    )
    shapes = [
        BatchShape(num_tokens=n, prefill_kpairs=n * n / 2000, num_sampled=1)
        for n in (16, 64, 128, 256, 512, 1024)
    ]
    shapes += [
        BatchShape(num_tokens=b, decode_kcontext=b * c / 1000, num_sampled=b)
        for b in (1, 4, 16, 64, 128)
        for c in (32, 512)
    ]
    samples = [
        Sample(
            s,
            truth.at(s.num_tokens, s.prefill_kpairs, s.decode_kcontext, s.num_sampled),
            "language",
        )
        for s in shapes
    ]
    fitted, error = fit_language(samples)
    assert error < 1e-6
    assert fitted.knee_tokens == 64
    assert fitted.per_token_s == pytest.approx(truth.per_token_s, rel=1e-4)
    assert fitted.per_kcontext_s == pytest.approx(truth.per_kcontext_s, rel=1e-4)


def test_fit_encode_finds_the_saturation_knee_and_never_goes_negative() -> None:
    truth = EncodeCoeffs(fixed_s=0.001, per_token_s=2e-6, knee_tokens=600)
    samples = [
        Sample(BatchShape(num_images=n, image_tokens=100 * n), truth.at(100 * n), "encode")
        for n in (1, 2, 4, 6, 8, 16)
    ]
    fitted, error = fit_encode(samples)
    assert error < 1e-6
    assert fitted.knee_tokens == 600
    noisy = [
        Sample(s.shape, s.seconds * (1.5 if i % 2 else 0.7), "encode")
        for i, s in enumerate(samples)
    ]
    rough, _ = fit_encode(noisy)
    assert rough.fixed_s >= 0 and rough.per_token_s >= 0


def test_overlap_is_zero_for_serial_execution_and_clipped() -> None:
    enc = EncodeCoeffs(per_token_s=1e-4)
    lm = LanguageCoeffs(per_token_s=1e-4)
    shape = BatchShape(num_images=1, image_tokens=100, num_tokens=100)
    serial = Sample(shape, 0.02, "mixed")
    assert fit_overlap([serial], enc, lm) == pytest.approx(0.0)
    hidden = Sample(shape, 0.01, "mixed")
    assert fit_overlap([hidden], enc, lm) == pytest.approx(1.0)
    assert fit_overlap([Sample(shape, 0.001, "mixed")], enc, lm) == 1.0


def test_robust_fit_ignores_samples_slowed_by_other_processes() -> None:
    truth = EncodeCoeffs(fixed_s=0.001, per_token_s=2e-6, knee_tokens=0)
    samples = [
        Sample(BatchShape(num_images=n, image_tokens=100 * n), truth.at(100 * n), "encode")
        for n in (1, 2, 3, 4, 6, 8, 12, 16)
    ]
    samples[3] = Sample(samples[3].shape, samples[3].seconds * 20, "encode")  # a contended run
    fitted, error, dropped = robust(fit_encode, lambda c, s: c.at(s.image_tokens), samples)
    assert dropped == 1
    assert error < 1e-6
    assert fitted.per_token_s == pytest.approx(2e-6, rel=1e-4)
