"""Image preprocessing without torch (spec 4.9; appendix D 12): equal, bit for bit, to transformers'
Qwen2VLImageProcessor on its torchvision backend as vLLM configures it (fixture made by
scripts/vision_fixtures.py), with the spec's token counts."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from tests.vision_fixtures import FIXTURE, MAX_PIXELS, MEAN, MIN_PIXELS, SIZES, STD, fixture_image
from systemone.runtime.image_transform import qwen_image, smart_resize

REFERENCE = np.load(FIXTURE)


@pytest.mark.parametrize("name", list(SIZES))
def test_pixel_values_equal_the_torchvision_processor(name):
    pixels, grid = qwen_image(fixture_image(name), 16, 2, 2, MEAN, STD, MIN_PIXELS, MAX_PIXELS)
    assert list(grid) == REFERENCE[f"{name}/grid_thw"].tolist()
    assert np.abs(pixels[:64] - REFERENCE[f"{name}/head"]).max() == 0.0
    assert np.abs(pixels.sum(axis=1) - REFERENCE[f"{name}/row_sums"]).max() == 0.0
    assert hashlib.sha256(pixels.astype(np.float32).tobytes()).digest() == REFERENCE[f"{name}/sha256"].tobytes()


@pytest.mark.parametrize("size, resized, tokens", [((1920, 1080), (1696, 960), 1590), ((640, 480), (640, 480), 300),
                                                   ((100, 100), (256, 256), 64), ((4000, 3000), (1472, 1088), 1564)])
def test_spec_token_counts(size, resized, tokens):
    """Spec 4.9 examples: smart resize with factor 32 within 65,536..1,638,400 pixels."""
    width, height = size
    h_bar, w_bar = smart_resize(height, width, 32, MIN_PIXELS, MAX_PIXELS)
    assert (w_bar, h_bar) == resized and (h_bar // 32) * (w_bar // 32) == tokens


def test_smart_resize_rounds_half_to_even():
    """Spec 2.6: Python's round (48/32 = 1.5 -> 2, 80/32 = 2.5 -> 2) decides the grid."""
    assert smart_resize(48 * 8, 80 * 8, 32, 32 * 32, 10**9) == (384, 640)
    assert smart_resize(48, 80, 32, 32 * 32, 10**9) == (64, 64)


def test_extreme_aspect_ratio_is_refused():
    with pytest.raises(ValueError, match="absolute aspect ratio must be smaller than 200"):
        smart_resize(10, 2010, 32, MIN_PIXELS, MAX_PIXELS)
