"""The OpenAI error shape every server answers in: ``{"error": {message, type, param,
code}}``, and the message for an invalid request body. No web framework here: the FastAPI
servers (``api/errors.py``) and the emulated instance's Starlette app share it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None):
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """The first of pydantic's (or FastAPI's) validation errors as a message and the
    parameter it names."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    return f"{param or 'body'}: {first.get('msg', 'invalid value')}", param
