"""The rows a text-graph call takes, measured at the first start of an artifact on a machine and kept in the cache,
so every later start (and `doctor`) of the same artifact with the same settings on the same machine uses the same
choice (docs/decisions/batch-rows.md). `--max-batch-rows` sets it outright; deleting the kept file measures again."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

from .artifact_cache import write_atomically
from .runtime.batch_sizing import BatchSizing

KEPT_DIR = "batch-rows"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def choice_key(service: Any, gpu_memory: int | None) -> dict[str, Any]:
    """What the choice depends on: the artifact (its manifest's bytes), the machine, the provider and form, and the
    settings that bound the calls measured."""
    engine = service.engine
    budget = engine.budget
    return {"manifest": hashlib.sha256((service.artifact.root / "manifest.json").read_bytes()).hexdigest(),
            "host": platform.node(), "cpu": _cpu_model(), "cores": os.cpu_count(),
            "provider": service.provider, "form": service.form, "max_model_len": engine.max_model_len,
            "max_batch_tokens": budget.max_batch_tokens if budget is not None else None,
            "captured_rows": engine.captured_rows if budget is not None else None, "gpu_memory": gpu_memory}


def kept_file(service: Any, cache_dir: Path, gpu_memory: int | None = None) -> Path:
    key = json.dumps(choice_key(service, gpu_memory), sort_keys=True)
    return cache_dir / KEPT_DIR / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def kept_batch_sizing(service: Any, cache_dir: Path, gpu_memory: int | None = None) -> tuple[BatchSizing, Path, bool]:
    """`service`'s rows a call: the one kept for it on this machine, else measured now and kept. Returns the
    sizing, the file that keeps it, and whether it was measured now."""
    path = kept_file(service, cache_dir, gpu_memory)
    try:
        sizing = BatchSizing.from_dict(json.loads(path.read_text(encoding="utf-8"))["sizing"])
    except (OSError, ValueError, KeyError, TypeError):
        sizing = service.batch_sizing()
        write_atomically(path, json.dumps({"key": choice_key(service, gpu_memory), "sizing": sizing.to_dict()},
                                           indent=1))
        return sizing, path, True
    service.adopt_batch_sizing(sizing)
    return sizing, path, False
