"""Start a page-source process (``epd_engine.bench.transfer_peer``) and build the target side
of a backend in the test process: pages then really cross a process boundary."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from epd_engine.bench.transfer_peer import CacheSpec
from epd_engine.transfer.backend import CacheRegions, Exports, Peer, TransferBackend
from epd_engine.transfer.factory import TransferSettings, cache_memory, make_backend
from tests.processes import free_port, stop, wait_ready

TOKEN = "bench-token"
SPEC = CacheSpec(num_layers=5, num_kv_pages=12, num_image_pages=4)
SEED = 7


@dataclass(frozen=True)
class Source:
    peer: Peer
    process: subprocess.Popen[bytes]


@contextmanager
def source_processes(
    backends: list[str], log_dir: Path, spec: CacheSpec = SPEC, device: str = "cpu"
) -> Iterator[dict[str, Source]]:
    """One page source per backend, started together (each takes seconds to import torch)."""
    started: list[tuple[str, subprocess.Popen[bytes], str, Path]] = []
    try:
        for name in backends:
            port = free_port()
            log = log_dir / f"source-{name}.log"
            args = [sys.executable, "-m", "epd_engine.bench.transfer_peer", "--backend", name,
                    "--port", str(port), "--seed", str(SEED), "--token", TOKEN,
                    "--device", device, *spec.to_args()]  # fmt: skip
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
            started.append((name, proc, f"http://127.0.0.1:{port}", log))
        sources = {}
        for name, proc, url, log in started:
            wait_ready(f"{url}/ready", proc, log)
            descriptor = httpx.get(f"{url}/describe").json()
            sources[name] = Source(Peer(f"source-{name}-{proc.pid}", url, descriptor), proc)
        yield sources
    finally:
        for _, proc, _, _ in started:
            stop(proc)


def expose(peer: Peer, kind: str, pages: list[int], request_id: str = "bench") -> None:
    response = httpx.post(
        f"{peer.url}/expose", json={"kind": kind, "pages": pages, "request_id": request_id}
    )
    response.raise_for_status()


def target_backend(
    name: str,
    http: httpx.AsyncClient,
    spec: CacheSpec = SPEC,
    token: str = TOKEN,
    device: str = "cpu",
) -> tuple[TransferBackend, CacheRegions]:
    memory = cache_memory(name, device)
    regions = spec.allocate(memory)
    backend = make_backend(TransferSettings(backend=name), memory, regions, Exports(), http, token)
    return backend, regions
