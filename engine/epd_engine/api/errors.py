"""Every error leaves a FastAPI server in OpenAI's shape (``api/error_shape.py``)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from epd_engine.api.error_shape import error_body, validation_message
from epd_engine.contracts.errors import ClientError

log = logging.getLogger(__name__)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ClientError)
    async def _client_error(_: Request, exc: ClientError) -> JSONResponse:
        return JSONResponse(
            error_body(exc.message, exc.error_type, exc.param, exc.code), exc.status_code
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        return JSONResponse(error_body(message, "invalid_request_error", param), 400)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), kind), exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return JSONResponse(error_body("internal server error", "server_error"), 500)
