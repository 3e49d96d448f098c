"""Errors a client caused; the servers map them to OpenAI-shaped 4xx responses in one place."""

from __future__ import annotations


class ClientError(Exception):
    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def __reduce__(self) -> tuple[type[ClientError], tuple[str, str | None, str | None]]:
        # raised in a preprocessing worker process: comes back with its param and code
        return (type(self), (self.message, self.param, self.code))


class ModelNotFound(ClientError):
    status_code = 404
    error_type = "invalid_request_error"


class ServiceUnavailable(ClientError):
    status_code = 503
    error_type = "service_unavailable"
