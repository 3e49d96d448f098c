"""Sampling parameters of one request, validated at construction (no torch here)."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for ``top_logprobs``


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS (and stop strings) cannot end the output before this many tokens
    logprobs: bool = False  # report the chosen token's log-probability
    top_logprobs: int = 0  # and this many most likely alternatives

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if len(self.stop) > 4:
            raise ValueError(f"at most 4 stop sequences, got {len(self.stop)}")
        if any(not s for s in self.stop):
            raise ValueError("stop sequences must be non-empty strings")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
            )
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities of one sampled token under the distribution it was drawn from
    (after temperature, top-k and top-p), and of the most likely alternatives."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class SamplingSpec:
    """What sampling needs to know about a request beyond its parameters."""

    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    num_prompt_tokens: int = 0


@dataclass(frozen=True)
class SamplingRow:
    """One row of a step's logits: the request, and the position of the token drawn."""

    spec: SamplingSpec
    position: int  # index in the sequence of the token being sampled

    @property
    def num_output_tokens(self) -> int:
        return self.position - self.spec.num_prompt_tokens
