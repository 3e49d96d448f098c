"""``/v1/completions`` (OpenAI's legacy text completions): a prompt string or token ids in,
text out. Text only; the prompt is tokenized as vLLM does (the tokenizer's special tokens, no
chat template). AIPerf's completions endpoint and guidellm's default speak this.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from epd_engine.api.logprobs import CompletionLogprobs
from epd_engine.api.protocol import SYSTEM_FINGERPRINT, StreamOptions, Usage
from epd_engine.contracts.errors import ClientError


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = Field(default=None)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    echo: bool = False
    ignore_eos: bool = False  # extension (vLLM): fixed output lengths for benchmarks
    min_tokens: int = Field(default=0, ge=0)  # extension (vLLM): no EOS/stop before this many
    # the sampled token's logprob and this many alternatives per token (vLLM's bound: 20)
    logprobs: int | None = Field(default=None, ge=0, le=20)

    # what the shared sampling code reads off a chat request
    max_completion_tokens: None = None

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stops) > 4:
            raise ClientError("at most 4 stop sequences", param="stop")
        return stops

    def num_images(self) -> int:
        return 0

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request; batches (a list of prompts) are refused."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ClientError(
                    f"{len(prompt)} prompts in one request; send one prompt per request",
                    param="prompt",
                )
            prompt = prompt[0]
        if not prompt:
            raise ClientError("prompt is empty", param="prompt")
        return prompt  # type: ignore[return-value]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = SYSTEM_FINGERPRINT
    choices: list[CompletionChoice]
    usage: Usage


def completion_response(
    request_id: str,
    model: str,
    text: str,
    finish_reason: str | None,
    usage: Usage,
    logprobs: CompletionLogprobs | None = None,
) -> CompletionResponse:
    return CompletionResponse(
        id=request_id,
        model=model,
        choices=[CompletionChoice(text=text, logprobs=logprobs, finish_reason=finish_reason)],
        usage=usage,
    )
