"""A d3 request's images and videos, read once: fetched (concurrently), decoded, preprocessed and run through the
vision graph once each, whatever the number of questions (decision 6; spec 4.8-4.10)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...models.request import DecisionRequest
from ..deadline import Deadline
from ..image_transform import qwen_image
from ..media_allowance import MediaAllowance
from ..media_decode import decode_image
from ..media_encoder import MediaEncoder
from ..devices import CPU
from ..media_fetch import FetchPolicy, MediaError, fetch
from ..pixel_workers import PixelWorkers
from ..session import GraphSession
from .placeholders import MediaLayout
from .video import decode_video, qwen_video, timestamps
from .vision_inputs import vision_inputs

# Attention scores a vision run holds per head, over its segments (a segment with more runs alone): the portable
# graph materialises them, segments x (patches a segment)^2 floats a head. 2^23 is 0.5 GB at 16 heads in fp32: a
# video's ten frame groups of 720 patches (5.2 million) run together, a photo of 4,800 patches (23 million) alone.
MAX_RUN_SCORES = 1 << 23

# vLLM's override of the checkpoint's image size for d3 (spec 4.9): 64 to 1,600 tokens.
IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS = 65_536, 1_638_400


@dataclass(frozen=True)
class Preprocessed:
    """One image or video ready for the vision graph: pixel rows, grid (t, h, w) in patches, and for a video one
    timestamp per temporal group."""

    kind: str
    pixels: np.ndarray
    grid: tuple[int, int, int]
    timestamps: tuple[float, ...]


class D3MediaEncoder(MediaEncoder[Preprocessed]):
    """Images first, then videos, in request order (spec 4.8); an image is one vision segment, a video one per
    temporal group."""

    def __init__(self, session: GraphSession, vision: Mapping[str, Any], policy: FetchPolicy):
        super().__init__(session, policy)
        self.patch = int(vision["patch_size"])
        self.merge = int(vision["merge_size"])
        self.temporal = int(vision["temporal_patch_size"])
        self.side = int(vision["position_grid_side"])
        self.mean = tuple(vision["image_mean"])
        self.std = tuple(vision["image_std"])
        # Several segments a vision run where the graph takes them (exported since it had a `segments` input) and
        # on a GPU, where a small run's host side is the bound: the seeds' video's ten segments of 720 patches
        # took 31.9 ms in one run against 66.0 ms in ten at d3-nano on the H200 (docs/decisions/vision-runs.md). On the
        # CPU one run of the video's ten segments was slower than ten (tiny d3's portable graph on two cores, 38
        # against 21 ms, scripts/vision_runs.py): there each runs alone.
        self.segments_together = "segments" in session.input_names and session.provider != CPU

    def jobs(self, request: DecisionRequest) -> list[tuple[Hashable, str]]:
        jobs: list[tuple[Hashable, str]] = [(("image", url), f"images[{i}]")
                                            for i, url in enumerate(request.images or ())]
        return jobs + [(("video", url), f"videos[{i}]") for i, url in enumerate(request.videos or ())]

    def url(self, key: Hashable) -> str:
        return key[1]  # type: ignore[index]

    def load_one(self, key: Hashable, where: str, deadline: Deadline, allowance: MediaAllowance,
                 workers: PixelWorkers) -> Preprocessed:
        kind, url = key  # type: ignore[misc]
        if kind == "image":
            return self._image(url, where, deadline, allowance, workers)
        return self._video(url, where, deadline, allowance, workers)

    def _image(self, url: str, where: str, deadline: Deadline, allowance: MediaAllowance,
               workers: PixelWorkers) -> Preprocessed:
        data = fetch(url, where, "image", self.policy, deadline, allowance)
        rgb = decode_image(data, where, allowance=allowance)
        try:
            pixels, grid = qwen_image(rgb, self.patch, self.merge, self.temporal, self.mean, self.std,
                                      IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS, workers, deadline)
        except ValueError as exc:
            raise MediaError(where, f"Failed to apply Qwen2VLImageProcessor: {exc}") from None
        return Preprocessed("image", pixels, grid, ())

    def _video(self, url: str, where: str, deadline: Deadline, allowance: MediaAllowance,
               workers: PixelWorkers) -> Preprocessed:
        data = (b"" if url[:16].lower().startswith("data:video/jpeg")
                else fetch(url, where, "video", self.policy, deadline, allowance))
        video = decode_video(data, where, url, allowance, deadline, workers.threads)
        try:
            pixels, grid = qwen_video(video.frames, self.patch, self.merge, self.temporal, self.mean, self.std,
                                      workers, deadline)
        except ValueError as exc:
            raise MediaError(where, f"Failed to apply Qwen3VLVideoProcessor: {exc}") from None
        return Preprocessed("video", pixels, grid, timestamps(video.indices, video.fps, self.temporal))

    def layout(self, item: Preprocessed) -> MediaLayout:
        t, h, w = item.grid
        return MediaLayout(item.kind, ((h // self.merge, w // self.merge),) * t, item.timestamps)

    def rows(self, item: Preprocessed, run_options: Any) -> np.ndarray:
        return self.rows_many([item], run_options)[0]

    def rows_many(self, items: list[Preprocessed], run_options: Any) -> list[np.ndarray]:
        """Vision rows of each item: its attention segments (an image, or each frame group of a video) run with
        every other segment of their grid, of any item, up to MAX_RUN_SCORES a run. A segment attends only to its
        own patches, so its rows do not depend on its run mates. Without `segments_together` each runs alone."""
        together = self.segments_together
        by_grid: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (h, w) -> (item, frame group)
        for i, item in enumerate(items):
            t, h, w = item.grid
            by_grid.setdefault((h, w), []).extend((i, g) for g in range(t))
        out: dict[tuple[int, int], np.ndarray] = {}
        for (h, w), members in by_grid.items():
            n = h * w
            per_run = max(1, MAX_RUN_SCORES // (n * n)) if together else 1
            for start in range(0, len(members), per_run):
                run = members[start:start + per_run]
                feeds = {"pixel_values": _segments_pixels(items, run, n),
                         **vision_inputs(h, w, self.side, self.merge, len(run))}
                if "segments" not in self.session.input_names:  # a graph exported before runs took several
                    del feeds["segments"]
                rows = self.session.run(feeds, run_options)[0]
                for member, segment_rows in zip(run, np.split(rows, len(run))):
                    out[member] = segment_rows
        return [np.concatenate([out[i, g] for g in range(item.grid[0])]) for i, item in enumerate(items)]


def _segments_pixels(items: list[Preprocessed], run: list[tuple[int, int]], n: int) -> np.ndarray:
    """The pixel rows of a run's segments, one after the other: a slice where they are consecutive frame groups of
    one item (a video alone: no copy), else a concatenation."""
    first_item, first_group = run[0]
    if all(member == (first_item, first_group + k) for k, member in enumerate(run)):
        return items[first_item].pixels[first_group * n:(first_group + len(run)) * n]
    return np.concatenate([items[i].pixels[g * n:(g + 1) * n] for i, g in run])
