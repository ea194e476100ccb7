"""The one place that names each model family: how to recognise its checkpoint, its prompt/read contract, its
runtime engine and its export config.

Engines and export configs are named by import path ("package.module:Class") and imported only when asked for,
as vLLM's model registry does: serving never imports the exporter (or torch), and this package imports neither.
Adding a family is one module set (contract, engine, export config) and one `FamilyEntry` here.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .d1 import D1Family
from .d3 import D3Family
from .family import Family


@dataclass(frozen=True)
class FamilyEntry:
    name: str
    contract: type[Family]
    engine: str  # "module:Class" of its runtime engine
    export_config: str | None  # "module:Class" of its export config; None for a family served from artifacts only
    recognises: Callable[[Mapping[str, Any], frozenset[str]], bool]  # (config.json, file names) -> is this family

    def load_engine(self) -> type:
        return load_object(self.engine)

    def load_export_config(self) -> type:
        if self.export_config is None:
            raise ValueError(f"family {self.name!r} has no export config")
        return load_object(self.export_config)


def load_object(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


class UnknownFamily(ValueError):
    pass


class FamilyRegistry:
    """Families by name; a registry is a value, so a test or an embedder can serve its own set."""

    def __init__(self, entries: tuple[FamilyEntry, ...]):
        self._entries = {entry.name: entry for entry in entries}

    def __iter__(self) -> Iterator[FamilyEntry]:
        return iter(self._entries.values())

    def with_family(self, entry: FamilyEntry) -> FamilyRegistry:
        return FamilyRegistry((*(e for e in self if e.name != entry.name), entry))

    def get(self, name: str) -> FamilyEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownFamily(f"unknown model family {name!r} (known: {', '.join(self._entries)})") from None

    def recognise(self, checkpoint: Path) -> FamilyEntry:
        """The family of a checkpoint directory, from its config.json and file names."""
        path = checkpoint / "config.json"
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        files = frozenset(p.name for p in checkpoint.iterdir()) if checkpoint.is_dir() else frozenset()
        for entry in self:
            if entry.recognises(config, files):
                return entry
        raise UnknownFamily(f"{checkpoint} is not a checkpoint of a known family: "
                            f"{'; '.join(f'{e.name}: {e.recognises.__doc__}' for e in self)}")


def _is_d3(config: Mapping[str, Any], files: frozenset[str]) -> bool:
    """config.json architectures == ['Qwen3_5Model'] and a decision_config.json (spec 4.1)"""
    return config.get("architectures") == ["Qwen3_5Model"] and "decision_config.json" in files


def _is_d1(config: Mapping[str, Any], files: frozenset[str]) -> bool:
    """config.json architectures == ['Lfm2VlForConditionalGeneration'] (spec 3)"""
    return config.get("architectures") == ["Lfm2VlForConditionalGeneration"]


FAMILIES = FamilyRegistry((
    FamilyEntry("d3", D3Family, "systemone.runtime.d3.engine:D3Engine", "systemone.export.d3.config:D3ExportConfig",
                _is_d3),
    FamilyEntry("d1", D1Family, "systemone.runtime.d1.engine:D1Engine", "systemone.export.d1.config:D1ExportConfig",
                _is_d1),
))
