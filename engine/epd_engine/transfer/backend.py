"""Transfer backend seam: moves page contents; control messages always go over HTTP.

``tcp`` works between any two hosts on CPU or GPU. A same-node ``cuda_ipc`` backend and
a CuPy ``nccl`` backend plug in here by implementing the same two methods.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from epd_engine.transfer.messages import PagesQuery


class TransferBackend(ABC):
    name: str

    @abstractmethod
    async def fetch(
        self, source_url: str, request_id: str, query: PagesQuery
    ) -> dict[str, torch.Tensor]:
        """Target side (step 2+3): the named tensors the source exported for ``query``.

        Raises ``TransferError`` if the source is gone or answers badly; the caller then
        recomputes or re-routes, so a failed pull never loses the request.
        """

    @abstractmethod
    def export(self, tensors: dict[str, torch.Tensor]) -> bytes:
        """Source side (step 3): the payload the source's pages endpoint returns."""


class TransferError(RuntimeError):
    pass
