"""The handle exchange ``shm`` and ``cuda_ipc`` share: a header only for the token, regions
validated with a clear ``TransferError``, and a socket that tells when the source is gone.
(``shm`` runs the whole exchange across processes in ``test_backends``.)"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from epd_engine.request import CacheKind
from epd_engine.transfer.backend import PageTransfer, TransferError
from epd_engine.transfer.region_share import (
    PeerRegions,
    RegionServer,
    fetch_regions,
    parse_regions,
    region_header,
)

TOKEN = "t0ken"


def header() -> dict[str, Any]:
    kv = torch.zeros(4, 2, 16, 2, 8, dtype=torch.float16)
    return {"regions": [region_header("kv.0", kv, ipc={"handle": "AAAA"}, storage_offset=0),
                        region_header("image", torch.zeros(2, 8, 32))]}  # fmt: skip


def test_a_header_parses_into_specs_with_the_backend_fields() -> None:
    kv, image = parse_regions(header())
    assert (kv.name, kv.shape, kv.dtype) == ("kv.0", (4, 2, 16, 2, 8), torch.float16)
    assert kv.extra == {"ipc": {"handle": "AAAA"}, "storage_offset": 0}
    assert (image.name, image.dtype, image.extra) == ("image", torch.float32, {})


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"error": "wrong internal token"}, "refused: wrong internal token"),
        ({}, "no list of regions"),
        ({"regions": "kv.0"}, "no list of regions"),
        ({"regions": [1]}, "malformed region 0"),
        ({"regions": [{"name": "kv.0", "shape": [4]}]}, "malformed region 0.*dtype"),
        ({"regions": [{"name": "kv.0", "shape": [4, -1], "dtype": "float16"}]}, "bad shape"),
        ({"regions": [{"name": "kv.0", "shape": [4], "dtype": "int8"}]}, "unsupported cache"),
        ({"regions": [{"name": 3, "shape": [4], "dtype": "float16"}]}, "name must be"),
    ],
)
def test_a_malformed_header_is_a_transfer_error(bad: dict[str, Any], message: str) -> None:
    with pytest.raises(TransferError, match=message):
        parse_regions(bad)


def test_the_token_gets_the_header_and_the_socket_tracks_the_source() -> None:
    offers = []

    def offer() -> tuple[dict[str, Any], list[int]]:
        offers.append(1)
        return header(), []

    server = RegionServer("epd-test", TOKEN, offer)
    try:
        with pytest.raises(TransferError, match="wrong internal token"):
            fetch_regions(server.socket_name, "not-the-token")
        sock, specs, fds = fetch_regions(server.socket_name, TOKEN)
        assert [s.name for s in specs] == ["kv.0", "image"] and fds == []
        assert len(offers) == 1  # exported once per connecting peer
        tensors = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in specs}
        peer = PeerRegions(sock, tensors)
        assert peer.alive()
        kv = peer.layers(PageTransfer("r", CacheKind.KV, (0,), (0,), 0, 1))
        assert kv[0] is tensors["kv.0"]
        with pytest.raises(TransferError, match=r"no cache region 'kv\.1'"):
            peer.layers(PageTransfer("r", CacheKind.KV, (0,), (0,), 0, 2))
    finally:
        server.close()
    with pytest.raises(TransferError, match="cannot reach"):
        fetch_regions(server.socket_name, TOKEN)
    sock.shutdown(2)  # what the source's exit does to our end
    deadline = time.monotonic() + 5
    while peer.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not peer.alive()
    peer.close()


def test_a_source_that_cannot_export_says_why() -> None:
    def offer() -> tuple[dict[str, Any], list[int]]:
        raise RuntimeError("CUDA error: invalid argument")

    server = RegionServer("epd-test", TOKEN, offer)
    try:
        with pytest.raises(TransferError, match="cannot export the caches: CUDA error"):
            fetch_regions(server.socket_name, TOKEN)
    finally:
        server.close()
