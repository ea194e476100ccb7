"""Weights a graph reads from the checkpoint's own safetensors files (`systemone export --weights link`), made in the
dtype the graph declares when its session opens.

A linked weight is a run of rows of one checkpoint tensor (the whole tensor, or one piece of a split along its
first axis), read as stored (bf16, fp16 or fp32), converted to fp16 as onnxruntime's converter converts a weight
(or to fp32), and transposed where the graph reads it so. The graph's initializer declares the weight's dtype and
shape with the external-data location `LINKED`; `GraphSession` hands onnxruntime the values by name
(`SessionOptions.add_external_initializers`). The checkpoint files are hard links inside the artifact
(`linked/`): the artifact takes no disk for them and keeps them if the checkpoint directory is removed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

LINKED = "<linked>"  # the external-data location of a linked initializer: never a file onnxruntime opens
LINKS_SUFFIX = ".links.json"  # beside a graph file: its linked initializers
LINKED_DIR = "linked"  # the artifact's folder of hard links to the checkpoint's files
# fp16's smallest positive subnormal and largest finite value: what onnxruntime's float16 converter clamps a weight
# into (0, inf and NaN kept), so that a weight is never rounded to zero or to infinity.
FP16_MIN_POSITIVE, FP16_MAX = 5.96e-08, 65504.0
_STORED = {"BF16": 2, "F16": 2, "F32": 4}
_ROWS_AT_ONCE_BYTES = 64 << 20  # a thread converts this much of a weight at a time: its temporaries stay small


class LinkError(ValueError):
    pass


@dataclass(frozen=True)
class LinkedWeight:
    """Initializer `name`: `shape` rows of `file` (under the artifact's root) from byte `offset`, stored as `stored`
    (a safetensors dtype), made `dtype` (`float16` or `float32`), transposed (2-D) when `transpose`."""

    name: str
    file: str
    offset: int
    stored: str
    shape: tuple[int, ...]  # as stored (the piece of the tensor), before any transpose
    dtype: str
    transpose: bool = False

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * _STORED[self.stored]

    @property
    def graph_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape)) if self.transpose else self.shape


def links_path(graph: Path) -> Path:
    return graph.with_name(graph.name + LINKS_SUFFIX)


def write_links(graph: Path, links: Sequence[LinkedWeight]) -> None:
    links_path(graph).write_text(json.dumps([asdict(link) for link in links], indent=1) + "\n", encoding="utf-8")


def read_links(graph: Path) -> list[LinkedWeight]:
    """The linked initializers of the graph at `graph` (none when it has no links file)."""
    path = links_path(graph)
    if not path.is_file():
        return []
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
        links = [LinkedWeight(**{**entry, "shape": tuple(entry["shape"])}) for entry in entries]
    except (ValueError, TypeError, KeyError) as exc:
        raise LinkError(f"{path.name} is not a list of linked weights ({exc}); export again") from exc
    for link in links:
        if link.stored not in _STORED or link.dtype not in ("float16", "float32") or \
                (link.transpose and len(link.shape) != 2):
            raise LinkError(f"{path.name}: weight {link.name!r} is {link.stored} -> {link.dtype}"
                            f"{' transposed' if link.transpose else ''} at {list(link.shape)}, which this runtime "
                            "does not make; export again")
    return links


def to_float16(values: np.ndarray) -> np.ndarray:
    """fp32 `values` in fp16 as onnxruntime's converter writes a weight (`convert_np_to_float16`): finite
    magnitudes above fp16's largest lowered to it, nonzero magnitudes the rounding would make zero raised to its
    smallest positive value, signs kept, infinities and NaN kept."""
    big = np.isfinite(values) & (np.abs(values) > FP16_MAX)
    if big.any():
        values = np.where(big, np.copysign(np.float32(FP16_MAX), values), values)
    with np.errstate(over="ignore"):
        half = values.astype(np.float16)
    lost = (half == 0) & (values != 0)
    if lost.any():
        half[lost] = np.copysign(np.float16(FP16_MIN_POSITIVE), values[lost])
    return half


def _as_float32(raw: np.ndarray, stored: str) -> np.ndarray:
    if stored == "BF16":  # bf16 is fp32's upper half: exact
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return raw.view(np.float16 if stored == "F16" else np.float32).astype(np.float32, copy=False)


def make_weight(link: LinkedWeight, root: Path) -> np.ndarray:
    """The values of `link`, C-contiguous, in its graph's dtype and shape."""
    path = root / link.file
    rows = link.shape[0] if link.shape else 1
    row_bytes = link.nbytes // max(rows, 1)
    raw = np.empty(link.nbytes, dtype=np.uint8)
    with open(path, "rb") as f:
        f.seek(link.offset)
        if f.readinto(memoryview(raw)) != link.nbytes:
            raise LinkError(f"{path}: weight {link.name!r} runs past the end of the file; export again")
    out = np.empty(link.shape, dtype=np.float16 if link.dtype == "float16" else np.float32)
    flat_out = out.reshape(rows, -1)
    step = max(1, _ROWS_AT_ONCE_BYTES // max(row_bytes, 1))
    for start in range(0, rows, step):
        part = _as_float32(raw[start * row_bytes:(start + step) * row_bytes], link.stored)
        flat_out[start:start + step] = (to_float16(part) if link.dtype == "float16" else part).reshape(
            flat_out[start:start + step].shape)
    del raw
    return np.ascontiguousarray(out.T) if link.transpose else out


def make_weights(links: Sequence[LinkedWeight], root: Path, threads: int | None = None) -> list[np.ndarray]:
    """Every linked weight's values (`make_weight`), several at once: numpy lets go of the GIL in its loops."""
    if not links:
        return []
    with ThreadPoolExecutor(max(1, threads or min(16, os.cpu_count() or 1))) as pool:
        return list(pool.map(lambda link: make_weight(link, root), links))
