"""Image preprocessing in plain numpy, as vLLM runs it through transformers' torchvision backend (spec 3.8, 4.9).

The resizes are torchvision's antialiased bicubic (spec 4.9) and bilinear (spec 3.8) on uint8 tensors (torch's CPU
kernel, ported from Pillow but with int16 weights of per-axis precision): separable, horizontal pass first, each
pass rounded and clipped to uint8; an axis whose size does not change is not resampled.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

BICUBIC_A = -0.5  # Pillow's (and torchvision's antialias) cubic convolution coefficient


def _cubic(x: np.ndarray) -> np.ndarray:
    x = np.abs(x)
    a = BICUBIC_A
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def _triangle(x: np.ndarray) -> np.ndarray:
    x = np.abs(x)
    return np.where(x < 1, 1.0 - x, 0.0)


@dataclass(frozen=True)
class _Filter:
    """An antialias filter: its kernel and its support radius at scale 1 (widened by the scale when shrinking)."""

    kernel: Callable[[np.ndarray], np.ndarray]
    radius: float


BICUBIC = _Filter(_cubic, 2.0)
BILINEAR = _Filter(_triangle, 1.0)


# One video's frames share one size, and photos often do: the taps of a size pair are computed once, not per frame.
@lru_cache(maxsize=64)
def _int16_taps(in_size: int, out_size: int, filt: _Filter = BICUBIC) -> tuple[np.ndarray, np.ndarray, int]:
    """Per output pixel: input indices [out, K], int weights [out, K] and their precision in bits, as
    torchvision's uint8 kernel computes them (Pillow's filter support, weights scaled to fit int16); read-only,
    since they are shared."""
    scale = in_size / out_size
    support = filt.radius * scale if scale >= 1.0 else filt.radius
    inv_scale = 1.0 / scale if scale >= 1.0 else 1.0
    max_taps = int(math.ceil(support)) * 2 + 1
    # Every output pixel at once, with the scalar loop's float64 operations in its order (astype truncates as int()).
    centers = scale * (np.arange(out_size) + 0.5)
    lo = np.maximum((centers - support + 0.5).astype(np.intp), 0)
    hi = np.minimum((centers + support + 0.5).astype(np.intp), in_size)
    hi = np.minimum(hi, lo + max_taps)  # torch clips the rare extra tap that rounding can add
    index = lo[:, None] + np.arange(int((hi - lo).max()))
    taps = filt.kernel((index - centers[:, None] + 0.5) * inv_scale)
    taps[index >= hi[:, None]] = 0.0
    # Each pixel's own taps summed on their own: numpy's pairwise order depends on the count, so no padded rows.
    totals = np.array([row[:count].sum() for row, count in zip(taps, (hi - lo).tolist())])[:, None]
    weights = np.divide(taps, totals, out=taps, where=totals != 0)
    index = np.minimum(index, in_size - 1)
    precision = 0
    while precision < 22 and int(0.5 + weights.max() * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    scaled = weights * (1 << precision)
    rounded = np.where(scaled < 0, np.trunc(scaled - 0.5), np.trunc(scaled + 0.5)).astype(np.int32)
    index.flags.writeable = rounded.flags.writeable = False
    return index, rounded, precision


# Columns of one block: its int32 input, accumulator and tap (12 bytes a row) are about 2.5 MiB for a 720p frame
# shrunk to 576 wide, near the core's caches, instead of float64 copies of the whole image.
BLOCK_COLUMNS = 256


def _resample_rows(image: np.ndarray, out_size: int, filt: _Filter) -> np.ndarray:
    """One pass along axis 0 of a uint8 array, like the C kernel: integer taps summed in int32 (exact: |sum| <
    255 * 1.1 * 2^22 < 2^31, as in torch), rounded, shifted and clipped to uint8. Each tap gathers whole rows."""
    index, weights, precision = _int16_taps(image.shape[0], out_size, filt)
    rows = image.reshape(image.shape[0], -1)
    out = np.empty((out_size, rows.shape[1]), dtype=np.uint8)
    for start in range(0, rows.shape[1], BLOCK_COLUMNS):
        part = rows[:, start:start + BLOCK_COLUMNS].astype(np.int32)
        acc = np.full((out_size, part.shape[1]), 1 << (precision - 1), dtype=np.int32)
        tap = np.empty_like(acc)
        for k in range(index.shape[1]):
            np.take(part, index[:, k], axis=0, out=tap, mode="clip")  # indices are in range; "clip" skips a copy
            tap *= weights[:, k, None]
            acc += tap
        acc >>= precision
        out[:, start:start + BLOCK_COLUMNS] = np.clip(acc, 0, 255, out=acc)
    return out.reshape(out_size, *image.shape[1:])


def _transposed(image: np.ndarray) -> np.ndarray:
    """[H, W, C] -> [W, H, C], contiguous (OpenCV's transpose: several times numpy's copy of a 3-byte pixel)."""
    import cv2

    return cv2.transpose(image).reshape(image.shape[1], image.shape[0], *image.shape[2:])


def _resize(image: np.ndarray, height: int, width: int, filt: _Filter) -> np.ndarray:
    if image.shape[1] != width:  # resampled as rows of the transpose, so every tap gathers contiguous rows
        image = _transposed(_resample_rows(_transposed(image), width, filt))
    if image.shape[0] != height:
        image = _resample_rows(image, height, filt)
    return image


def resize_bicubic(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """Antialiased bicubic resize of an [H, W, C] uint8 image, horizontal pass first (torchvision uint8 CPU,
    spec 4.9)."""
    return _resize(image, height, width, BICUBIC)


def resize_bilinear(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """Antialiased bilinear resize of an [H, W, C] uint8 image (triangle filter, support 1 widened by the scale
    when shrinking), horizontal pass first: torchvision's `resize(..., BILINEAR, antialias=True)` on uint8 CPU
    tensors (spec 3.8 step 3)."""
    return _resize(image, height, width, BILINEAR)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen smart resize (spec 4.9): multiples of `factor`, area within [min_pixels, max_pixels], Python rounding."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}")
    return fit_area(height, width, round(height / factor) * factor, round(width / factor) * factor, factor,
                    min_pixels, max_pixels)


def fit_area(height: int, width: int, h_bar: int, w_bar: int, factor: int, min_pixels: int, max_pixels: int
             ) -> tuple[int, int]:
    """The smart resizes' second step (Qwen spec 4.9, LFM2-VL spec 3.8): a rounded size (h_bar, w_bar) whose area
    is out of [min_pixels, max_pixels] is rescaled from the original size, flooring or ceiling to `factor`."""
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def normalize(image: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """uint8 [.., H, W, C] -> float32 (x - 255 mean) / (255 std), the fused rescale+normalize of transformers.

    The same float32 arithmetic, done once for each of the 256 values of each channel, then looked up (OpenCV's
    LUT): the values are the ones computed pixel by pixel, without the float32 copies of the image in between."""
    import cv2

    mean255 = (np.asarray(mean, dtype=np.float32) * np.float32(255.0)).astype(np.float32)
    std255 = (np.asarray(std, dtype=np.float32) * np.float32(255.0)).astype(np.float32)
    table = (np.arange(256, dtype=np.float32)[:, None] - mean255) / std255  # [256, C]
    channels = image.shape[-1]
    pixels = image.reshape(-1, image.shape[-2], channels)  # OpenCV's [rows, cols, channels]
    return cv2.LUT(pixels, table.reshape(256, 1, channels)).reshape(image.shape)


def patchify(frames: np.ndarray, patch: int, merge: int, temporal: int) -> tuple[np.ndarray, tuple[int, int, int]]:
    """[T, H, W, C] float32 (T a multiple of `temporal`) -> rows [t * h * w, C * temporal * patch * patch] in
    (temporal group, merge block, in-block) order, and the grid (t, h, w) in patches (spec 4.9)."""
    frames_t, height, width, channels = frames.shape
    t, h, w = frames_t // temporal, height // patch, width // patch
    x = frames.transpose(0, 3, 1, 2).reshape(t, temporal, channels, h // merge, merge, patch, w // merge, merge,
                                               patch)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # t, bh, bw, mh, mw, C, temporal, py, px
    return np.ascontiguousarray(x.reshape(t * h * w, channels * temporal * patch * patch)), (t, h, w)


def qwen_image(rgb: np.ndarray, patch: int, merge: int, temporal: int, mean: tuple[float, ...],
               std: tuple[float, ...], min_pixels: int, max_pixels: int) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One RGB uint8 [H, W, 3] image -> (pixel_values rows, grid (1, h, w) in patches): smart resize, bicubic,
    normalize, the frame repeated to `temporal` frames, patchify (spec 4.9)."""
    height, width = smart_resize(rgb.shape[0], rgb.shape[1], patch * merge, min_pixels, max_pixels)
    resized = resize_bicubic(rgb, height, width)
    frames = np.repeat(normalize(resized, mean, std)[None], temporal, axis=0)
    return patchify(frames, patch, merge, temporal)
