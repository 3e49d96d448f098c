"""The emulated instance's HTTP layer: Starlette routes that answer as the engine's FastAPI
ones do (OpenAI-shaped errors, the same request models, the internal token), without
FastAPI: importing it alone took about 0.4 of the 1.3 CPU seconds an emulated instance
needed to start (issue 32 asks for 1 s), for route signatures this layer reads in a line.

A handler is ``async (request[, body]) -> dict | Response``: ``body`` is the request's JSON
validated into the route's pydantic model (a 400 naming the field when it is not), a dict
answer is sent as JSON.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from epd_engine.api.error_shape import error_body, validation_message
from epd_engine.api.tokens import TOKEN_HEADER, check_token
from epd_engine.contracts.errors import ClientError

log = logging.getLogger(__name__)

Handler = Callable[..., Awaitable[Any]]


def route(
    path: str,
    handler: Handler,
    method: str = "GET",
    body: type[BaseModel] | None = None,
    internal: bool = False,
) -> Route:
    """``handler`` at ``path``; ``internal``: only for holders of the deployment's token."""

    async def endpoint(request: Request) -> Response:
        if internal:
            check_token(request.headers.get(TOKEN_HEADER, ""))
        args: list[BaseModel] = []
        if body is not None:
            try:
                args.append(body.model_validate_json(await request.body()))
            except ValidationError as exc:
                message, param = validation_message(exc.errors())
                return JSONResponse(error_body(message, "invalid_request_error", param), 400)
        answer = await handler(request, *args)
        return answer if isinstance(answer, Response) else JSONResponse(answer)

    return Route(path, endpoint, methods=[method])


async def _client_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, ClientError)
    body = error_body(exc.message, exc.error_type, exc.param, exc.code)
    return JSONResponse(body, exc.status_code)


async def _http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return JSONResponse(error_body(str(exc.detail), kind), exc.status_code)


async def _unexpected(_: Request, exc: Exception) -> Response:
    log.exception("unhandled error", exc_info=exc)
    return JSONResponse(error_body("internal server error", "server_error"), 500)


# as api/errors.install_error_handlers: every error in OpenAI's shape
EXCEPTION_HANDLERS = {
    ClientError: _client_error,
    HTTPException: _http_error,
    Exception: _unexpected,
}
