"""``tcp`` backend: page contents as a safetensors payload over HTTP (any host, CPU or GPU).

safetensors is a structured, non-executable format: a JSON header plus raw bytes.
"""

from __future__ import annotations

import httpx
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from epd_engine.transfer.backend import TransferBackend, TransferError
from epd_engine.transfer.messages import PagesQuery


class TcpBackend(TransferBackend):
    name = "tcp"

    def __init__(self, http: httpx.AsyncClient, token: str, timeout_s: float = 30.0) -> None:
        self.http = http
        self.token = token
        self.timeout_s = timeout_s

    async def fetch(
        self, source_url: str, request_id: str, query: PagesQuery
    ) -> dict[str, torch.Tensor]:
        url = f"{source_url}/internal/migrations/{request_id}/pages"
        try:
            response = await self.http.post(
                url,
                json=query.model_dump(mode="json"),
                headers={"X-EPD-Token": self.token},
                timeout=self.timeout_s,
            )
        except httpx.HTTPError as exc:
            raise TransferError(f"pull from {source_url} failed: {exc!r}") from exc
        if response.status_code != 200:
            raise TransferError(
                f"pull from {source_url} answered {response.status_code}: {response.text[:200]}"
            )
        return load_tensors(response.content)

    def export(self, tensors: dict[str, torch.Tensor]) -> bytes:
        return save_tensors({k: v.contiguous().cpu() for k, v in tensors.items()})
