"""The antialiased resizes (spec 3.8 step 3, spec 4.9): equal, bit for bit, to torch's uint8 kernel, which
torchvision's `resize(..., antialias=True)` calls, at any pair of sizes; the products are exact in float32 where
their bound allows and in float64 where it does not, and equal in any thread."""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from systemone.runtime.blas_threads import SETTER, _openblas_setters, one_blas_thread
from systemone.runtime import image_transform
from systemone.runtime.image_transform import BICUBIC, BILINEAR, _bands, resize_bicubic, resize_bilinear

RESIZES = {"bicubic": (resize_bicubic, BICUBIC), "bilinear": (resize_bilinear, BILINEAR)}


def torch_resize(image: np.ndarray, height: int, width: int, mode: str) -> np.ndarray:
    chw = torch.from_numpy(image).permute(2, 0, 1)[None]
    out = F.interpolate(chw, size=(height, width), mode=mode, antialias=True, align_corners=False)
    return out[0].permute(1, 2, 0).numpy()


def random_case(rng: np.random.Generator, largest: int) -> tuple[np.ndarray, int, int]:
    height, width = (int(v) for v in rng.integers(1, largest, 2))
    out_height, out_width = (int(v) for v in rng.integers(1, 300, 2))
    image = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    if rng.random() < 0.3:  # black and white only: the sums at their extremes
        image = np.where(image < 128, 0, 255).astype(np.uint8)
    return image, out_height, out_width


@pytest.mark.parametrize("mode", list(RESIZES))
def test_random_sizes_up_and_down_equal_torch(mode):
    resize, filt = RESIZES[mode]
    rng = np.random.default_rng(7)
    dtypes = set()
    for i in range(60):
        image, height, width = random_case(rng, 2500 if i % 3 == 0 else 300)
        out = resize(image, height, width)
        assert out.dtype == np.uint8 and np.array_equal(out, torch_resize(image, height, width, mode)), \
            (image.shape, height, width)
        dtypes |= {_bands(image.shape[1], width, filt).dtype, _bands(image.shape[0], height, filt).dtype}
    assert dtypes == {np.float32, np.float64}  # both kinds of product were checked


def test_the_seeds_video_frame_and_a_photo_take_float32_products():
    """720p frames to the seeds' 320x576 video size and a 12-megapixel photo to d3's cap stay within float32's
    exact range: the fast products."""
    for size, out in [(1280, 576), (720, 320), (4000, 1536), (3000, 1152)]:
        assert _bands(size, out, BICUBIC).dtype == np.float32


@pytest.mark.parametrize("mode", list(RESIZES))
def test_input_centred_a_few_columns_at_a_time_equals_torch(mode, monkeypatch):
    """A wide image's horizontal pass takes its columns in spans (its buffers below the server's mmap threshold):
    spans of one block's window each give torch's answer too."""
    resize, _ = RESIZES[mode]
    monkeypatch.setattr(image_transform, "CENTRED_BYTES", 1)
    image = np.random.default_rng(11).integers(0, 256, (97, 1500, 3), dtype=np.uint8)
    for height, width in [(40, 700), (97, 333), (150, 1700)]:
        assert np.array_equal(resize(image, height, width), torch_resize(image, height, width, mode))


def test_one_axis_and_grey_images():
    rng = np.random.default_rng(3)
    image = rng.integers(0, 256, (90, 70, 1), dtype=np.uint8)
    for height, width in [(90, 31), (200, 70), (33, 140)]:
        assert np.array_equal(resize_bicubic(image, height, width), torch_resize(image, height, width, "bicubic"))
    grey = image[:, :, 0]
    assert np.array_equal(resize_bicubic(grey, 45, 35), resize_bicubic(image, 45, 35)[:, :, 0])


def test_media_threads_run_blas_products_on_their_own_thread():
    """Where numpy's BLAS is an OpenBLAS with a thread-local setting (the wheels this project is tested with), a
    media thread's products run on that thread alone, and its resizes equal the main thread's."""
    assert _openblas_setters(), f"numpy's OpenBLAS has no {SETTER}"
    rng = np.random.default_rng(5)
    frames = rng.integers(0, 256, (4, 360, 640, 3), dtype=np.uint8)

    def in_thread(frame: np.ndarray) -> tuple[bool, int, np.ndarray]:
        held = one_blas_thread()
        previous = _openblas_setters()[0](ctypes.c_int(1))  # the setter returns the thread's setting before it
        return held, previous, resize_bicubic(frame, 160, 288)

    with ThreadPoolExecutor(2) as pool:
        for frame, (held, previous, out) in zip(frames, pool.map(in_thread, frames)):
            assert held and previous == 1
            assert np.array_equal(out, resize_bicubic(frame, 160, 288))
