"""Media placeholders expanded into token runs, and the 3-D M-RoPE positions of such a prompt (spec 4.8, 4.11).

A request's media are processed once; each image is one grid segment, each video one segment per temporal group
(two frames). The prompt holds one `<|image_pad|>` per image and one `<|video_pad|>` per video, inside the
template's `<|vision_start|>`...`<|vision_end|>`; expansion replaces the bare pad token (transformers >= 5.10, as
vLLM mirrors it), so a video reads `<|vision_start|>` + per group (timestamp text, `<|vision_start|>`, pads,
`<|vision_end|>`) + `<|vision_end|>`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"


@dataclass(frozen=True)
class MediaLayout:
    """One image or video as the language model sees it: merged grids (rows, cols) per segment, and for a video
    the timestamp (seconds) of each temporal group."""

    kind: str  # "image" or "video"
    grids: tuple[tuple[int, int], ...]
    timestamps: tuple[float, ...] = field(default=())


@dataclass(frozen=True)
class ExpandedPrefix:
    ids: list[int]
    media_positions: np.ndarray  # positions of every media token, in vision-graph row order
    segments: tuple[tuple[int, int, int], ...]  # (start index, rows, cols) of each grid run


def expand_media(prefix_ids: Sequence[int], media: Sequence[MediaLayout], encode: Callable[[str], list[int]],
                 token_id: Callable[[str], int | None]) -> ExpandedPrefix:
    """Replace each pad token of `prefix_ids` (images first, then videos, in request order) by its token run."""
    image_pad, video_pad = token_id(IMAGE_PAD), token_id(VIDEO_PAD)
    start, end = token_id(VISION_START), token_id(VISION_END)
    pending = {"image": [m for m in media if m.kind == "image"], "video": [m for m in media if m.kind == "video"]}
    ids: list[int] = []
    positions: list[int] = []
    segments: list[tuple[int, int, int]] = []

    def grid_run(pad: int, rows: int, cols: int) -> None:
        segments.append((len(ids), rows, cols))
        positions.extend(range(len(ids), len(ids) + rows * cols))
        ids.extend([pad] * (rows * cols))

    for token in prefix_ids:
        kind = "image" if token == image_pad else "video" if token == video_pad else None
        if kind is None:
            ids.append(token)
            continue
        if not pending[kind]:
            raise ValueError(f"the prompt has more {kind} placeholders than the request has {kind}s")
        item = pending[kind].pop(0)
        if kind == "image":
            grid_run(image_pad, *item.grids[0])
            continue
        for (rows, cols), seconds in zip(item.grids, item.timestamps):
            ids.extend(encode(f"<{seconds:.1f} seconds>"))
            ids.append(start)
            grid_run(video_pad, rows, cols)
            ids.append(end)
    if any(pending.values()):
        raise ValueError("the request has more media than the prompt has placeholders")
    return ExpandedPrefix(ids, np.asarray(positions, dtype=np.int64), tuple(segments))


def mrope_positions(length: int, segments: Sequence[tuple[int, int, int]]) -> np.ndarray:
    """[3, length] positions: text tokens (p, p, p); a grid starting at free position s gets (s, s + row,
    s + col); the next text position is one past the largest position so far (spec 4.11)."""
    out = np.zeros((3, length), dtype=np.int64)
    index, position = 0, 0
    for start, rows, cols in sorted(segments):
        run = start - index
        out[:, index:start] = np.arange(position, position + run)
        position += run
        r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
        out[0, start:start + rows * cols] = position
        out[1, start:start + rows * cols] = position + r.reshape(-1)
        out[2, start:start + rows * cols] = position + c.reshape(-1)
        position += max(rows, cols)
        index = start + rows * cols
    out[:, index:] = np.arange(position, position + length - index)
    return out
