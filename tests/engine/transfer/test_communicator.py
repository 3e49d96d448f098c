"""The communicator set-up both collective backends share, run on gloo: the rendezvous,
the per-group key, NCCL's unique-id exchange (as JSON through the store) and the order of
messages. The NCCL pair itself is a ``gpu`` test (``test_gpu_backends``)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from epd_engine.transfer.backend import CacheRegions, Exports
from epd_engine.transfer.collective import CollectiveBackend
from epd_engine.transfer.communicator import (
    Communicator,
    form_pair,
    rendezvous_store,
    share_unique_id,
    unique_id_key,
)

TIMEOUT_S = 20.0


def stores() -> tuple[torch.distributed.TCPStore, torch.distributed.TCPStore]:
    host = rendezvous_store("127.0.0.1", 0, True, TIMEOUT_S)
    return host, rendezvous_store("127.0.0.1", host.port, False, TIMEOUT_S)


def test_the_store_host_makes_the_unique_id_and_the_peer_reads_it_as_json() -> None:
    host, joined = stores()
    made = []

    def make_id() -> tuple[int, ...]:
        made.append(1)
        return (-3, 0, 127, 5)  # NCCL's id is a tuple of ints (signed chars)

    with ThreadPoolExecutor(2) as pool:
        waiting = pool.submit(share_unique_id, joined, "g1", 0, make_id)  # waits for it
        assert share_unique_id(host, "g1", 1, make_id) == (-3, 0, 127, 5)
        assert waiting.result(TIMEOUT_S) == (-3, 0, 127, 5)
    assert made == [1]  # only the host makes one
    assert host.get(unique_id_key("g1")) == b"[-3, 0, 127, 5]"  # JSON, never pickle


@pytest.mark.parametrize("stored", [b"\x80\x04pickle", b"{}", b"[]", b"[1, true]", b'["1"]'])
def test_a_unique_id_that_is_not_a_list_of_ints_is_refused(stored: bytes) -> None:
    host, joined = stores()
    host.set(unique_id_key("g2"), stored)
    with pytest.raises(RuntimeError, match="unique id"):
        share_unique_id(joined, "g2", 0, lambda: (1,))


def test_a_gloo_pair_keeps_message_order_per_group() -> None:
    host, joined = stores()
    cpu = torch.device("cpu")
    with ThreadPoolExecutor(2) as pool:
        source = pool.submit(form_pair, "gloo", joined, "g3", 0, "127.0.0.1", cpu, TIMEOUT_S)
        target: Communicator = form_pair("gloo", host, "g3", 1, "127.0.0.1", cpu, TIMEOUT_S)
        sender = source.result(TIMEOUT_S)

    def send_all() -> None:
        for i in range(5):
            sender.send(torch.full((3,), float(i)), 16 + i, TIMEOUT_S)

    thread = threading.Thread(target=send_all)
    thread.start()
    got = []
    for i in range(5):
        buf = torch.zeros(3)
        target.recv(buf, 16 + i, TIMEOUT_S)
        got.append(buf[0].item())
    thread.join(TIMEOUT_S)
    assert got == [0.0, 1.0, 2.0, 3.0, 4.0]
    sender.close()
    target.close()


def test_an_unknown_communicator_is_refused() -> None:
    host, _ = stores()
    with pytest.raises(ValueError, match="unknown communicator 'mpi'"):
        form_pair("mpi", host, "g4", 1, "127.0.0.1", torch.device("cpu"), TIMEOUT_S)


async def test_the_backend_is_named_after_its_communicator() -> None:
    regions = CacheRegions(kv=[torch.zeros(2, 2, 2, 1, 1)])
    async with httpx.AsyncClient() as http:
        gloo = CollectiveBackend(regions, Exports(), http, "t")
        assert gloo.name == "collective" and set(gloo.describe()) == {"collective"}
        with pytest.raises(ValueError, match="nccl backend moves CUDA caches"):
            CollectiveBackend(regions, Exports(), http, "t", communicator="nccl")
        with pytest.raises(ValueError, match="unknown communicator"):
            CollectiveBackend(regions, Exports(), http, "t", communicator="mpi")


def test_nccl_unique_id_in_each_cupy_form() -> None:
    """The defect: CuPy 14 refused the id as a tuple ("expected bytes, got tuple") on an H200
    machine, so no nccl group ever formed; ids come as bytes there, as signed chars before."""
    from epd_engine.transfer.nccl import communicator, unique_id_forms

    assert unique_id_forms((-3, 0, 127, 5)) == [bytes([253, 0, 127, 5]), (-3, 0, 127, 5)]

    class Cupy14:
        def NcclCommunicator(self, size: int, uid: object, rank: int) -> tuple:
            if not isinstance(uid, bytes):
                raise TypeError("Argument 'commId' has incorrect type (expected bytes, got tuple)")
            return (size, uid, rank)

    assert communicator(Cupy14(), (1, 2), 1) == (2, b"\x01\x02", 1)
