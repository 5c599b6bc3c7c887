"""A checkpoint folder served under a hub id from a Hugging Face cache, as an offline machine has it.

``install(folder, "probe/a")`` lays the folder's files out as ``huggingface_hub`` caches a download
(``models--probe--a/refs/main`` naming a snapshot, the files in ``snapshots/<commit>/``), in the
cache ``HF_HUB_CACHE`` names; with ``HF_HUB_OFFLINE=1``, SGLang, transformers and our workers then
resolve ``--model-path probe/a`` from it and from nothing else.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def install(folder: str | Path, repo_id: str, cache: str | Path | None = None) -> str:
    """Put ``folder``'s files in the hub cache under ``repo_id`` (its snapshot named by a hash of
    the folder's path); returns ``repo_id``."""
    cache = Path(cache or os.environ["HF_HUB_CACHE"])
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(str(Path(folder).resolve()).encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    if snapshot.exists():
        shutil.rmtree(snapshot)
    shutil.copytree(folder, snapshot, copy_function=shutil.copyfile)  # new mtimes, as a download has
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return repo_id
