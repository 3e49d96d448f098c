"""Who may call internal endpoints of a FastAPI server: holders of the deployment's token,
and (for instances joining a router) members of the same deployment (``api/tokens.py``)."""

from __future__ import annotations

from fastapi import Header

from epd_engine.api.tokens import Forbidden, check_token, token_matches
from epd_engine.config import deployment_id


async def require_token(x_epd_token: str = Header(default="")) -> None:
    # async: FastAPI runs a plain ``def`` dependency in a worker thread, a GIL hand-off
    # that cost milliseconds per internal request next to a busy engine thread
    check_token(x_epd_token)


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
