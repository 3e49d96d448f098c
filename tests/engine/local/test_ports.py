"""Ports for local processes (``local/ports.py``).

The defect: ``free_port`` returned a port from the kernel's ephemeral range, which the
kernel also hands to every socket bound to port 0 and every outgoing connection. A P
instance of two tensor-parallel ranks then failed to start with "address already in use"
on its picked port: its ranks' gloo sockets had taken it first (CI, E+P+D with P at TP=2)."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from epd_engine.local import ports
from epd_engine.local.ports import LOWEST, ephemeral_low, free_port


def test_picked_ports_are_free_and_never_ones_the_kernel_hands_out() -> None:
    low = ephemeral_low()
    picked = {free_port() for _ in range(50)}
    assert all(LOWEST <= port < low for port in picked), sorted(picked)
    assert len(picked) > 40  # spread out: two launchers rarely pick the same one
    for port in list(picked)[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free, as promised


def test_what_the_kernel_hands_out_is_in_its_ephemeral_range() -> None:
    """The premise: port-0 sockets (gloo's, a store's) take ports at or above the range's
    start, so they cannot collide with a picked one."""
    sockets = [socket.socket() for _ in range(20)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        assert all(sock.getsockname()[1] >= ephemeral_low() for sock in sockets)
    finally:
        for sock in sockets:
            sock.close()


def test_a_port_another_process_just_picked_is_not_handed_out_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The defect: two launchers picking within the seconds before an engine binds its port
    could both be handed that port (CI: an engine of one test system failed with "address
    already in use" on port 18008, picked by the suite running beside it). Both pickers here
    draw the same random sequence, so without the claim they would return the same port."""
    monkeypatch.setenv("EPD_PORT_CLAIMS_DIR", str(tmp_path))
    script = (
        "import random\nfrom epd_engine.local import ports\n"
        "ports._RANDOM = random.Random(7)\nprint(ports.free_port())"
    )
    other = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    theirs = int(other.stdout)
    monkeypatch.setattr(ports, "_RANDOM", random.Random(7))
    ours = ports.free_port()
    assert ours != theirs
    assert (tmp_path / str(theirs)).exists() and (tmp_path / str(ours)).exists()


def test_an_old_claim_expires(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A claim only covers the start of the process it was picked for; then the port's
    own binding (or its freedom) decides."""
    monkeypatch.setenv("EPD_PORT_CLAIMS_DIR", str(tmp_path))
    monkeypatch.setattr(ports, "_RANDOM", random.Random(11))
    first = ports.free_port()
    stale = time.time() - ports.CLAIM_S - 1
    os.utime(tmp_path / str(first), (stale, stale))
    monkeypatch.setattr(ports, "_RANDOM", random.Random(11))
    assert ports.free_port() == first


def test_an_unwritable_claims_directory_still_gives_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("EPD_PORT_CLAIMS_DIR", str(blocker / "claims"))
    assert LOWEST <= ports.free_port() < ephemeral_low()
