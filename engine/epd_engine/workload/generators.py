"""Synthetic workloads shaped like the benchmarks the EPD papers serve, as DESIGN.md §4 traces.

We cannot ship the datasets, so each generator reproduces their *shape*: text tokens of the
prompt (question + the LLaVA evaluation instruction), image resolutions (hence visual tokens
for a model family, see ``image_tokens``), how often an image is reused across requests, and
output lengths (fixed per request and replayed with ``max_tokens`` + ``ignore_eos``, as
HydraInfer does). Numbers marked "(est.)" are our estimates from the dataset papers and the
prompt formats, not measurements; the rest cite a source. See ``describe_workloads()``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from epd_engine.contracts.trace import ImageRef, TraceRecord
from epd_engine.workload.arrivals import ArrivalSpec, with_arrivals
from epd_engine.workload.distributions import Choice, Fixed, IntDist, LogNormal, SizeChoice, Uniform
from epd_engine.workload.image_tokens import ImageTokenizer, get_image_tokenizer

# OpenImages photos (TextCaps, TextVQA) are stored at <= 1024 px on the long side (est. mix).
_OPENIMAGES = SizeChoice(
    [(1024, 768), (1024, 683), (768, 1024), (1024, 1024), (683, 1024)], [40, 25, 15, 10, 10]
)
# COCO val2014 (POPE, part of MME): <= 640 px on the long side, mostly 4:3 (est. mix).
_COCO = SizeChoice(
    [(640, 480), (640, 427), (480, 640), (427, 640), (640, 640)], [45, 25, 15, 5, 10]
)
# VizWiz: phone photos taken by blind users, mostly full camera resolution (est. mix).
_VIZWIZ = SizeChoice(
    [(1296, 968), (968, 1296), (1632, 1224), (1224, 1632), (640, 480), (480, 640)],
    [30, 30, 10, 10, 10, 10],
)
# MME: COCO-like photos plus posters, artworks, landmarks, OCR and code screenshots (est. mix).
_MME = SizeChoice(
    [(640, 480), (500, 375), (1024, 768), (800, 1200), (480, 640)], [30, 20, 20, 15, 15]
)


@dataclass(frozen=True)
class WorkloadShape:
    """Distributions defining one synthetic workload (all lengths in tokens)."""

    name: str
    summary: str
    source: str
    prompt_tokens: IntDist
    output_tokens: IntDist
    image_sizes: SizeChoice
    images_per_request: IntDist = Fixed(1)  # noqa: RUF009 (frozen, shared safely)
    requests_per_image: int = 1  # >1: questions share pictures (encoder-cache hits)
    text_only_fraction: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.text_only_fraction <= 1:
            raise ValueError(f"text_only_fraction must be in [0, 1], got {self.text_only_fraction}")
        if self.requests_per_image < 1:
            raise ValueError(f"requests_per_image must be >= 1, got {self.requests_per_image}")


def random_mm(
    input_len: int = 400,
    output_len: int = 150,
    range_ratio: float = 0.0,
    base_items_per_request: int = 1,
    num_items_range_ratio: float = 0.0,
    image_sizes: Sequence[tuple[int, int]] = ((640, 640),),
) -> WorkloadShape:
    """vLLM ``random-mm`` (its benchmark's flags): lengths uniform within ±range_ratio,
    images per request uniform within ±num_items_range_ratio of the base count.

    Defaults: the vLLM encoder-disaggregation post (400 text tokens, 640×640 images,
    150 output tokens); use input_len=2000 and base_items_per_request=1..4 for its other cases.
    """

    def spread(value: int, ratio: float, minimum: int) -> IntDist:
        low, high = max(minimum, math.floor(value * (1 - ratio))), math.ceil(value * (1 + ratio))
        return Fixed(value) if low == high else Uniform(low, high)

    return WorkloadShape(
        name="random-mm",
        summary=f"{input_len} text tokens, {base_items_per_request} image(s), {output_len} output",
        source="vLLM benchmark random-mm; vLLM encoder-disaggregation post (Qwen3-VL-4B)",
        prompt_tokens=spread(input_len, range_ratio, 1),
        output_tokens=spread(output_len, range_ratio, 1),
        image_sizes=SizeChoice(list(image_sizes)),
        images_per_request=spread(base_items_per_request, num_items_range_ratio, 0),
    )


WORKLOADS: dict[str, WorkloadShape] = {
    shape.name: shape
    for shape in (
        WorkloadShape(
            name="textcaps",
            summary="captioning: short fixed instruction, one photo, one-sentence caption",
            source="TextCaps (Sidorov et al. 2020; captions ~12 words); HydraInfer dataset; "
            "LLaVA eval prompt 'Provide a one-sentence caption for the provided image.'",
            prompt_tokens=Uniform(10, 14),
            output_tokens=LogNormal(20, 0.35, 6, 64),  # (est.) ~12-15 words of caption
            image_sizes=_OPENIMAGES,
        ),
        WorkloadShape(
            name="textvqa",
            summary="VQA on text in photos: question + 'single word or phrase', short answer",
            source="TextVQA (Singh et al. 2019; questions ~7 words, ~1.6 questions per image); "
            "HydraInfer dataset; LLaVA eval prompt",
            prompt_tokens=LogNormal(24, 0.3, 14, 96),  # question + instruction (+ OCR hints)
            output_tokens=LogNormal(4, 0.6, 1, 24),  # (est.) answers of 1-3 words
            image_sizes=_OPENIMAGES,
            requests_per_image=2,
        ),
        WorkloadShape(
            name="vizwiz",
            summary="VQA on blind users' phone photos: large images, 'Unanswerable' instruction",
            source="VizWiz (Gurari et al. 2018; one question per photo); HydraInfer dataset; "
            "LLaVA eval prompt with the 'Unanswerable' instruction",
            prompt_tokens=LogNormal(36, 0.25, 24, 120),
            output_tokens=LogNormal(4, 0.6, 1, 24),  # (est.) short answers or 'Unanswerable'
            image_sizes=_VIZWIZ,
        ),
        WorkloadShape(
            name="pope",
            summary="yes/no object hallucination probe: 6 questions per COCO image, 1-2 tokens out",
            source="POPE (Li et al. 2023; 500 COCO images x 6 questions per split); HydraInfer",
            prompt_tokens=Uniform(18, 23),  # 'Is there a <object> in the image?' + instruction
            output_tokens=Choice([1, 2]),  # 'Yes' / 'No' (+ end token)
            image_sizes=_COCO,
            requests_per_image=6,
        ),
        WorkloadShape(
            name="mme",
            summary="yes/no perception and cognition (14 subtasks): 2 questions per image",
            source="MME (Fu et al. 2023; every image has a yes and a no question); HydraInfer",
            prompt_tokens=LogNormal(28, 0.6, 10, 256),  # (est.) OCR/code/translation are longer
            output_tokens=Choice([1, 2]),
            image_sizes=_MME,
            requests_per_image=2,
        ),
        WorkloadShape(
            name="visualwebinstruct",
            summary="EPD-Serve mix: half image+text (1280x720), half text-only, 64 tokens out",
            source="EPD-Serve: VisualWebInstruct subset, 256 image+text + 256 text-only, "
            "text 63.1 tokens on average, images 1280x720, output fixed at 64",
            prompt_tokens=LogNormal(63.1, 0.5, 8, 512),
            output_tokens=Fixed(64),
            image_sizes=SizeChoice([(1280, 720)]),
            text_only_fraction=0.5,
        ),
        WorkloadShape(
            name="sharegpt4o",
            summary="EPD-Serve: short text, ~802x652 images, 64 tokens out",
            source="EPD-Serve: ShareGPT-4o subset, text 9.6 tokens and images 802x652 "
            "on average, output fixed at 64",
            prompt_tokens=LogNormal(9.6, 0.5, 2, 64),
            output_tokens=Fixed(64),
            image_sizes=SizeChoice([(640, 512), (802, 652), (964, 792)]),  # means 802x652
        ),
        random_mm(),
    )
}


def get_workload(name: str) -> WorkloadShape:
    try:
        return WORKLOADS[name]
    except KeyError:
        known = ", ".join(sorted(WORKLOADS))
        raise ValueError(f"unknown workload {name!r}; known: {known}") from None


def describe_workloads() -> list[dict[str, object]]:
    """Nominal means and sources of every generator (for ``epdctl trace workloads`` and docs)."""
    return [
        {
            "name": s.name,
            "summary": s.summary,
            "mean_prompt_tokens": round(s.prompt_tokens.mean, 1),
            "mean_output_tokens": round(s.output_tokens.mean, 1),
            "mean_images_per_request": round(
                s.images_per_request.mean * (1 - s.text_only_fraction), 2
            ),
            "mean_image_pixels": round(s.image_sizes.mean_pixels),
            "requests_per_image": s.requests_per_image,
            "text_only_fraction": s.text_only_fraction,
            "source": s.source,
        }
        for s in WORKLOADS.values()
    ]


def _image_hash(shape_name: str, seed: int, picture: int) -> str:
    return hashlib.sha256(f"{shape_name}/{seed}/{picture}".encode()).hexdigest()[:16]


def generate(
    shape: WorkloadShape | str,
    num_requests: int,
    *,
    seed: int = 0,
    image_tokenizer: ImageTokenizer | str = "llava-1.5",
    text_only_fraction: float | None = None,
) -> list[TraceRecord]:
    """``num_requests`` records (all arriving at 0; see ``synthesize`` for arrivals).

    Deterministic in ``seed``. ``text_only_fraction`` overrides the shape's (mixed traffic).
    """
    if isinstance(shape, str):
        shape = get_workload(shape)
    if text_only_fraction is not None:
        shape = replace(shape, text_only_fraction=text_only_fraction)
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    tokenize = (
        get_image_tokenizer(image_tokenizer)
        if isinstance(image_tokenizer, str)
        else image_tokenizer
    )
    rng = np.random.default_rng(seed)
    prompt = shape.prompt_tokens.sample(rng, num_requests)
    output = np.maximum(shape.output_tokens.sample(rng, num_requests), 1)
    text_only = rng.random(num_requests) < shape.text_only_fraction
    num_images = np.where(text_only, 0, shape.images_per_request.sample(rng, num_requests))

    # Pictures are shared by `requests_per_image` requests, in shuffled order.
    total_images = int(num_images.sum())
    num_pictures = max(1, math.ceil(total_images / shape.requests_per_image))
    pictures = np.repeat(np.arange(num_pictures), shape.requests_per_image)[:total_images]
    rng.shuffle(pictures)
    sizes = shape.image_sizes.sample(rng, num_pictures)

    records: list[TraceRecord] = []
    cursor = 0
    for i in range(num_requests):
        images = []
        for picture in pictures[cursor : cursor + int(num_images[i])]:
            width, height = sizes[int(picture)]
            images.append(
                ImageRef(
                    tokens=tokenize(width, height),
                    hash=_image_hash(shape.name, seed, int(picture)),
                    width=width,
                    height=height,
                )
            )
        cursor += int(num_images[i])
        records.append(
            TraceRecord(
                request_id=f"{shape.name}-{seed}-{i:06d}",
                arrival_s=0.0,
                prompt_tokens=int(prompt[i]),
                images=tuple(images),
                output_tokens=int(output[i]),
            )
        )
    return records


def synthesize(
    shape: WorkloadShape | str,
    num_requests: int,
    arrivals: ArrivalSpec,
    *,
    seed: int = 0,
    image_tokenizer: ImageTokenizer | str = "llava-1.5",
    text_only_fraction: float | None = None,
) -> list[TraceRecord]:
    """A complete trace: ``generate`` plus arrival times from ``arrivals`` (same seed)."""
    records = generate(
        shape,
        num_requests,
        seed=seed,
        image_tokenizer=image_tokenizer,
        text_only_fraction=text_only_fraction,
    )
    return with_arrivals(records, arrivals.sample(num_requests, seed=seed))
