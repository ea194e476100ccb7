"""A d3 request's images and videos, read once: fetched (concurrently), decoded, preprocessed and run through the
vision graph once each, whatever the number of questions (README decision 6; spec 4.8-4.10)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..models.request import DecisionRequest
from .image_transform import qwen_image
from .media_decode import decode_image
from .media_fetch import FetchPolicy, MediaError, fetch, read_each_once
from .media_prompt import MediaLayout
from .qwen_vision import vision_inputs
from .session import GraphSession
from .video import decode_video, qwen_video, timestamps

# vLLM's override of the checkpoint's image size for d3 (spec 4.9): 64 to 1,600 tokens.
IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS = 65_536, 1_638_400


@dataclass(frozen=True)
class EncodedMedia:
    layouts: list[MediaLayout]
    embeds: np.ndarray  # [tokens, hidden] float32, rows in placeholder order


class D3MediaEncoder:
    def __init__(self, session: GraphSession, vision: dict[str, Any], policy: FetchPolicy):
        self.session = session
        self.patch = int(vision["patch_size"])
        self.merge = int(vision["merge_size"])
        self.temporal = int(vision["temporal_patch_size"])
        self.side = int(vision["position_grid_side"])
        self.mean = tuple(vision["image_mean"])
        self.std = tuple(vision["image_std"])
        self.policy = policy

    def _image(self, url: str, where: str) -> tuple[np.ndarray, tuple[int, int, int], tuple[float, ...]]:
        """Pixel rows, grid (1, h, w), no timestamps."""
        rgb = decode_image(fetch(url, where, "image", self.policy), where)
        try:
            pixels, grid = qwen_image(rgb, self.patch, self.merge, self.temporal, self.mean, self.std,
                                      IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS)
        except ValueError as exc:
            raise MediaError(where, f"Failed to apply Qwen2VLImageProcessor: {exc}") from None
        return pixels, grid, ()

    def _video(self, url: str, where: str) -> tuple[np.ndarray, tuple[int, int, int], tuple[float, ...]]:
        """Pixel rows, grid (t, h, w), one timestamp per temporal group."""
        data = b"" if url[:16].lower().startswith("data:video/jpeg") else fetch(url, where, "video", self.policy)
        video = decode_video(data, where, url)
        try:
            pixels, grid = qwen_video(video.frames, self.patch, self.merge, self.temporal, self.mean, self.std)
        except ValueError as exc:
            raise MediaError(where, f"Failed to apply Qwen3VLVideoProcessor: {exc}") from None
        return pixels, grid, timestamps(video.indices, video.fps, self.temporal)

    def _segments(self, pixels: np.ndarray, grid: tuple[int, int, int], run_options: Any) -> np.ndarray:
        """Vision graph once per attention segment (an image, or one temporal group of a video)."""
        t, h, w = grid
        inputs = vision_inputs(h, w, self.side, self.merge)
        rows = h * w
        return np.concatenate([self.session.run({"pixel_values": pixels[g * rows:(g + 1) * rows], **inputs},
                                                run_options)[0] for g in range(t)])

    def encode(self, request: DecisionRequest, run_options: Any = None) -> EncodedMedia:
        """Every image, then every video, in request order: one fetch, one decode, one vision pass each."""
        jobs = [(("image", url), f"images[{i}]") for i, url in enumerate(request.images or ())]
        jobs += [(("video", url), f"videos[{i}]") for i, url in enumerate(request.videos or ())]
        read = {"image": self._image, "video": self._video}
        processed = read_each_once(jobs, lambda key, where: read[key[0]](key[1], where))
        # The same URL listed twice is read and encoded once; its rows fill both placeholders.
        encoded = {}
        for (kind, url), (pixels, (t, h, w), stamps) in processed.items():
            layout = MediaLayout(kind, ((h // self.merge, w // self.merge),) * t, stamps)
            encoded[kind, url] = layout, self._segments(pixels, (t, h, w), run_options)
        items = [encoded[key] for key, _ in jobs]
        return EncodedMedia([layout for layout, _ in items], np.concatenate([rows for _, rows in items], axis=0))
