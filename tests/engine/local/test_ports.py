"""Ports for local processes (``local/ports.py``).

The defect: ``free_port`` returned a port from the kernel's ephemeral range, which the
kernel also hands to every socket bound to port 0 and every outgoing connection. A P
instance of two tensor-parallel ranks then failed to start with "address already in use"
on its picked port: its ranks' gloo sockets had taken it first (CI, E+P+D with P at TP=2)."""

from __future__ import annotations

import socket

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
