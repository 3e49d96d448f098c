"""A stand-alone page source: caches of a given shape filled with seeded random pages, a
transfer backend serving them, and the HTTP control routes a backend needs.

``python -m epd_engine.bench.transfer_peer --backend tcp --port 8123 ...`` runs it as its
own process, so ``bench-transfer`` and the backend tests move pages across processes the
way two engine instances do, without loading a model.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
import torch
import uvicorn
from fastapi import FastAPI, HTTPException

from epd_engine.request import CacheKind
from epd_engine.transfer.backend import CacheRegions, Exports, TransferBackend, TransferError
from epd_engine.transfer.factory import TransferSettings, cache_memory, make_backend
from epd_engine.transfer.memory import CacheMemory, dtype_of

REQUEST_ID = "bench"


@dataclass(frozen=True)
class CacheSpec:
    """Cache geometry: KV ``[num_kv_pages, 2, block_size, kv_heads, head_dim]`` per layer
    and an image cache ``[num_image_pages, image_tokens, hidden]``."""

    num_layers: int = 4
    num_kv_pages: int = 16
    block_size: int = 16
    kv_heads: int = 2
    head_dim: int = 32
    num_image_pages: int = 4
    image_tokens: int = 8
    hidden: int = 64
    dtype: str = "float32"

    @property
    def kv_page_shape(self) -> tuple[int, ...]:
        return (2, self.block_size, self.kv_heads, self.head_dim)

    def kv_bytes_per_page(self) -> int:
        per_layer = 2 * self.block_size * self.kv_heads * self.head_dim
        return (
            per_layer * self.num_layers * torch.empty((), dtype=dtype_of(self.dtype)).element_size()
        )

    def allocate(self, memory: CacheMemory) -> CacheRegions:
        dtype = dtype_of(self.dtype)
        kv = [
            memory.zeros(f"kv.{i}", (self.num_kv_pages, *self.kv_page_shape), dtype)
            for i in range(self.num_layers)
        ]
        image = memory.zeros("image", (self.num_image_pages, self.image_tokens, self.hidden), dtype)
        return CacheRegions(kv=kv, image=image)

    def to_args(self) -> list[str]:
        return [f"--{k.replace('_', '-')}={v}" for k, v in vars(self).items()]


def fill(regions: CacheRegions, seed: int) -> None:
    """Deterministic contents: a target regenerates them to check what it received."""
    generator = torch.Generator().manual_seed(seed)  # on CPU: the same pages on any device
    for tensor in [*regions.kv, *([regions.image] if regions.image is not None else [])]:
        tensor.copy_(torch.randn(tensor.shape, generator=generator).to(tensor.dtype))
    if any(t.is_cuda for t in regions.kv):
        torch.cuda.synchronize()


def create_app(backend: TransferBackend, exports: Exports) -> FastAPI:
    app = FastAPI()

    @app.get("/describe")
    async def describe() -> dict[str, Any]:
        return backend.describe()

    @app.post("/expose")
    async def expose(body: dict[str, Any]) -> dict[str, str]:
        exports.expose(body.get("request_id", REQUEST_ID), CacheKind(body["kind"]), body["pages"])
        return {"status": "ok"}

    @app.post("/internal/transfer/{name}/{op}")
    async def control(name: str, op: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            return await backend.control(op, body)
        except TransferError as exc:
            raise HTTPException(400, str(exc)) from exc

    @app.get("/ready")
    async def ready() -> dict[str, str]:
        return {"status": "ok"}

    return app


def _exit_with_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(0)
        time.sleep(0.5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--backend", default="tcp")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--token", default="bench-token")
    p.add_argument("--device", default="cpu", help="where the caches live (cuda: GPU backends)")
    for name, value in vars(CacheSpec()).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = p.parse_args()
    spec = CacheSpec(**{k: getattr(args, k) for k in vars(CacheSpec())})
    torch.set_num_threads(1)
    memory = cache_memory(args.backend, args.device)
    regions = spec.allocate(memory)
    fill(regions, args.seed)
    exports = Exports()
    settings = TransferSettings(backend=args.backend)
    http = httpx.AsyncClient()
    backend = make_backend(settings, memory, regions, exports, http, args.token)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    uvicorn.run(create_app(backend, exports), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
