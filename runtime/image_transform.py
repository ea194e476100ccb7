"""Image preprocessing in plain numpy, as vLLM runs it through transformers' torchvision backend (spec 3.8, 4.9).

The resizes are torchvision's antialiased bicubic (spec 4.9) and bilinear (spec 3.8) on uint8 tensors (torch's CPU
kernel, ported from Pillow but with int16 weights of per-axis precision): separable, horizontal pass first, each
pass rounded and clipped to uint8; an axis whose size does not change is not resampled.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

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


def _int16_taps(in_size: int, out_size: int, filt: _Filter = BICUBIC) -> tuple[np.ndarray, np.ndarray, int]:
    """Per output pixel: input indices [out, K], int weights [out, K] and their precision in bits, as
    torchvision's uint8 kernel computes them (Pillow's filter support, weights scaled to fit int16)."""
    scale = in_size / out_size
    support = filt.radius * scale if scale >= 1.0 else filt.radius
    inv_scale = 1.0 / scale if scale >= 1.0 else 1.0
    max_taps = int(math.ceil(support)) * 2 + 1
    bounds, rows = [], []
    for i in range(out_size):
        center = scale * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), in_size)
        hi = min(hi, lo + max_taps)  # torch clips the rare extra tap that rounding can add
        taps = filt.kernel((np.arange(lo, hi) - center + 0.5) * inv_scale)
        total = taps.sum()
        bounds.append(lo)
        rows.append(taps / total if total != 0 else taps)
    width = max(len(r) for r in rows)
    index = np.zeros((out_size, width), dtype=np.int64)
    weights = np.zeros((out_size, width), dtype=np.float64)
    for i, (lo, row) in enumerate(zip(bounds, rows)):
        index[i] = np.minimum(lo + np.arange(width), in_size - 1)
        weights[i, :len(row)] = row
    precision = 0
    while precision < 22 and int(0.5 + weights.max() * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    scaled = weights * (1 << precision)
    return index, np.where(scaled < 0, np.trunc(scaled - 0.5), np.trunc(scaled + 0.5)), precision


def _resample_axis(image: np.ndarray, out_size: int, axis: int, filt: _Filter = BICUBIC) -> np.ndarray:
    """One pass along `axis`: integer taps summed exactly (in float64: every partial sum is an integer below
    2^53), then rounded, shifted and clipped to uint8 like the C kernel."""
    index, weights, precision = _int16_taps(image.shape[axis], out_size, filt)
    source = np.moveaxis(image, axis, 0)
    out = np.empty((out_size, *source.shape[1:]), dtype=np.uint8)
    extra = (slice(None),) + (None,) * (source.ndim - 1)
    # Column blocks keep the float64 working set near 64 MiB whatever the image size.
    block = max(1, (8 << 20) // max(1, source.shape[0] * int(np.prod(source.shape[2:]))))
    for start in range(0, source.shape[1], block):
        part = source[:, start:start + block].astype(np.float64)
        acc = np.zeros((out_size, *part.shape[1:]), dtype=np.float64)
        for k in range(index.shape[1]):
            acc += weights[:, k][extra] * part[index[:, k]]
        shifted = (acc.astype(np.int64) + (1 << (precision - 1))) >> precision
        out[:, start:start + block] = np.clip(shifted, 0, 255)
    return np.moveaxis(out, 0, axis)


def _resize(image: np.ndarray, height: int, width: int, filt: _Filter) -> np.ndarray:
    if image.shape[1] != width:
        image = _resample_axis(image, width, axis=1, filt=filt)
    if image.shape[0] != height:
        image = _resample_axis(image, height, axis=0, filt=filt)
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
    """uint8 [.., H, W, C] -> float32 (x - 255 mean) / (255 std), the fused rescale+normalize of transformers."""
    mean255 = (np.asarray(mean, dtype=np.float32) * np.float32(255.0)).astype(np.float32)
    std255 = (np.asarray(std, dtype=np.float32) * np.float32(255.0)).astype(np.float32)
    return (image.astype(np.float32) - mean255) / std255


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
