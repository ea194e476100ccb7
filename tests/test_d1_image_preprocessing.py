"""d1 image preprocessing without torch (spec 3.8): the pixel cap, transformers' Lfm2VlImageProcessor (class
defaults, torchvision backend) bit for bit (fixture made by scripts/lfm2_vision_fixtures.py), the placeholder text,
and the SigLIP2 position-embedding resize against torch's F.interpolate."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from tests.lfm2_vision_fixtures import FIXTURE, RESIZE_CASES, SIZES, decode_crop, fixture_image, resize_case
from systemone.runtime.d1.cells import unshuffle_order
from systemone.runtime.d1.image_processor import (Lfm2ImageConfig, cap_pixels, grid_layout, lfm2_image,
                                                  placeholder_text, smart_size)
from systemone.runtime.d1.siglip_positions import siglip_positions
from systemone.runtime.image_transform import resize_bicubic, resize_bilinear

REFERENCE = np.load(FIXTURE)
CONFIG = Lfm2ImageConfig()


def _reference_patches(stored: np.ndarray, patch: int = 16) -> np.ndarray:
    """A stored crop (uint8 image, W-differences) -> the processor's float32 rows, written out independently of
    the runtime: patches row-major, each flattened (row, col, channel), values (u - 127.5) / 127.5."""
    image = decode_crop(stored)
    height, width = image.shape[:2]
    rows = image.reshape(height // patch, patch, width // patch, patch, 3).transpose(0, 2, 1, 3, 4)
    codes = rows.reshape(-1, patch * patch * 3).astype(np.float32)
    return (codes - np.float32(127.5)) / np.float32(127.5)


@pytest.fixture(scope="module", params=list(SIZES))
def processed(request):
    return request.param, lfm2_image(fixture_image(request.param), CONFIG)


def test_crops_equal_the_torchvision_processor(processed):
    """Spec 3.8 step 3: tiles resized from the original image and split row-major, then the thumbnail (or one
    crop), bilinear antialiased, rescale/normalize fused, 16x16 patches flattened (row, col, channel): equal to
    transformers' pixel_values without padding, bit for bit, once put back row-major."""
    name, image = processed
    shapes = REFERENCE[f"{name}/spatial_shapes"]
    assert [crop.grid for crop in image.crops] == [tuple(s) for s in shapes.tolist()]
    digest = hashlib.sha256()
    for j, crop in enumerate(image.crops):
        expected = _reference_patches(REFERENCE[f"{name}/crop{j}"])
        assert crop.patches.dtype == np.float32 and crop.patches.shape == expected.shape
        assert np.abs(crop.row_major() - expected).max() == 0.0, f"{name} crop {j}"
        digest.update(crop.row_major().tobytes())
    assert digest.digest() == REFERENCE[f"{name}/sha256"].tobytes()


def test_patches_are_written_in_the_vision_graphs_order(processed):
    """The processor writes each crop's patches as the vision graph reads them (spec 3.8 step 5: a projector cell's
    2x2 patches together, cells row-major), so one image's crops of a grid go to the graph as one view of its array,
    never gathered on the engine thread."""
    name, image = processed
    start = 0
    for j, crop in enumerate(image.crops):
        expected = _reference_patches(REFERENCE[f"{name}/crop{j}"])
        assert np.array_equal(crop.patches, expected[unshuffle_order(*crop.grid)]), f"{name} crop {j}"
        assert np.shares_memory(crop.patches, image.patches)
        np.testing.assert_array_equal(image.consecutive(j, 1)[0], crop.patches)
        start += len(crop.patches)
    assert start == len(image.patches)
    same_grid = [j for j, c in enumerate(image.crops) if c.grid == image.crops[0].grid]
    run = image.consecutive(0, len(same_grid))
    assert run.base is not None and np.shares_memory(run, image.patches)
    assert all(np.array_equal(run[k], image.crops[j].patches) for k, j in enumerate(same_grid))


def test_grid_and_placeholder_equal_the_processor(processed):
    """Spec 3.8 steps 3-4: rows/cols of the tile grid, the smart size (image_sizes) and the replacement text
    (`<|image_start|>`, per tile `<|img_row_r_col_c|>` + 256 `<image>`, `<|img_thumbnail|>` + thumbnail tokens,
    `<|image_end|>`) are transformers' own."""
    name, image = processed
    width, height = SIZES[name]
    assert (image.rows, image.cols) == (int(REFERENCE[f"{name}/rows"]), int(REFERENCE[f"{name}/cols"]))
    assert list(smart_size(height, width, CONFIG)) == REFERENCE[f"{name}/image_size"].tolist()
    expected = str(REFERENCE[f"{name}/placeholder"])
    assert placeholder_text(image) == expected
    assert image.image_tokens == expected.count("<image>")


@pytest.mark.parametrize("case", range(RESIZE_CASES))
def test_resize_bilinear_equals_torchvision(case):
    """Spec 3.8 step 3: resample=BILINEAR with antialias on uint8 is torchvision's int16 fixed-point kernel; up
    and down scaling on each axis, sizes 1..40."""
    image, (height, width) = resize_case(case)
    expected = REFERENCE[f"resize/{case}/output"]
    assert np.array_equal(REFERENCE[f"resize/{case}/input"], image)
    out = resize_bilinear(image, height, width)
    assert out.shape == expected.shape and np.abs(out.astype(np.int16) - expected).max() == 0


def test_resize_hand_computed_bilinear():
    """Spec 3.8 step 3: bilinear = triangle filter on half-pixel centres; upscaling [0, 255] to 4 pixels gives
    taps (1), (3/4, 1/4), (1/4, 3/4), (1): 0, 63.75 -> 64, 191.25 -> 191, 255 (the bicubic filter differs)."""
    row = np.array([[[0] * 3, [255] * 3]], dtype=np.uint8)
    assert resize_bilinear(row, 1, 4)[0, :, 0].tolist() == [0, 64, 191, 255]
    assert resize_bicubic(row, 1, 4)[0, :, 0].tolist() != [0, 64, 191, 255]


@pytest.mark.parametrize("resize", [resize_bilinear, resize_bicubic])
def test_resize_self_consistency(resize):
    """Spec 3.8 / 4.9: an unchanged size is not resampled; a constant image stays constant whatever the scale
    (the int16 weights of every output pixel sum to one within rounding)."""
    rng = np.random.default_rng(3)
    image = rng.integers(0, 256, (37, 53, 3), dtype=np.uint8)
    assert np.array_equal(resize(image, 37, 53), image)
    flat = np.full((37, 53, 3), 173, dtype=np.uint8)
    for height, width in [(5, 200), (111, 7), (37, 20), (64, 53)]:
        out = resize(flat, height, width)
        assert out.shape == (height, width, 3) and (out == 173).all()


@pytest.mark.parametrize("size, capped", [((2000, 1000), (1448, 724)), ((1920, 1080), (1365, 768)),
                                          ((1025, 1024), (1024, 1023)), ((4000, 100), (4000, 100)),
                                          ((1024, 1024), (1024, 1024))])
def test_cap_examples(size, capped):
    """Spec 3.8 step 2: more than 1,048,576 pixels -> scaled by sqrt(1048576 / (w h)), sides truncated."""
    width, height = size
    assert cap_pixels(np.zeros((height, width, 3), dtype=np.uint8)).shape == (capped[1], capped[0], 3)


def test_cap_resizes_with_pillow_bicubic():
    """Spec 3.8 step 2: the cap's resize is Pillow BICUBIC; images within the cap are returned as they are."""
    rng = np.random.default_rng(4)
    rgb = rng.integers(0, 256, (700, 1600, 3), dtype=np.uint8)
    out = cap_pixels(rgb)
    assert np.array_equal(out, np.asarray(Image.fromarray(rgb).resize((1548, 677), Image.Resampling.BICUBIC)))
    small = np.zeros((100, 4000, 3), dtype=np.uint8)
    assert cap_pixels(small) is small


@pytest.mark.parametrize("size, tiles, crop, tokens", [
    ((640, 480), None, (416, 576), 234), ((200, 100), None, (192, 384), 72),
    ((1024, 1024), (2, 2), (512, 512), 1280), ((2000, 1000), (1, 2), (352, 704), 754),
    ((1920, 1080), (1, 2), (384, 672), 764)])
def test_spec_token_counts(size, tiles, crop, tokens):
    """Spec 3.8 step 4 examples (after the cap): single crop at the smart size, or rows x cols tiles of 256
    tokens plus the thumbnail."""
    width, height = size
    image = lfm2_image(cap_pixels(np.zeros((height, width, 3), dtype=np.uint8)), CONFIG)
    last = image.crops[-1]
    assert (last.grid[0] * 16, last.grid[1] * 16) == crop
    if tiles is None:
        assert len(image.crops) == 1 and (image.rows, image.cols) == (1, 1)
    else:
        assert (image.rows, image.cols) == tiles and len(image.crops) == tiles[0] * tiles[1] + 1
        assert all(c.grid == (32, 32) for c in image.crops[:-1]) and image.tile_tokens == 256
    assert image.image_tokens == tokens == placeholder_text(image).count("<image>")


def test_grid_tie_rule():
    """Spec 3.8 step 3: aspect 1.25 is exactly between grids 2x2 and 3x2; the later (3x2) wins only when the
    image area exceeds 0.5 * 512^2 * 6 = 786,432."""
    assert grid_layout(800, 1000, CONFIG) == (3, 2)
    assert grid_layout(720, 900, CONFIG) == (2, 2)


def test_single_crop_placeholder_shape():
    """Spec 3.8 step 4: one crop -> `<|image_start|>` + `<image>` x n + `<|image_end|>`, no row/thumbnail tags."""
    image = lfm2_image(np.zeros((100, 200, 3), dtype=np.uint8), CONFIG)
    assert placeholder_text(image) == "<|image_start|>" + "<image>" * 72 + "<|image_end|>"


@pytest.mark.parametrize("grid", [(32, 32), (16, 16), (4, 206), (26, 44), (8, 8), (48, 24), (2, 2), (7, 3)])
def test_siglip_positions_equal_torch_interpolate(grid):
    """Spec 3.8 step 5: the 16x16 SigLIP2 position table resized to each crop's patch grid with antialiased
    bilinear (align_corners=False), rows in the crop's patch order, as transformers' resize_positional_embeddings."""
    height, width = grid
    table = np.random.default_rng(height * 1000 + width).normal(0, 1, (16, 16, 48)).astype(np.float32)
    expected = F.interpolate(torch.from_numpy(table).permute(2, 0, 1)[None], size=(height, width), mode="bilinear",
                             align_corners=False, antialias=True).reshape(48, height * width).T.numpy()
    out = siglip_positions(table, height, width)
    assert out.dtype == np.float32 and out.shape == (height * width, 48)
    assert np.abs(out - expected).max() <= 1e-6


@pytest.mark.parametrize("key, value", [("resample", 3), ("resample", 0), ("do_rescale", False),
                                        ("rescale_factor", 1 / 256), ("do_normalize", False)])
def test_processor_config_refusals(key, value):
    """Spec 3.8 step 3: only bilinear, rescale 1/255 and normalisation are reproduced; anything else is refused
    with the key named."""
    with pytest.raises(ValueError, match=key):
        Lfm2ImageConfig.from_processor_config({"image_processor": {key: value}})
    with pytest.raises(ValueError, match=key):
        Lfm2ImageConfig.from_processor_config({key: value})


def test_processor_config_reads_both_layouts():
    """Spec 3.8 step 3: parameters come from the checkpoint's processor config (nested under "image_processor"
    in processor_config.json, top level in preprocessor_config.json); missing keys take the class defaults."""
    raw = {"max_tiles": 4, "min_image_tokens": 32, "image_mean": [0.5, 0.5, 0.5], "resample": 2,
           "rescale_factor": 0.00392156862745098, "do_pad": True, "size": {"height": 512, "width": 512}}
    nested = Lfm2ImageConfig.from_processor_config({"image_processor": raw, "processor_class": "Lfm2VlProcessor"})
    assert nested == Lfm2ImageConfig.from_processor_config(raw)
    assert (nested.max_tiles, nested.min_image_tokens, nested.tile_size) == (4, 32, 512)
    assert Lfm2ImageConfig.from_processor_config(nested.to_dict()) == nested
    assert Lfm2ImageConfig.from_processor_config({}) == CONFIG


@pytest.mark.parametrize("raw, key", [({"min_tiles": 5, "max_tiles": 3}, "min_tiles"),
                                      ({"tile_size": 500}, "tile_size"), ({"encoder_patch_size": 0}, "encoder_patch_size"),
                                      ({"image_std": [0.5, 0.5]}, "image_std"), ({"use_thumbnail": "yes"}, "use_thumbnail")])
def test_processor_config_bad_values(raw, key):
    """Spec 3.8 step 3: inconsistent processor parameters are refused at load, naming the field."""
    with pytest.raises(ValueError, match=key):
        Lfm2ImageConfig.from_processor_config(raw)
