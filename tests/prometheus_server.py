"""A real Prometheus (Debian's ``prometheus`` binary) on 127.0.0.1 for tests: scrapes the
given targets every second, stores in a temporary folder, stops for sure at the end.

Without the binary the test skips, except under ``CI=true`` or ``EPD_REQUIRE_PROMETHEUS=1``,
where it fails (CI installs it: ``.ci/run``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.processes import free_port

SCRAPE_INTERVAL_S = 1


def binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        why = "the prometheus binary is not installed (apt-get install prometheus)"
        if os.environ.get("CI") == "true" or os.environ.get("EPD_REQUIRE_PROMETHEUS") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return found


def config(targets: Mapping[str, Mapping[str, str]]) -> dict[str, Any]:
    """One scrape job; ``targets`` maps host:port to the labels Prometheus attaches (the
    ServiceMonitor's ``namespace``/``pod`` in a cluster)."""
    interval = f"{SCRAPE_INTERVAL_S}s"
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [
            {
                "job_name": "epd",
                "scrape_timeout": interval,
                "static_configs": [
                    {"targets": [target], "labels": dict(labels)}
                    for target, labels in targets.items()
                ],
            }
        ],
    }


@contextmanager
def prometheus(
    targets: Mapping[str, Mapping[str, str]], folder: Path, timeout_s: float = 60
) -> Iterator[str]:
    """Run Prometheus scraping ``targets`` until the block ends; yields its URL once every
    target has been scraped successfully."""
    exe = binary()
    folder.mkdir(parents=True, exist_ok=True)
    conf = folder / "prometheus.yml"
    conf.write_text(yaml.safe_dump(config(targets)))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = folder / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                exe,
                f"--config.file={conf}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_scraped(url, proc, log, len(targets), timeout_s)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_scraped(
    url: str, proc: subprocess.Popen[bytes], log: Path, want: int, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {proc.returncode}:\n{log.read_text()}")
        try:
            active = httpx.get(f"{url}/api/v1/targets", timeout=2).json()["data"]["activeTargets"]
        except (httpx.HTTPError, ValueError, KeyError):
            active = []
        if len(active) == want and all(t["health"] == "up" for t in active):
            return
        time.sleep(0.5)
    raise TimeoutError(f"prometheus did not scrape {want} targets in {timeout_s}s:\n{active}")


def query(url: str, expr: str, at: float | None = None) -> list[dict[str, Any]]:
    """An instant query's result vector (raises on an error answer, e.g. bad PromQL)."""
    params: dict[str, Any] = {"query": expr}
    if at is not None:
        params["time"] = at
    body = httpx.get(f"{url}/api/v1/query", params=params, timeout=10).json()
    if body.get("status") != "success":
        raise AssertionError(f"{expr}: {body.get('errorType')}: {body.get('error')}")
    result = body["data"]["result"]
    return result if isinstance(result, list) else [{"metric": {}, "value": result}]


def label_values(url: str, label: str, match: Sequence[str]) -> list[str]:
    """Grafana's ``label_values(SELECTOR, LABEL)``: the label's values on matching series."""
    body = httpx.get(
        f"{url}/api/v1/label/{label}/values", params={"match[]": list(match)}, timeout=10
    ).json()
    if body.get("status") != "success":
        raise AssertionError(f"label_values({match}, {label}): {body.get('error')}")
    return list(body["data"])
