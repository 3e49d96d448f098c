"""The prefix cache's per-model salt: what makes one model's page keys differ from
another's (``cache/prefix_hash.py``)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from epd_engine.config import EngineConfig


def prefix_salt(config: EngineConfig) -> str | None:
    """None when the prefix cache is off; else the served name, the KV dtype and a digest of
    the checkpoint's ``config.json``: instances of one model agree, two models never do."""
    if not config.prefix_cache:
        return None
    config_file = Path(config.model_dir) / "config.json"
    text = config_file.read_bytes() if config_file.exists() else b""
    digest = hashlib.sha256(text).hexdigest()[:16]
    return f"{config.model_name}|{config.dtype}|{digest}"
