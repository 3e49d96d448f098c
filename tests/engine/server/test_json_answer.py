"""``json_answer``: pydantic's serializer gives the very JSON FastAPI's default gave for the
same answer (``jsonable_encoder`` of the model), for both answer kinds with every optional
part filled, unicode and the logprob floor included."""

from __future__ import annotations

import json

from fastapi.encoders import jsonable_encoder

from epd_engine.api.completions import completion_response
from epd_engine.api.logprobs import FLOOR, completion_logprobs
from epd_engine.api.protocol import (
    ChoiceLogprobs,
    TokenLogprob,
    TopLogprob,
    chat_response,
    json_answer,
    token_usage,
)

TEXT = 'Ça va? "yes"\n\t— 東京 🙂'


def entries() -> list[TokenLogprob]:
    top = [TopLogprob(token="a", logprob=-0.25, bytes=[97]), TopLogprob(token="b", logprob=FLOOR)]
    return [TokenLogprob(token="é", logprob=-1.5, bytes=[195, 169], top_logprobs=top)]


def test_a_chat_answer_is_the_json_fastapi_gave() -> None:
    answer = chat_response("chatcmpl-1", "m", TEXT, "stop", token_usage(12, 3, 4),
                           ChoiceLogprobs(content=entries()))  # fmt: skip
    response = json_answer(answer)
    assert response.media_type == "application/json"
    assert json.loads(bytes(response.body)) == jsonable_encoder(answer)


def test_a_completion_answer_is_the_json_fastapi_gave() -> None:
    shaped = completion_logprobs([entry.model_dump() for entry in entries()])
    answer = completion_response("cmpl-1", "m", TEXT, "length", token_usage(5, 1), shaped)
    assert json.loads(bytes(json_answer(answer).body)) == jsonable_encoder(answer)
    plain = completion_response("cmpl-2", "m", "", None, token_usage(5, 0), None)
    assert json.loads(bytes(json_answer(plain).body)) == jsonable_encoder(plain)
