"""A checkpoint inside a Hugging Face hub cache, named by a branch or tag.

The hub cache (``HF_HUB_CACHE``, what ``huggingface-cli download`` fills) keeps a repository
as ``models--<org>--<name>/`` with ``snapshots/<commit>/`` (each file a symlink into
``../../blobs``) and ``refs/<branch or tag>`` (a file holding the commit). The operator mounts
such a cache whole and passes ``.../snapshots/<revision>``: a commit is already a directory;
a ref name is resolved here to the commit it holds.
"""

from __future__ import annotations

from pathlib import Path


def resolve_snapshot(model_dir: Path) -> Path:
    """``model_dir`` itself, unless it is ``<repo>/snapshots/<ref>`` where no such snapshot
    exists but ``<repo>/refs/<ref>`` does: then the snapshot of the commit the ref holds."""
    if model_dir.exists() or model_dir.parent.name != "snapshots":
        return model_dir
    ref = model_dir.parent.parent / "refs" / model_dir.name
    if not ref.is_file():
        return model_dir
    commit = ref.read_text().strip()
    return model_dir.parent / commit if commit else model_dir
