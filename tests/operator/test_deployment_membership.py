"""In-cluster instances prove which EPDDeployment they belong to (issue 12, item 1).

The operator gave pods the deployment's token but no deployment id, so a router in a
cluster checked nothing beyond the token: a pod left over from an earlier EPDDeployment of
the same name could register with the new router. Each pod now carries the owner's uid
(``EPD_DEPLOYMENT_ID``). The test takes the environment from the rendered manifests and
registers, with the headers an engine sends under it, at a real router started with the
router manifest's environment.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import httpx
import pytest

from epd_engine.api.tokens import internal_headers
from epd_engine.config import Method, Role
from epd_engine.contracts.plan import Plan
from epd_operator.kube import manifests as r
from epd_operator.kube.manifests import Owner
from tests.engine.router.live import dispatcher, live_router
from tests.operator.conftest import make_owner

PLAN = Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 1, Role.D: 1})


def literal_env(manifest: dict[str, Any]) -> dict[str, str]:
    """The container's plain ``value`` env (secrets and downward-API fields left out)."""
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def pool_env(owner: Owner) -> dict[str, str]:
    pool = r.pool_specs(owner, PLAN)[1]
    return literal_env(r.render_pool_deployment(owner, pool, PLAN))


def test_every_pod_of_a_deployment_carries_its_uid() -> None:
    owner = make_owner()
    manifests = [
        r.render_router_deployment(owner),
        *(r.render_pool_deployment(owner, p, PLAN) for p in r.pool_specs(owner, PLAN)),
    ]
    assert [literal_env(m)["EPD_DEPLOYMENT_ID"] for m in manifests] == ["uid-1234"] * 4
    later = replace(owner, uid="uid-5678")  # deleted and created again under the same name
    assert pool_env(later)["EPD_DEPLOYMENT_ID"] == "uid-5678"


async def test_a_pod_of_an_earlier_deployment_cannot_register(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    current = make_owner()
    earlier = replace(current, uid="uid-of-the-deleted-one")
    beat = {"instance_id": "demo-p-0", "url": "http://127.0.0.1:1", "role": "P", "pool": "p"}

    def engine_headers(owner: Owner) -> dict[str, str]:
        with monkeypatch.context() as env:
            for name, value in pool_env(owner).items():
                env.setenv(name, value)
            return internal_headers()

    stale, member = engine_headers(earlier), engine_headers(current)
    for name, value in literal_env(r.render_router_deployment(current)).items():
        monkeypatch.setenv(name, value)
    async with live_router() as (url, app), httpx.AsyncClient() as http:
        refused = await http.post(f"{url}/internal/instances/heartbeat", json=beat, headers=stale)
        assert dispatcher(app).registry.all() == []
        joined = await http.post(f"{url}/internal/instances/heartbeat", json=beat, headers=member)
        assert [i.instance_id for i in dispatcher(app).registry.all()] == ["demo-p-0"]
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "wrong_deployment"
    assert joined.status_code == 200
