"""Where a checkpoint comes from: a local directory or a hub id (resolved through the Hugging Face cache)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer*", "*.model"]


def checkpoint_name(source: str) -> str:
    """The checkpoint's own name, which the manifest records and `serve` answers to by default: a hub id as given,
    a local directory's name (its path says where it sat on the exporting machine, not what the model is)."""
    path = Path(source).expanduser()
    return path.resolve().name if path.is_dir() else source


def resolve_checkpoint(source: str, revision: str | None = None) -> Path:
    """A local checkpoint directory for `source`: the directory itself, or the hub snapshot of `source`.

    Hub ids go through `huggingface_hub.snapshot_download`, which honours HF_HOME, HF_HUB_OFFLINE and tokens; with
    no network it answers from the local cache or fails naming the id.
    """
    path = Path(source).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.exists():
        raise ValueError(f"checkpoint {source!r} is a file; give a checkpoint directory or a hub id")
    if source.count("/") != 1 or source.startswith((".", "/")):
        raise ValueError(f"checkpoint {source!r} is neither a local directory nor a hub id (owner/name)")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, revision=revision, allow_patterns=CHECKPOINT_PATTERNS))
    except Exception as exc:  # the hub client raises many kinds; the message names the cause
        # The hub client's messages run to several lines; the first names the cause.
        cause = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"could not fetch checkpoint {source!r} from the hub or its cache: {cause}") from exc


def file_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file of the checkpoint, by relative path; the files hashed at once in threads (hashlib lets
    go of the GIL: d3 (27B)'s eleven 5 GB shards took 53 s one after another on the GPU host)."""
    from concurrent.futures import ThreadPoolExecutor

    def digest(path: Path) -> str:
        hashed = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                hashed.update(block)
        return hashed.hexdigest()

    paths = sorted(p for p in root.rglob("*") if p.is_file())
    with ThreadPoolExecutor(max(1, min(len(paths), os.cpu_count() or 1))) as pool:
        return {str(path.relative_to(root)): value for path, value in zip(paths, pool.map(digest, paths))}
