"""The deployment's internal credentials: the token every internal call carries, and the
deployment id an instance joining a router proves membership with. No web framework here:
the FastAPI dependencies (``api/auth.py``) and the emulated instance's Starlette routes
(``emulate/http.py``) check them with the same functions.

The token is compared in constant time, as bytes: ``hmac.compare_digest`` on ``str``
raises ``TypeError`` for non-ASCII text, which turned a bad header into a 500.
"""

from __future__ import annotations

import hmac

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


def check_token(given: str) -> None:
    """``Forbidden`` unless ``given`` is the deployment's internal token."""
    if not token_matches(given, internal_token()):
        raise Forbidden("internal endpoint: missing or wrong X-EPD-Token")


def internal_headers() -> dict[str, str]:
    """Headers one process of this deployment sends another."""
    headers = {TOKEN_HEADER: internal_token()}
    if deployment := deployment_id():
        headers[DEPLOYMENT_HEADER] = deployment
    return headers
