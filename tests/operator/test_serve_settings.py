"""One serve-argument builder for every backend (issue 29): the Kubernetes pod, the reconciled
local pools and the static launcher pass an instance the same engine settings, and the
budget flags, which had drifted apart (the launcher gave a plan's budgets in one order, the
pod in another, local pools only what a replica had searched), come from one place."""

from __future__ import annotations

from pathlib import Path

from epd_engine.bench.static_system import LaunchSpec, instances
from epd_engine.config import Method, Role
from epd_engine.contracts.plan import Budgets, Plan
from epd_engine.contracts.serve_args import (
    ServeCommand,
    plan_budget_flags,
    searched_budget_flags,
)
from epd_operator.kube import manifests as r
from epd_operator.local.reconciler import engine_args
from epd_operator.rollout.serve_settings import cache_settings, engine_settings
from tests.operator.conftest import make_owner

PLAN = Plan(
    method=Method.EP_D,
    pools={Role.EP: 1, Role.D: 1},
    budgets={Role.EP: Budgets(image_budget=3, token_budget=512)},
)


def _flags(args: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(args, [*args[1:], ""], strict=True) if a.startswith("--")}


def _contains_in_order(args: list[str], part: list[str]) -> bool:
    n = len(part)
    return any(args[i : i + n] == part for i in range(len(args) - n + 1))


def test_a_pod_and_a_local_replica_get_the_same_engine_settings() -> None:
    owner = make_owner(engine={"kvBlockSize": 32, "extraArgs": ["--max-num-running", "7"]})
    settings = engine_settings(owner.spec)
    pool = next(p for p in r.pool_specs(owner, PLAN) if p.role == Role.EP)
    pod_args = r.render_pool_deployment(owner, pool, PLAN)["spec"]["template"]["spec"][
        "containers"
    ][0]["args"]
    local_args = list(engine_args(owner.spec))
    assert _contains_in_order(pod_args, settings)
    assert local_args[: len(settings)] == settings
    # the user's extra arguments come last everywhere, so that they win
    assert pod_args[-2:] == local_args[-2:] == ["--max-num-running", "7"]
    assert _flags(pod_args)["--token-budget"] == "512"
    assert _flags(pod_args)["--image-budget"] == "3"


def test_the_static_launcher_passes_the_plan_budgets_and_the_extra_arguments_last(
    tmp_path: Path,
) -> None:
    owner = make_owner(engine={"extraArgs": ["--token-budget", "64"]})
    launch = LaunchSpec(
        name="demo", model_name="m", model_dir=tmp_path, plan=PLAN, router_port=8080,
        run_dir=tmp_path, engine_args=[*cache_settings(owner.spec), "--token-budget", "64"],
    )  # fmt: skip
    by_role = {i.role: i.args for i in instances(launch)}
    ep = by_role["EP"]
    assert _contains_in_order(ep, plan_budget_flags(PLAN.budgets[Role.EP]))
    assert _contains_in_order(ep, cache_settings(owner.spec))
    # the plan says 512, the user's extra argument says 64: argparse keeps the last one
    assert ep[-2:] == ["--token-budget", "64"]
    assert "--token-budget" not in by_role["D"][: by_role["D"].index("--kv-block-size")]


def test_searched_budgets_become_the_flags_that_pass_them_on() -> None:
    assert searched_budget_flags({"token_budget": 256, "image_token_budget": 1152}) == [
        "--image-token-budget", "1152", "--token-budget", "256",
    ]  # fmt: skip
    command = ServeCommand(
        model="/m", served_model_name="m", role=Role.D, pool="p", instance_id="p-0",
        host="127.0.0.1", port=9, router=("--router-url", "http://r"), dtype="float32",
        device="cpu", budgets=searched_budget_flags({"token_budget": 8}), extra=("--x", "1"),
    )  # fmt: skip
    argv = command.argv()
    assert argv[0] == "serve" and argv[-2:] == ["--x", "1"]
    assert _flags(argv)["--role"] == "D" and _flags(argv)["--token-budget"] == "8"


def test_a_local_replica_of_a_planned_run_gets_the_plan_budgets_not_a_search(
    tmp_path: Path,
) -> None:
    """`epdctl up --plan` (the reconciled run fixed at a plan): the plan's budgets reach the
    engines of its roles as the pod would get them; a role the plan leaves to the search
    gets what another replica searched, else nothing."""
    from epd_operator.local.pools import LocalEngines, LocalPools, budget_key
    from epd_operator.rollout.pool_identity import PoolSpec

    engines = LocalEngines(
        tmp_path, "m", "http://127.0.0.1:9", tmp_path, "token", plan_budgets=PLAN.budgets
    )
    pools = LocalPools(engines)
    pools.searched_budgets[budget_key(PoolSpec("demo-d", Role.D, 1, 0), engines)] = {
        "token_budget": 96
    }
    ep = pools.engine_args(PoolSpec("demo-ep", Role.EP, 1, 0), "demo-ep-0", 9001)
    d = pools.engine_args(PoolSpec("demo-d", Role.D, 1, 0), "demo-d-0", 9002)
    assert _contains_in_order(ep, plan_budget_flags(PLAN.budgets[Role.EP]))
    assert _flags(d)["--token-budget"] == "96" and "--image-budget" not in d


def test_processor_max_pixels_reaches_every_engine_and_names_its_pools() -> None:
    """engine.processorMaxPixels (issue 31): every instance gets --processor-max-pixels (an
    image's token count must agree between its E and P instances, so it is part of the pool
    name); a deployment without it keeps its flags and its pool names."""
    plain = make_owner()
    lowered = make_owner(engine={"processorMaxPixels": 1003520})
    assert "--processor-max-pixels" not in engine_settings(plain.spec)
    assert _contains_in_order(engine_settings(lowered.spec), ["--processor-max-pixels", "1003520"])
    for pool in r.pool_specs(lowered, PLAN):
        pod_args = r.render_pool_deployment(lowered, pool, PLAN)["spec"]["template"]["spec"][
            "containers"
        ][0]["args"]
        assert _flags(pod_args)["--processor-max-pixels"] == "1003520"
    assert _flags(list(engine_args(lowered.spec)))["--processor-max-pixels"] == "1003520"
    plain_names = [p.name for p in r.pool_specs(plain, PLAN)]
    assert plain_names == [p.name for p in r.pool_specs(make_owner(), PLAN)]
    assert plain_names != [p.name for p in r.pool_specs(lowered, PLAN)]
