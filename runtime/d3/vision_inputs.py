"""The grid-derived inputs of the Qwen3.5 vision graph, in numpy (no torch at serve time).

For a segment of h x w patches (one image, or one frame group of a video), patches are in merge-block order:
2 x 2 blocks in raster order, raster order inside a block (spec 4.9). Each patch gets the bilinear taps of the
learned square position table (align_corners=True) and its (row, column) rotary position.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


def merge_block_order(h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column of every patch, in merge-block order."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    return (rows.reshape(shape).transpose(0, 2, 1, 3).reshape(-1),
            cols.reshape(shape).transpose(0, 2, 1, 3).reshape(-1))


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    taps = floor.astype(np.int64)[:, None] + np.arange(2)
    weights = np.clip(1 - np.abs(src[:, None] - floor[:, None] - np.arange(2, dtype=np.float32)), 0, None)
    return np.clip(taps, 0, side - 1), weights.astype(np.float32)


@lru_cache(maxsize=64)
def _segment(h: int, w: int, side: int, merge: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows, cols = merge_block_order(h, w, merge)
    row_taps, row_weights = _axis_taps(rows, h, side)
    col_taps, col_weights = _axis_taps(cols, w, side)
    index = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
    weight = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4)
    arrays = (index.astype(np.int64), weight.astype(np.float32), np.stack([rows, cols], axis=-1).astype(np.int64))
    for array in arrays:
        array.flags.writeable = False  # shared by every run of the grid
    return arrays


def vision_inputs(h: int, w: int, side: int, merge: int, segments: int = 1) -> dict[str, np.ndarray]:
    """interp_index [n, 4], interp_weight [n, 4], rotary_pos [n, 2] for `segments` h x w segments one after the
    other (each its own positions), and `segments` [S], whose length tells the graph their count."""
    index, weight, positions = _segment(h, w, side, merge)
    return {"interp_index": np.tile(index, (segments, 1)), "interp_weight": np.tile(weight, (segments, 1)),
            "rotary_pos": np.tile(positions, (segments, 1)), "segments": np.zeros(segments, dtype=np.int64)}
