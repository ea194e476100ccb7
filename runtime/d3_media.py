"""A d3 request's images, read once: fetched (concurrently), decoded, preprocessed and run through the vision
graph once each, whatever the number of questions (README decision 6; spec 4.8, 4.9)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..models.request import DecisionRequest
from .image_transform import qwen_image
from .media_decode import decode_image
from .media_fetch import FetchPolicy, MediaError, fetch
from .media_prompt import MediaLayout
from .qwen_vision import vision_inputs
from .session import GraphSession

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

    def _image_rows(self, url: str, where: str) -> tuple[np.ndarray, tuple[int, int, int]]:
        rgb = decode_image(fetch(url, where, "image", self.policy), where)
        try:
            return qwen_image(rgb, self.patch, self.merge, self.temporal, self.mean, self.std, IMAGE_MIN_PIXELS,
                              IMAGE_MAX_PIXELS)
        except ValueError as exc:
            raise MediaError(where, f"Failed to apply Qwen2VLImageProcessor: {exc}") from None

    def encode(self, request: DecisionRequest, run_options: Any = None) -> EncodedMedia:
        """Every image of the request, in request order: one fetch, one decode, one vision-graph run each."""
        urls = [(url, f"images[{i}]") for i, url in enumerate(request.images or ())]
        with ThreadPoolExecutor(max_workers=min(8, max(1, len(urls)))) as pool:
            processed = list(pool.map(lambda item: self._image_rows(*item), urls))
        layouts, embeds = [], []
        for pixels, (_, h, w) in processed:
            feeds = {"pixel_values": pixels, **vision_inputs(h, w, self.side, self.merge)}
            embeds.append(self.session.run(feeds, run_options)[0])
            layouts.append(MediaLayout("image", ((h // self.merge, w // self.merge),)))
        return EncodedMedia(layouts, np.concatenate(embeds, axis=0))
