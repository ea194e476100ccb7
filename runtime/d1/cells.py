"""Patch order for the d1 vision graph: the LFM2-VL projector's pixel unshuffle as a permutation (spec 3.8 step 5).

The projector's output cell (r, c) concatenates patches (2r+dh, 2c+dw), dh major; cells are row-major. Feeding the
vision graph its patches (and positions) in that order lets the graph do the unshuffle as a reshape.
"""

from __future__ import annotations

import numpy as np


def unshuffle_order(height: int, width: int, factor: int = 2) -> np.ndarray:
    """Indices into a row-major [height * width] patch grid, grouped `factor**2` per projector cell."""
    if height % factor or width % factor:
        raise ValueError(f"a {height}x{width} patch grid does not split into {factor}x{factor} cells")
    grid = np.arange(height * width, dtype=np.int64).reshape(height // factor, factor, width // factor, factor)
    return grid.transpose(0, 2, 1, 3).reshape(-1)
