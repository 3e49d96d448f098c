"""How ``LocalPools`` starts engine processes: budgets searched once per role and settings
are given to the next instances, and each replica's start-up timeline is kept.

No engine runs here: ``spawn_epdctl`` and the HTTP reads are replaced, so the test looks
only at the arguments each replica is started with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest

from epd_engine.config import Role
from epd_operator.kube.manifests import PoolSpec
from epd_operator.local import pools as local_pools
from epd_operator.local.pools import LocalEngines, LocalPools


class FakePopen:
    started: ClassVar[list[list[str]]] = []

    def __init__(self, args: list[str], *_: Any) -> None:
        FakePopen.started.append(list(args))
        self.pid = 4_000_000 + len(FakePopen.started)

    def poll(self) -> None:
        return None  # alive


class FakeResponse:
    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def raise_for_status(self) -> None:
        pass

    def json(self) -> dict[str, Any]:
        return self.body


def _arg(cmd: list[str], flag: str) -> str | None:
    return cmd[cmd.index(flag) + 1] if flag in cmd else None


@pytest.fixture
def pools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> LocalPools:
    FakePopen.started = []
    monkeypatch.setattr(local_pools, "spawn_epdctl", FakePopen)
    searched = {Role.P: {"token_budget": 96}, Role.E: {"image_token_budget": 1152}}

    def get(url: str, **_: Any) -> FakeResponse:
        if url.endswith("/internal/pools"):  # the router: every started replica registered
            ids = [_arg(cmd, "--instance-id") for cmd in FakePopen.started]
            instances = [{"instance_id": i} for i in ids]
            return FakeResponse({"pools": {"all": {"instances": instances}}})
        port = url.rsplit(":", 1)[1].split("/")[0]
        cmd = next(c for c in FakePopen.started if _arg(c, "--port") == port)
        role = Role(str(_arg(cmd, "--role")))
        given = "--token-budget" in cmd or "--image-token-budget" in cmd
        return FakeResponse(
            {
                "status": "ready",
                "startup": {"main": 1.0, "imports": 2.0, "serving": 3.0},
                "searched_budgets": {} if given else searched.get(role, {}),
            }
        )

    monkeypatch.setattr(local_pools.httpx, "get", get)
    engines = LocalEngines(
        tmp_path / "model", "tiny", "http://127.0.0.1:1", tmp_path, "token", ("--slo-ttft", "4")
    )
    return LocalPools(engines)


def test_a_searched_budget_is_given_to_the_next_instance_of_the_role(pools: LocalPools) -> None:
    pools.apply_pool(PoolSpec("p-1", Role.P, 1, 0))
    pools.apply_pool(PoolSpec("e-1", Role.E, 1, 0))
    first_p, first_e = FakePopen.started
    assert "--token-budget" not in first_p and "--image-token-budget" not in first_e
    pools.observe_pools()  # both Ready: they report what they searched

    pools.apply_pool(PoolSpec("p-2", Role.P, 2, 0))  # a new P pool (e.g. 1E1P1D -> 1E2P1D)
    pools.apply_pool(PoolSpec("e-2", Role.E, 1, 0))
    pools.apply_pool(PoolSpec("d-1", Role.D, 1, 0))  # no D searched yet: it searches
    p2a, p2b, e2, d1 = FakePopen.started[2:]
    assert _arg(p2a, "--token-budget") == "96" and _arg(p2b, "--token-budget") == "96"
    assert "--image-token-budget" not in p2a
    assert _arg(e2, "--image-token-budget") == "1152" and "--token-budget" not in e2
    assert "--token-budget" not in d1 and "--image-token-budget" not in d1


def test_other_engine_settings_search_again(pools: LocalPools) -> None:
    pools.apply_pool(PoolSpec("p-1", Role.P, 1, 0))
    pools.observe_pools()
    # a changed spec (another SLO) starts its pools with other flags: a new search
    pools.engines = LocalEngines(
        pools.engines.model_dir, "tiny", "http://127.0.0.1:1", pools.engines.run_dir, "token",
        ("--slo-ttft", "2"),
    )  # fmt: skip
    pools.apply_pool(PoolSpec("p-2", Role.P, 1, 0))
    assert "--token-budget" not in FakePopen.started[-1]


def test_each_replica_keeps_its_start_up_timeline(pools: LocalPools) -> None:
    pools.apply_pool(PoolSpec("p-1", Role.P, 2, 0))
    assert [t.ready for t in pools.timelines()] == [None, None]
    pools.observe_pools()
    timelines = pools.timelines()
    assert [t.instance_id for t in timelines] == ["p-1-0", "p-1-1"]
    for t in timelines:
        assert t.pool == "p-1"
        assert t.phases == {"main": 1.0, "imports": 2.0, "serving": 3.0}
        assert t.ready is not None and t.ready >= t.spawned > 0
