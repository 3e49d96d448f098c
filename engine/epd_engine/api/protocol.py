"""OpenAI chat-completions request/response shapes (the subset we serve, plus ``ignore_eos``)."""

from __future__ import annotations

import json
import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.responses import Response

from epd_engine import __version__

# Names the serving software and its version, which is what changes outputs under one model.
SYSTEM_FINGERPRINT = f"fp_epd_{__version__}"


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str
    detail: str | None = None


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart]

    def parts(self) -> list[TextPart | ImagePart]:
        if isinstance(self.content, str):
            return [TextPart(type="text", text=self.content)]
        return list(self.content)


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's extension: running usage on every chunk


class ChatCompletionRequest(BaseModel):
    # extras are kept so server/validation.py can refuse what we do not implement by name
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    ignore_eos: bool = False  # extension (vLLM): fixed output lengths for benchmarks
    min_tokens: int = Field(default=0, ge=0)  # extension (vLLM): no EOS/stop before this many
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 4:
            raise ValueError("at most 4 stop sequences")
        return value

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def num_images(self) -> int:
        return sum(isinstance(p, ImagePart) for m in self.messages for p in m.parts())


class PromptTokensDetails(BaseModel):
    # prompt tokens served from cache: an image whose embeddings the encoder cache held
    # counts its tokens (there is no KV prefix cache)
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


def token_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class Choice(BaseModel):
    index: int = 0
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    choices: list[Choice]
    usage: Usage


def chat_response(
    request_id: str,
    model: str,
    text: str,
    finish_reason: str | None,
    tokens: Usage,
    logprobs: ChoiceLogprobs | None = None,
) -> ChatCompletionResponse:
    """The non-streaming answer, the same from an instance and from the router."""
    message = ResponseMessage(content=text)
    return ChatCompletionResponse(
        id=request_id,
        model=model,
        system_fingerprint=SYSTEM_FINGERPRINT,
        choices=[Choice(message=message, logprobs=logprobs, finish_reason=finish_reason)],
        usage=tokens,
    )


# --- server-sent events: one wire format for instances and the router (chunks: streaming.py)

SSE_DONE = "data: [DONE]\n\n"


def sse_error(message: str) -> str:
    """An error mid-stream, as the OpenAI client raises it (``APIError``)."""
    return f"data: {json.dumps({'error': {'message': message, 'type': 'server_error'}})}\n\n"


def json_answer(answer: BaseModel) -> Response:
    """A whole (non-streamed) answer as JSON, serialized by pydantic's core. FastAPI's
    default for a returned model (``jsonable_encoder``, then ``json.dumps``) took 29 us a
    completion against 1.6 us, on the event loop that the engine thread shares the GIL with
    (14 % of an instance's request handling in a profile of 512 requests)."""
    return Response(answer.model_dump_json(), media_type="application/json")
