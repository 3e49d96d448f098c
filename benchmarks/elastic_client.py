"""The day's requests sent on schedule to the router, streamed: TTFT is the first content
chunk, TPOT the nearest-rank p90 of the gaps between chunks after it (the SLO's definition,
``slo/attainment.py``, which the loop plans and alarms on), with the mean gap beside it. A
request meets the SLO when it succeeds within both."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from benchmarks.elastic_trace import Arrival, prompt_words
from epd_engine.contracts.trace import nearest_rank


@dataclass
class Outcome:
    t_s: float  # scheduled arrival, since the traffic started
    image: bool
    end_s: float
    ttft_s: float | None
    tpot_s: float | None  # p90 gap (nearest rank)
    tpot_mean_s: float | None = None
    error: str = ""

    def met(self, ttft_s: float, tpot_s: float, mean: bool = False) -> bool:
        """``mean``: judge TPOT by the mean gap (vLLM's TPOT) instead of the p90 gap."""
        tpot = self.tpot_mean_s if mean else self.tpot_s
        return (
            not self.error
            and self.ttft_s is not None
            and self.ttft_s <= ttft_s
            and (tpot is None or tpot <= tpot_s)
        )


def body(a: Arrival, model: str) -> dict[str, Any]:
    # distinct words: no two requests share a prefix (the simulator's trace has none)
    text = " ".join(f"w{a.index}x{k}" for k in range(prompt_words(a.image)))
    content: Any = text
    if a.image:
        url = f"http://images.invalid/{a.index}.png"  # never fetched: the emulator hashes it
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": a.output_tokens,
        "stream": True,
    }


class Client:
    def __init__(self, url: str, model: str, max_in_flight: int = 512) -> None:
        self.url, self.model = url, model
        self.http = httpx.Client(timeout=300, limits=httpx.Limits(max_connections=max_in_flight))
        self.pool = ThreadPoolExecutor(max_in_flight)
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self.t0 = 0.0

    def _one(self, a: Arrival) -> None:
        start = time.monotonic()
        ttft: float | None = None
        last = start
        gaps: list[float] = []
        error = ""
        try:
            with self.http.stream(
                "POST", f"{self.url}/v1/chat/completions", json=body(a, self.model)
            ) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    if choices[0].get("delta", {}).get("content"):
                        now = time.monotonic()
                        if ttft is None:
                            ttft = now - start
                        else:
                            gaps.append(now - last)
                        last = now
        except (httpx.HTTPError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"[:300]
        end = time.monotonic()
        if not error and ttft is None:
            error = "no tokens"
        p90 = nearest_rank(gaps, 0.9) if gaps else None
        mean = sum(gaps) / len(gaps) if gaps else None
        outcome = Outcome(a.t_s, a.image, end - self.t0, ttft, p90, mean, error)
        with self._lock:
            self.outcomes.append(outcome)

    def replay(self, arrivals: list[Arrival], stop: threading.Event) -> None:
        """Send each arrival at its time (blocks until the last is sent)."""
        self.t0 = time.monotonic()
        for a in arrivals:
            wait = self.t0 + a.t_s - time.monotonic()
            if wait > 0 and stop.wait(wait):
                return
            self.pool.submit(self._one, a)

    def finish(self) -> None:
        self.pool.shutdown(wait=True)
        self.http.close()
