"""Rank 0's calls to the other ranks: pickled objects broadcast over the call group.

``broadcast_object_list`` cannot be given a timeout, and gloo's broadcast blocks its sender
until every receiver takes the data: a hung rank would hang rank 0 before any collective
could time out. So rank 0 waits each broadcast with ``rank_timeout_s``; the other ranks wait
as long as the instance is idle."""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def send(message: object, group: Any, timeout: timedelta) -> None:
    payload = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    for tensor in (size, payload):
        dist.broadcast(tensor, src=0, group=group, async_op=True).wait(timeout=timeout)


def receive(group: Any) -> object:
    size = torch.empty(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    payload = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(payload, src=0, group=group)
    return pickle.loads(payload.numpy().tobytes())
