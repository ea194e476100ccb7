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
from ..media_fetch import FetchPolicy, MediaError, fetch
from ..pixel_workers import PixelWorkers
from ..session import GraphSession
from .placeholders import MediaLayout
from .video import decode_video, qwen_video, timestamps
from .vision_inputs import vision_inputs

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

    def jobs(self, request: DecisionRequest) -> list[tuple[Hashable, str]]:
        jobs: list[tuple[Hashable, str]] = [(("image", url), f"images[{i}]")
                                            for i, url in enumerate(request.images or ())]
        return jobs + [(("video", url), f"videos[{i}]") for i, url in enumerate(request.videos or ())]

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
        """Vision graph once per attention segment (an image, or one temporal group of a video)."""
        t, h, w = item.grid
        inputs = vision_inputs(h, w, self.side, self.merge)
        n = h * w
        return np.concatenate([self.session.run({"pixel_values": item.pixels[g * n:(g + 1) * n], **inputs},
                                                run_options)[0] for g in range(t)])
