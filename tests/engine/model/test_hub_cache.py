"""A checkpoint kept in a Hugging Face hub cache loads through its snapshot's symlinks, named
by a branch (``refs/main``) or by its commit, as the operator passes it for a cache mounted
whole (``model.source.huggingFaceCache``)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import torch

from epd_engine.model.hub_cache import resolve_snapshot
from epd_engine.model.loader import load_language

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(checkpoint: Path, cache: Path, repo: str) -> Path:
    """``checkpoint`` laid out as the hub does: blobs by hash, a snapshot of relative
    symlinks into them, ``refs/main`` naming the snapshot's commit."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "blobs").mkdir(parents=True)
    snapshot = root / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for path in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copyfile(path, root / "blobs" / digest)
        link = snapshot / path.relative_to(checkpoint)
        link.parent.mkdir(parents=True, exist_ok=True)
        depth = len(path.relative_to(checkpoint).parts) + 1  # up to the repo directory
        link.symlink_to(Path(*[".."] * depth) / "blobs" / digest)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)
    return root


def test_a_branch_resolves_to_its_commit_and_the_weights_load(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    repo = hub_cache(tiny_model_dir, tmp_path / "hub", "llava-hf/tiny")
    resolved = resolve_snapshot(repo / "snapshots" / "main")
    assert resolved == repo / "snapshots" / COMMIT
    assert (resolved / "config.json").is_symlink()
    model = load_language(resolved, torch.float32, "cpu")
    reference = load_language(tiny_model_dir, torch.float32, "cpu")
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_a_commit_or_a_plain_directory_is_left_as_it_is(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    repo = hub_cache(tiny_model_dir, tmp_path / "hub", "tiny")
    assert resolve_snapshot(repo / "snapshots" / COMMIT) == repo / "snapshots" / COMMIT
    assert resolve_snapshot(tiny_model_dir) == tiny_model_dir
    missing = repo / "snapshots" / "no-such-branch"
    assert resolve_snapshot(missing) == missing  # serve then says it has no config.json
