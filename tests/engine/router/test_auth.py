"""Internal endpoints trust only this deployment's secret and members (issue 12, item 1).

Against a real router app on loopback: the defects were a well-known default token, a 500
for a non-ASCII token header, an open trace and API docs, and a process of an earlier run
registering with a new router.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import httpx
import pytest

from epd_engine.api.tokens import DEPLOYMENT_HEADER, TOKEN_HEADER
from epd_engine.bench.static_system import LaunchSpec, LocalSystem
from epd_engine.config import Method, internal_token
from epd_engine.contracts.plan import Plan
from tests.engine.router.live import dispatcher, live_router

BEAT = {"instance_id": "p-0", "url": "http://127.0.0.1:1", "role": "P", "pool": "p"}
TOKEN = {TOKEN_HEADER: internal_token()}


async def test_no_well_known_default_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """``epdctl up`` left EPD_INTERNAL_TOKEN unset and every process trusted a default."""
    monkeypatch.delenv("EPD_INTERNAL_TOKEN")
    assert internal_token() != "epd-dev-token"
    assert internal_token() == internal_token()  # one per process, so it works in-process
    async with live_router() as (url, _), httpx.AsyncClient() as http:
        beat = await http.post(
            f"{url}/internal/instances/heartbeat",
            json=BEAT,
            headers={TOKEN_HEADER: "epd-dev-token"},
        )
    assert beat.status_code == 403


@pytest.mark.parametrize("value", ["é".encode("latin-1"), b"\xff\xfe", "tökén".encode()])
async def test_non_ascii_token_header_is_403_not_500(value: bytes) -> None:
    async with live_router() as (url, _), httpx.AsyncClient() as http:
        answer = await http.get(f"{url}/internal/pools", headers={TOKEN_HEADER: value})
    assert answer.status_code == 403, answer.text
    assert answer.json()["error"]["type"] == "permission_error"


async def test_trace_and_api_docs_are_not_open_metrics_are() -> None:
    async with live_router() as (url, _), httpx.AsyncClient() as http:
        trace_open = await http.get(f"{url}/v1/trace")
        trace_with_token = await http.get(f"{url}/v1/trace", headers=TOKEN)
        docs = [(await http.get(f"{url}{path}")).status_code for path in ("/docs", "/redoc")]
        schema = await http.get(f"{url}/openapi.json")
        metrics = await http.get(f"{url}/metrics")
    assert trace_open.status_code == 403
    assert trace_with_token.status_code == 200
    assert docs == [404, 404]
    assert schema.status_code == 404
    assert metrics.status_code == 200
    assert internal_token() not in metrics.text


async def test_instance_of_an_earlier_run_is_refused_on_register(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stuck P of an earlier run joined the next router on the same port: it had the
    token, so only the deployment id tells it apart."""
    monkeypatch.setenv("EPD_DEPLOYMENT_ID", "run-2")
    async with live_router() as (url, app), httpx.AsyncClient() as http:
        stale = await http.post(
            f"{url}/internal/instances/heartbeat",
            json=BEAT,
            headers={**TOKEN, DEPLOYMENT_HEADER: "run-1"},
        )
        unnamed = await http.post(f"{url}/internal/instances/heartbeat", json=BEAT, headers=TOKEN)
        events = await http.post(
            f"{url}/internal/event-stream",
            content=b"",
            headers={**TOKEN, DEPLOYMENT_HEADER: "run-1", "X-EPD-Event-Session": "s"},
        )
        assert dispatcher(app).registry.all() == []
        member = await http.post(
            f"{url}/internal/instances/heartbeat",
            json=BEAT,
            headers={**TOKEN, DEPLOYMENT_HEADER: "run-2"},
        )
        assert [i.instance_id for i in dispatcher(app).registry.all()] == ["p-0"]
    assert stale.status_code == 403
    assert stale.json()["error"]["code"] == "wrong_deployment"
    assert unnamed.status_code == 403
    assert events.status_code == 403
    assert member.status_code == 200


def test_every_local_run_gets_its_own_secret_and_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EPD_INTERNAL_TOKEN")
    plan = Plan(method=Method.EPD, pools={"EPD": 1})

    def spec(name: str) -> LaunchSpec:
        return LaunchSpec(name, "m", tmp_path, plan, 1, tmp_path / name)

    one, two = spec("a"), spec("b")
    assert one.token != two.token and len(one.token) >= 32
    assert one.deployment_id != two.deployment_id
    assert one.auth_env()["EPD_INTERNAL_TOKEN"] == one.token

    LocalSystem(one).write_state()
    state_file = tmp_path / "a" / "state.json"
    assert one.token in state_file.read_text()
    assert stat.S_IMODE(os.stat(state_file).st_mode) == 0o600  # the token is a secret
