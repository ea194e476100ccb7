"""`systemone serve CHECKPOINT`: a checkpoint is exported once into the cache, keyed by its files and the exporter's
version, and served from there on later starts; `serve ARTIFACT` serves the artifact as it is. Concurrent first
starts export once and never see half an artifact. The exporter here copies the session's exported artifact (the
real export is tested in test_export.py), so each test takes seconds."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest

from systemone import artifact_cache, cli
from systemone.artifact_cache import default_cache_dir, servable
from systemone.server import lifecycle


class CopyExporter:
    """export_checkpoint's signature; it copies `artifact` after `seconds`, counting its calls."""

    def __init__(self, artifact: Path, seconds: float = 0.0, fails: bool = False):
        self.artifact, self.seconds, self.fails = artifact, seconds, fails
        self.calls = 0

    def __call__(self, source: str, out: Path, revision: str | None = None) -> Path:
        self.calls += 1
        time.sleep(self.seconds)
        if self.fails:
            (out / "half").mkdir(parents=True)
            raise RuntimeError("the parity check failed")
        shutil.copytree(self.artifact, out)
        return out


@pytest.fixture()
def checkpoint(d3_checkpoint, tmp_path) -> Path:
    """A copy of the tiny checkpoint the test may change."""
    return Path(shutil.copytree(d3_checkpoint, tmp_path / "d3-tiny"))


def test_an_artifact_is_served_as_it_is(d3_artifact, tmp_path):
    assert servable(str(d3_artifact), tmp_path, export=CopyExporter(d3_artifact)) == d3_artifact
    assert not (tmp_path / "artifacts").exists()


def test_a_checkpoint_is_exported_once_then_served_from_the_cache(checkpoint, d3_artifact, tmp_path):
    export = CopyExporter(d3_artifact)
    first = servable(str(checkpoint), tmp_path / "cache", export=export)
    again = servable(str(checkpoint), tmp_path / "cache", export=export)
    assert first == again and export.calls == 1
    assert first.parent == tmp_path / "cache" / "artifacts" and first.name.startswith("d3-tiny-")
    assert (first / "manifest.json").is_file()
    assert [p.name for p in first.parent.iterdir() if not p.name.endswith(".lock")] == [first.name]


def test_a_changed_checkpoint_file_or_exporter_exports_again(checkpoint, d3_artifact, tmp_path, monkeypatch):
    export = CopyExporter(d3_artifact)
    first = servable(str(checkpoint), tmp_path, export=export)
    config = checkpoint / "decision_config.json"
    config.write_text(config.read_text() + "\n")
    changed = servable(str(checkpoint), tmp_path, export=export)
    monkeypatch.setattr(artifact_cache, "exporter_version", lambda: "0.2.0+other")
    newer = servable(str(checkpoint), tmp_path, export=export)
    assert len({first, changed, newer}) == 3 and export.calls == 3


def test_a_large_file_is_hashed_once_its_size_and_time_are_remembered(checkpoint, tmp_path):
    memo = tmp_path / "file-hashes.json"
    hashes = artifact_cache.checkpoint_hashes(checkpoint, memo)
    weights = next(name for name in hashes if name.endswith(".safetensors"))
    remembered = memo.read_text()
    real = str((checkpoint / weights).resolve())
    # Were the file read again, this made-up digest would not come back.
    memo.write_text(remembered.replace(hashes[weights], "f" * 64))
    assert artifact_cache.checkpoint_hashes(checkpoint, memo)[weights] == "f" * 64
    (checkpoint / weights).write_bytes((checkpoint / weights).read_bytes() + b"\0")
    assert artifact_cache.checkpoint_hashes(checkpoint, memo)[weights] not in ("f" * 64, hashes[weights])
    assert real in memo.read_text()


def test_concurrent_first_starts_export_once_and_see_a_whole_artifact(checkpoint, d3_artifact, tmp_path):
    export = CopyExporter(d3_artifact, seconds=1.0)
    found: list[Path] = []
    said: list[str] = []

    def start() -> None:
        found.append(servable(str(checkpoint), tmp_path, export=export, say=said.append))

    starts = [threading.Thread(target=start) for _ in range(3)]
    for thread in starts:
        thread.start()
    for thread in starts:
        thread.join(timeout=60)
    assert export.calls == 1 and len(found) == 3 and len(set(found)) == 1
    assert all((place / "manifest.json").is_file() for place in found)
    assert sum("waiting for it" in line for line in said) == 2
    leftovers = [p.name for p in (tmp_path / "artifacts").iterdir() if p.name.startswith(".") and p.is_dir()]
    assert leftovers == []


def test_a_failed_export_leaves_nothing_in_its_place(checkpoint, d3_artifact, tmp_path):
    with pytest.raises(RuntimeError, match="parity"):
        servable(str(checkpoint), tmp_path, export=CopyExporter(d3_artifact, fails=True))
    assert [p for p in (tmp_path / "artifacts").iterdir() if not p.name.endswith(".lock")] == []
    assert servable(str(checkpoint), tmp_path, export=CopyExporter(d3_artifact)).is_dir()


def test_a_directory_of_no_known_family_fails_before_an_export(tmp_path, d3_artifact):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"architectures": ["BertModel"]}')
    with pytest.raises(ValueError, match="is not a checkpoint of a known family"):
        servable(str(tmp_path / "model"), tmp_path / "cache", export=CopyExporter(d3_artifact))


def test_the_cache_is_under_xdg_cache_home_unless_told(tmp_path):
    assert default_cache_dir({"HOME": "/h"}) == Path.home() / ".cache" / "systemone"
    assert default_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/systemone")
    assert default_cache_dir({"XDG_CACHE_HOME": "/x", "SYSTEMONE_CACHE_DIR": str(tmp_path)}) == tmp_path


def test_serve_a_checkpoint_exports_on_the_first_start_and_not_the_second(checkpoint, d3_artifact, tmp_path,
                                                                          monkeypatch, capsys):
    from systemone.export import pipeline

    export = CopyExporter(d3_artifact)
    monkeypatch.setattr(pipeline, "export_checkpoint", export)
    monkeypatch.setattr(lifecycle, "run_server", lambda app, listener, stop, **kwargs: None)
    argv = ["serve", str(checkpoint), "--device", "cpu", "--port", "0", "--cache-dir", str(tmp_path)]
    assert cli.main(argv) == 0
    first = capsys.readouterr()
    assert cli.main(argv) == 0
    second = capsys.readouterr()
    assert export.calls == 1
    assert "exporting d3-tiny into the artifact cache" in first.err and "exporting" not in second.err
    artifact_line = next(line for line in second.out.splitlines() if line.startswith("systemone serve: artifact"))
    assert f" {tmp_path / 'artifacts'}/d3-tiny-" in artifact_line and "(family d3, source d3-tiny)" in artifact_line
    rows = [next(line for line in out.splitlines() if "batch rows" in line) for out in (first.out, second.out)]
    assert "measured now, kept in" in rows[0] and "kept from an earlier start" in rows[1]
    assert rows[0].split(";")[0] == rows[1].split(";")[0]
