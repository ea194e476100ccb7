"""`systemone serve CHECKPOINT`: a checkpoint (a directory or a hub id) is exported once into a cache, and later
starts serve the artifact from there. An artifact directory (one with manifest.json) is served as it is.

An export is keyed by what decides its output: the checkpoint's files (sha256 each, remembered by size and
modification time so that a later start reads no multi-GB file again), its served name, and the exporter's version
(the package's version and a digest of the export and models packages' files, so a changed exporter exports
again). Concurrent first starts of one checkpoint do not export twice or see half an artifact: the export is
written to a temporary directory beside its place and renamed into it, under a lock file the others wait on."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"  # runtime/artifact.py's MANIFEST (not imported: this runs before anything is loaded)
CACHE_ENV = "SYSTEMONE_CACHE_DIR"
HASHES_FILE = "file-hashes.json"

Exporter = Callable[..., Any]  # export/pipeline.py's export_checkpoint(source, out, revision=...)


def default_cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """$SYSTEMONE_CACHE_DIR, else $XDG_CACHE_HOME/systemone, else ~/.cache/systemone."""
    if environ.get(CACHE_ENV):
        return Path(environ[CACHE_ENV]).expanduser()
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "systemone"


def is_artifact(path: str | Path) -> bool:
    return (Path(path).expanduser() / MANIFEST).is_file()


def exporter_version() -> str:
    """The package's version and a digest of the files of the packages that write an artifact."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("systemone-onnx")
    except PackageNotFoundError:
        release = "unknown"
    digest = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for package in ("export", "models"):
        base = (here / package).resolve()
        for path in sorted(p for p in base.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            digest.update(str(path.relative_to(base)).encode() + b"\0" + path.read_bytes() + b"\0")
    return f"{release}+{digest.hexdigest()[:12]}"


def checkpoint_hashes(checkpoint: Path, memo_path: Path) -> dict[str, str]:
    """sha256 of every file of `checkpoint` by relative path (export/source.py's `file_hashes`), each file read
    only when its size or modification time differs from what `memo_path` remembers."""
    try:
        memo = json.loads(memo_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        memo = {}
    hashes, changed = {}, False
    for path in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
        real = path.resolve()  # a hub snapshot's files are links to its blobs
        stat = real.stat()
        seen = memo.get(str(real))
        if seen is None or seen[:2] != [stat.st_size, stat.st_mtime_ns]:
            digest = hashlib.sha256()
            with open(real, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
            seen = memo[str(real)] = [stat.st_size, stat.st_mtime_ns, digest.hexdigest()]
            changed = True
        hashes[str(path.relative_to(checkpoint))] = seen[2]
    if changed:
        write_atomically(memo_path, json.dumps(memo))
    return hashes


def write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(temporary, path)


def cache_key(name: str, hashes: Mapping[str, str], version: str) -> str:
    return hashlib.sha256(json.dumps([name, sorted(hashes.items()), version]).encode()).hexdigest()


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "--", name).strip("-.") or "checkpoint"


def servable(source: str, cache_dir: Path, revision: str | None = None, export: Exporter | None = None,
             say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> Path:
    """The artifact to serve for `source`: `source` itself where it is an artifact, else the cached export of the
    checkpoint `source` (a directory or a hub id), exported now if no start exported it before."""
    if is_artifact(source):
        return Path(source).expanduser()
    from .export.source import checkpoint_name, resolve_checkpoint
    from .models.registry import FAMILIES

    path = Path(source).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(f"{source} is not an exported artifact (it has no {MANIFEST}) nor a checkpoint directory "
                         "(it has no config.json)")
    if not path.exists() and (source.count("/") != 1 or source.startswith((".", "/", "~"))):
        raise ValueError(f"{source} does not exist: give an exported artifact (a directory with {MANIFEST}), a "
                         "checkpoint directory or a hub id (owner/name)")
    checkpoint = resolve_checkpoint(source, revision)
    FAMILIES.recognise(checkpoint)  # a directory of no known family fails here, before minutes of export
    name = checkpoint_name(source)
    root = cache_dir / "artifacts"
    hashes = checkpoint_hashes(checkpoint, cache_dir / HASHES_FILE)
    place = root / f"{_slug(name)}-{cache_key(name, hashes, exporter_version())[:16]}"
    if is_artifact(place):
        return place
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{place.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"another start is exporting {name} into {place}; waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if is_artifact(place):  # the start that held the lock exported it
            return place
        if export is None:
            from .export.pipeline import export_checkpoint as export
        say(f"exporting {name} into the artifact cache (this start only; later starts serve it from there): "
            f"{place}")
        started = time.monotonic()
        staging = Path(tempfile.mkdtemp(prefix=f".{place.name}.", dir=root))
        try:
            export(source, staging / "artifact", revision=revision)
            (staging / "artifact").rename(place)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        say(f"exported {name} in {time.monotonic() - started:.0f} s")
    return place
