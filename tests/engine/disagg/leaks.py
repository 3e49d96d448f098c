"""Pages a test system's instances still hold after its requests ended: none may be."""

from __future__ import annotations

import os
import time

import httpx

from epd_engine.bench.static_system import LocalSystem
from epd_engine.config import internal_token


def free_pages(url: str) -> dict[str, tuple[int, int]]:
    """Free (KV, image) pages per live instance, from the router's pool table."""
    headers = {"X-EPD-Token": internal_token()}
    pools = httpx.get(f"{url}/internal/pools", headers=headers).json()["pools"]
    return {
        i["instance_id"]: (i["free_kv_blocks"], i["free_image_blocks"])
        for pool in pools.values()
        for i in pool["instances"]
    }


def assert_nothing_leaked(system: LocalSystem, timeout_s: float = 10) -> None:
    """Once the request is done every live instance has all its pages back (cached image
    pages count as free), and no shared-memory segment was left in /dev/shm."""
    full = {"kv": 256, "image": 16}  # ENGINE_ARGS of the test systems
    deadline = time.monotonic() + timeout_s
    while True:
        free = {
            name: pages
            for name, pages in free_pages(system.spec.router_url).items()
            if system.process(name).popen.poll() is None  # the victim may still be listed
        }
        held = {
            name: pages
            for name, pages in free.items()
            if ("-e-" not in name and pages[0] != full["kv"])
            or ("-d-" not in name and pages[1] != full["image"])
        }
        if not held or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert not held, f"pages still held after the request finished: {held}"
    assert not [n for n in os.listdir("/dev/shm") if "epd" in n]
