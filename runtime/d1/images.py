"""A d1 request's images, read once: fetched (concurrently), decoded, capped at 1,048,576 pixels, cut into LFM2-VL
crops and run through the vision graph once each, whatever the number of questions (README decision 6; spec 3.8).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

import numpy as np
from PIL import Image

from ..models.errors import DecisionError
from ..models.request import DecisionRequest
from .d1_text import MediaRows
from .lfm2_cells import unshuffle_order
from .lfm2_image import Lfm2Image, Lfm2ImageConfig, cap_pixels, lfm2_image, placeholder_text
from .media_decode import decode_image
from .media_fetch import FetchPolicy, fetch, read_each_once
from .session import GraphSession
from .siglip_positions import siglip_positions

MAX_CROPS_PER_RUN = 4  # vision attention memory grows with crops x patches^2; tiles run in groups of this many


@dataclass(frozen=True)
class EncodedImages:
    """Each image's placeholder token ids (replacing its `<image>` in the prompt) and the vision rows of all
    images in prompt order (each image: tiles row-major, then the thumbnail)."""

    placeholders: list[list[int]]
    embeds: np.ndarray  # [rows, hidden] float32


class D1MediaEncoder:
    def __init__(self, session: GraphSession, config: Lfm2ImageConfig, position_table: np.ndarray,
                 encode: Callable[[str], list[int]], policy: FetchPolicy):
        self.session = session
        self.config = config
        self.table = position_table
        self.encode_text = encode
        self.policy = policy
        self.positions = lru_cache(maxsize=64)(self._positions)

    def _positions(self, height: int, width: int) -> np.ndarray:
        """The position table resized to a crop grid, in the graph's unshuffle order."""
        order = unshuffle_order(height, width, self.config.downsample_factor)
        return np.ascontiguousarray(siglip_positions(self.table, height, width)[order])

    def _image(self, url: str, where: str) -> Lfm2Image:
        rgb = decode_image(fetch(url, where, "image", self.policy), where)
        capped = np.asarray(cap_pixels(Image.fromarray(rgb)), dtype=np.uint8)
        try:
            return lfm2_image(capped, self.config)
        except ValueError as exc:
            raise DecisionError(f"Failed to apply Lfm2VlProcessor on {where}: {exc}") from None

    def _rows(self, image: Lfm2Image, run_options: Any) -> np.ndarray:
        """Vision rows of one image: crops of one grid run together (at most MAX_CROPS_PER_RUN at a time)."""
        out: list[np.ndarray | None] = [None] * len(image.crops)
        by_grid: dict[tuple[int, int], list[int]] = {}
        for i, crop in enumerate(image.crops):
            by_grid.setdefault(crop.grid, []).append(i)
        for grid, members in by_grid.items():
            order = unshuffle_order(*grid, self.config.downsample_factor)
            cells = len(order) // self.config.downsample_factor**2
            for start in range(0, len(members), MAX_CROPS_PER_RUN):
                group = members[start:start + MAX_CROPS_PER_RUN]
                patches = np.stack([image.crops[i].patches[order] for i in group])
                (rows,) = self.session.run({"patches": patches, "positions": self.positions(*grid)}, run_options)
                for k, i in enumerate(group):
                    out[i] = rows[k * cells:(k + 1) * cells]
        return np.concatenate(out)

    def encode(self, request: DecisionRequest, run_options: Any = None) -> EncodedImages:
        """Every image in request order; the same URL twice is fetched, decoded and encoded once."""
        urls = list(request.images or ())
        images = read_each_once([(url, f"images[{i}]") for i, url in enumerate(urls)], self._image)
        encoded = {url: (self.encode_text(placeholder_text(img)), self._rows(img, run_options))
                   for url, img in images.items()}
        return EncodedImages([encoded[url][0] for url in urls],
                             np.concatenate([encoded[url][1] for url in urls]).astype(np.float32))


def expand_images(ids: list[int], image_token_id: int, images: EncodedImages) -> list[int]:
    """Each `<image>` token of a prompt replaced by its image's placeholder ids (spec 3.4, 3.8 step 4)."""
    out: list[int] = []
    k = 0
    for token in ids:
        if token == image_token_id:
            out += images.placeholders[k]
            k += 1
        else:
            out.append(token)
    return out


def media_rows(ids: list[int], image_token_id: int, images: EncodedImages) -> MediaRows:
    positions = np.flatnonzero(np.asarray(ids) == image_token_id).astype(np.int64)
    if len(positions) != len(images.embeds):
        raise RuntimeError(f"{len(positions)} image tokens for {len(images.embeds)} vision rows")
    return MediaRows(images.embeds, positions)
