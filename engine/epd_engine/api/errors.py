"""Every error leaves the server in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from epd_engine.contracts.errors import ClientError

log = logging.getLogger(__name__)


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None):
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    return f"{param or 'body'}: {first.get('msg', 'invalid value')}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ClientError)
    async def _client_error(_: Request, exc: ClientError) -> JSONResponse:
        return JSONResponse(
            error_body(exc.message, exc.error_type, exc.param, exc.code), exc.status_code
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(error_body(message, "invalid_request_error", param), 400)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), kind), exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return JSONResponse(error_body("internal server error", "server_error"), 500)
