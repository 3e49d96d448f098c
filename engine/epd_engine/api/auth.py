"""Who may call internal endpoints: holders of the deployment's token, and (for instances
joining a router) members of the same deployment.

The token is compared in constant time, as bytes: ``hmac.compare_digest`` on ``str``
raises ``TypeError`` for non-ASCII text, which turned a bad header into a 500.
"""

from __future__ import annotations

import hmac

from fastapi import Header

from epd_engine.config import deployment_id, internal_token
from epd_engine.contracts.errors import ClientError

TOKEN_HEADER = "X-EPD-Token"
DEPLOYMENT_HEADER = "X-EPD-Deployment"


class Forbidden(ClientError):
    status_code = 403
    error_type = "permission_error"


def token_matches(given: str, expected: str) -> bool:
    # header values arrive decoded as latin-1; surrogateescape keeps any str encodable
    return hmac.compare_digest(
        given.encode("utf-8", "surrogateescape"), expected.encode("utf-8", "surrogateescape")
    )


def internal_headers() -> dict[str, str]:
    """Headers one process of this deployment sends another."""
    headers = {TOKEN_HEADER: internal_token()}
    if deployment := deployment_id():
        headers[DEPLOYMENT_HEADER] = deployment
    return headers


async def require_token(x_epd_token: str = Header(default="")) -> None:
    # async: FastAPI runs a plain ``def`` dependency in a worker thread, a GIL hand-off
    # that cost milliseconds per internal request next to a busy engine thread
    if not token_matches(x_epd_token, internal_token()):
        raise Forbidden("internal endpoint: missing or wrong X-EPD-Token")


async def require_member(x_epd_deployment: str = Header(default="")) -> None:
    """An instance (or router) of another deployment, e.g. left over from an earlier run on
    the same ports, is refused even when it holds the same token."""
    ours = deployment_id()
    if ours and not token_matches(x_epd_deployment, ours):
        raise Forbidden(
            "caller belongs to another deployment (X-EPD-Deployment); "
            "a process of an earlier run cannot join this one",
            code="wrong_deployment",
        )
