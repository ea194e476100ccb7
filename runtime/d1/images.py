"""A d1 request's images, read once: fetched (concurrently), decoded, capped at 1,048,576 pixels, cut into LFM2-VL
crops and run through the vision graph once each, whatever the number of questions (decision 6; spec 3.8).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from ...models.errors import DecisionError
from ...models.request import DecisionRequest
from ..batch import MediaRows
from ..deadline import Deadline
from ..media_allowance import MediaAllowance
from ..media_decode import decode_image
from ..media_encoder import MediaEncoder
from ..media_fetch import FetchPolicy, fetch
from ..pixel_workers import PixelWorkers
from ..session import GraphSession
from .cells import unshuffle_order
from .image_processor import Lfm2Image, Lfm2ImageConfig, cap_pixels, lfm2_image
from .siglip_positions import siglip_positions

# Vision attention memory grows with crops x patches^2: crops of one grid (of one image or of several requests'
# images) run in groups of at most this many. A crop has at most 1,024 patches (the processor's 256 tokens of 2 x 2
# patches), so at SigLIP2's 16 heads a run's fp32 scores and probabilities stay under 1.1 GB; a 1024x1024 image
# (4 tiles and a thumbnail) is one run, where groups of 4 made it two.
MAX_CROPS_PER_RUN = 8


class D1ImageEncoder(MediaEncoder[Lfm2Image]):
    def __init__(self, session: GraphSession, config: Lfm2ImageConfig, position_table: np.ndarray,
                 policy: FetchPolicy):
        super().__init__(session, policy)
        self.config = config
        self.table = position_table
        self.positions = lru_cache(maxsize=64)(self._positions)

    def _positions(self, height: int, width: int) -> np.ndarray:
        """The position table resized to a crop grid, in the graph's unshuffle order."""
        order = unshuffle_order(height, width, self.config.downsample_factor)
        return np.ascontiguousarray(siglip_positions(self.table, height, width)[order])

    def jobs(self, request: DecisionRequest) -> list[tuple[Hashable, str]]:
        return [(url, f"images[{i}]") for i, url in enumerate(request.images or ())]

    def load_one(self, key: Hashable, where: str, deadline: Deadline, allowance: MediaAllowance,
                 workers: PixelWorkers) -> Lfm2Image:
        data = fetch(str(key), where, "image", self.policy, deadline, allowance)
        rgb = decode_image(data, where, allowance=allowance)
        capped = cap_pixels(rgb)
        try:
            # The resizes and patches in the pixel workers: in threads here, the GIL held them back (the H200's
            # d1 mix at 8 clients: a photo's loading went from 0.14 s alone to 0.4-1.5 s; docs/decisions/pixel-work.md).
            image = lfm2_image(capped, self.config, workers, deadline)
        except ValueError as exc:
            raise DecisionError(f"Failed to apply Lfm2VlProcessor on {where}: {exc}") from None
        # Each crop grid's position table is made here, in the media pool, and not when the vision graph runs, on
        # the GPU's lane: a grid not seen before (a new image size) took 37.7 ms at d1-3B's width on the H200's host
        # (twenty-third run), and every other request's vision work waited on it.
        for grid in {crop.grid for crop in image.crops}:
            self.positions(*grid)
        return image

    def rows(self, image: Lfm2Image, run_options: Any) -> np.ndarray:
        """Vision rows of one image: its crops' rows in crop order (tiles row-major, then the thumbnail)."""
        return self.rows_many([image], run_options)[0]

    def rows_many(self, images: list[Lfm2Image], run_options: Any) -> list[np.ndarray]:
        """Vision rows of each image: crops of one grid run together, whichever image they belong to, at most
        MAX_CROPS_PER_RUN at a time (each crop attends only to its own patches, so its rows do not depend on its
        run mates)."""
        out: dict[tuple[int, int], np.ndarray] = {}  # by (image, crop)
        by_grid: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for n, image in enumerate(images):
            for i, crop in enumerate(image.crops):
                by_grid.setdefault(crop.grid, []).append((n, i))
        for grid, members in by_grid.items():
            cells = grid[0] * grid[1] // self.config.downsample_factor**2
            for start in range(0, len(members), MAX_CROPS_PER_RUN):
                group = members[start:start + MAX_CROPS_PER_RUN]
                patches = _crop_patches(images, group)
                (rows,) = self.session.run({"patches": patches, "positions": self.positions(*grid)}, run_options)
                for k, member in enumerate(group):
                    out[member] = rows[k * cells:(k + 1) * cells]
        return [np.concatenate([out[n, i] for i in range(len(image.crops))]) for n, image in enumerate(images)]


def _crop_patches(images: list[Lfm2Image], group: list[tuple[int, int]]) -> np.ndarray:
    """The patches of the crops `group` ((image, crop) pairs, all of one grid) as one [crops, patches, width] array:
    consecutive crops of one image (a 1024x1024 image's four tiles and thumbnail) as a view of that image's patches,
    which the processor wrote in the graph's order; others copied together. Gathering a 1024x1024 image's crops into
    the graph's order here took 3.9 ms on the H200's host (docs/decisions/vision-runs.md), on the engine thread."""
    n, first = group[0]
    if all(member == (n, first + k) for k, member in enumerate(group)):
        return images[n].consecutive(first, len(group))
    return np.stack([images[m].crops[i].patches for m, i in group])


def expand_images(ids: list[int], image_token_id: int, placeholders: Sequence[Sequence[int]]) -> list[int]:
    """Each `<image>` token of a prompt replaced by its image's placeholder ids (spec 3.4, 3.8 step 4); `ids` holds
    one `<image>` a placeholder (the caller checked). Found by `list.index` and spliced: a Python loop over every
    token took 1.8 ms for the bench's 16 prompts of 2,200 tokens on two cores."""
    out: list[int] = []
    start = 0
    for placeholder in placeholders:
        at = ids.index(image_token_id, start)
        out += ids[start:at]
        out += placeholder
        start = at + 1
    out += ids[start:]
    return out


def media_rows(ids: list[int], image_token_id: int, embeds: np.ndarray) -> MediaRows:
    """The vision rows at the image-token positions of an expanded prompt."""
    positions = np.flatnonzero(np.asarray(ids) == image_token_id).astype(np.int64)
    if len(positions) != len(embeds):
        raise RuntimeError(f"{len(positions)} image tokens for {len(embeds)} vision rows")
    return MediaRows(embeds, positions)

