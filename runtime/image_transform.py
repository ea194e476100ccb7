"""Image preprocessing in plain numpy, as vLLM runs it through transformers' torchvision backend (spec 3.8, 4.9).

The resizes are torchvision's antialiased bicubic (spec 4.9) and bilinear (spec 3.8) on uint8 tensors (torch's CPU
kernel, ported from Pillow but with int16 weights of per-axis precision): separable, horizontal pass first, each
pass rounded and clipped to uint8; an axis whose size does not change is not resampled.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache, partial
from itertools import takewhile

import numpy as np

from .deadline import Deadline
from .pixel_workers import PixelWorkers, fill_here

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
    return index, rounded, precision


# Output pixels a product block computes. Each block multiplies its input window densely, zeros included: 32
# outputs of a 720p frame shrunk to 576 wide read a window of about 80 inputs for their 10 taps each, and at 32 the
# products still run at BLAS speed (16 and 64 were slower on the seeds' video frames).
BLOCK = 32
# A horizontal pass centres its input this many bytes at a time at most: below the server's mmap threshold.
CENTRED_BYTES = 960 << 10


@dataclass(frozen=True)
class _Bands:
    """One pass's int16 weights as dense blocks for BLAS products, with the dtype in which they are exact.

    A pass computes clip((2^(p-1) + sum_k w_k v_k) >> p, 0, 255) in int32. Its input comes centred (v - 128) and
    its weights scaled by 2^-p (a power of two: exact), so that it is floor(sum_k w'_k (v_k - 128) + shift) + 128,
    shift = (128 sum_k w_k + 2^(p-1)) 2^-p - 128. Every product and partial sum, and the sum with the shift, is an
    integer times 2^-p of magnitude at most 128 sum_k |w_k| + |128 (sum_k w_k - 2^p) + 2^(p-1)| (times 2^-p):
    below 2^24 a float32 product is exact in any summation order, and float64 (below 2^53) always is; the floor
    is exact too. The result stays centred for the next pass, and only the last one adds the 128 back."""

    blocks: tuple[tuple[int, int, int, int, np.ndarray], ...]  # (out from, to, in from, to, weights' [out, in])
    shift: np.ndarray  # [out]
    dtype: type
    clips: bool  # whether some sum falls outside [0, 255] (only a kernel with negative lobes, or rounded weights)


# One video's frames share one size, and photos often do: a size pair's blocks are made once, not per frame.
@lru_cache(maxsize=64)
def _bands(in_size: int, out_size: int, filt: _Filter) -> _Bands:
    index, weights, precision = _int16_taps(in_size, out_size, filt)
    weights = weights.astype(np.int64)
    totals, half = weights.sum(axis=1), 1 << (precision - 1)
    bias = 128 * (totals - (1 << precision)) + half
    bound = 128 * int(np.abs(weights).sum(axis=1).max()) + int(np.abs(bias).max())
    dtype = np.float32 if bound < 1 << 24 else np.float64
    largest = (half + 255 * np.where(weights > 0, weights, 0).sum(axis=1)) >> precision
    smallest = (half + 255 * np.where(weights < 0, weights, 0).sum(axis=1)) >> precision
    clips = bool(largest.max() > 255 or smallest.min() < 0)
    scale = 2.0 ** -precision
    blocks = []
    for start in range(0, out_size, BLOCK):
        taps, rows = index[start:start + BLOCK], weights[start:start + BLOCK]
        used = taps[rows != 0]
        lo, hi = (int(used.min()), int(used.max()) + 1) if used.size else (0, 1)
        # Only the block's own window is made, never the whole out x in matrix (100 MB for a 10,000-pixel side).
        # The taps past a pixel's window weigh 0 and may fall outside it: clipped into it, they add nothing.
        block = np.zeros((len(rows), hi - lo), dtype=np.int64)
        np.add.at(block, (np.arange(len(rows))[:, None], np.clip(taps - lo, 0, hi - lo - 1)), rows)
        block = (block * scale).astype(dtype)
        block.flags.writeable = False
        blocks.append((start, start + len(rows), lo, hi, block))
    shift = (bias * scale).astype(dtype)
    shift.flags.writeable = False
    return _Bands(tuple(blocks), shift, dtype, clips)


def _shifted(plane: np.ndarray, by: float, depth: int, dst: np.ndarray | None = None) -> np.ndarray:
    """A 2-D plane plus `by`, as OpenCV `depth` (saturated to uint8's range if that). addWeighted takes the amount as
    a number: `add` reads a 1x1 plane as a scalar and the amount as the array."""
    import cv2

    return cv2.addWeighted(plane, 1.0, plane, 0.0, by, dst=dst, dtype=depth)


def _centred(image: np.ndarray, dtype: type) -> np.ndarray:
    """[rows, W, C] uint8 -> [C, rows, W] values minus 128 in `dtype`, one plane at a time (OpenCV's split and
    conversion: several times numpy's copy of a transposed view)."""
    import cv2

    planes = cv2.split(image) if image.shape[2] > 1 else [image[:, :, 0]]
    out = np.empty((len(planes), *image.shape[:2]), dtype=dtype)
    depth = cv2.CV_32F if dtype == np.float32 else cv2.CV_64F
    for plane, dst in zip(planes, out):
        _shifted(plane, -128.0, depth, dst)
    return out


def _rounded(acc: np.ndarray, shift: np.ndarray, clip: bool) -> np.ndarray:
    """A pass's sums -> its centred values in place: floor(sum + shift), within [-128, 127] where `clip` (the
    last pass's are clipped as they become uint8)."""
    acc += shift
    np.floor(acc, out=acc)
    if clip:
        np.maximum(acc, -128, out=acc)
        np.minimum(acc, 127, out=acc)
    return acc


def _horizontal(pixels: np.ndarray, bands: _Bands, dtype: type, clip: bool) -> np.ndarray:
    """[rows, W, C] uint8 -> [C, rows, width] centred values, every channel's rows in one product a block. The
    input is centred a span of columns at a time, for as many blocks as keep its buffer within CENTRED_BYTES."""
    rows, _, channels = pixels.shape
    out = np.empty((channels * rows, bands.shift.shape[0]), dtype=dtype)
    column_bytes = rows * channels * np.dtype(dtype).itemsize
    blocks = list(bands.blocks)
    while blocks:
        base = blocks[0][2]  # the blocks' windows move right as their outputs do
        group = list(takewhile(lambda b: (b[3] - base) * column_bytes <= CENTRED_BYTES, blocks)) or blocks[:1]
        blocks = blocks[len(group):]
        span = group[-1][3] - base
        centred = _centred(pixels[:, base:base + span], dtype).reshape(channels * rows, span)
        for start, stop, lo, hi, block in group:
            np.matmul(centred[:, lo - base:hi - base], block.T.astype(dtype, copy=False), out=out[:, start:stop])
    return _rounded(out, bands.shift, clip and bands.clips).reshape(channels, rows, -1)


def _put_pixels(out: np.ndarray, planes: np.ndarray) -> None:
    """[C, rows, W] centred values (integers) -> uint8 [rows, W, C] into `out` (OpenCV: 128 added, interleaved)."""
    import cv2

    depth_u8 = [_shifted(plane, 128.0, cv2.CV_8U) for plane in planes]
    if len(depth_u8) == 1:
        out[:, :, 0] = depth_u8[0]
    else:
        cv2.merge(depth_u8, dst=out)


def _resize(image: np.ndarray, height: int, width: int, filt: _Filter, rows: range | None = None) -> np.ndarray:
    """Horizontal pass, then vertical, each rounded to uint8 as torch rounds them; an unchanged axis is not
    resampled. The passes are BLAS products (numpy releases the GIL in them, so frames resize in parallel
    threads), exact by `_Bands`. The image goes in strips, one per block of output rows, so that the buffers stay
    small enough to come from the heap: a whole frame's would be mapped and faulted in afresh (the server maps
    buffers of 1 MiB and more), and concurrent faults queue on the process's memory map. With `rows` (whole
    blocks of BLOCK output rows), only those output rows are made."""
    in_height, in_width = image.shape[:2]
    rows = rows or range(height)
    if (in_height, in_width) == (height, width):
        return image[rows.start:rows.stop]
    source = image.reshape(in_height, in_width, -1)
    out = np.empty((len(rows), width, source.shape[2]), dtype=np.uint8)
    across = _bands(in_width, width, filt) if in_width != width else None
    down = _bands(in_height, height, filt) if in_height != height else None
    dtype = np.float64 if np.float64 in {b.dtype for b in (across, down) if b is not None} else np.float32
    strips = down.blocks if down is not None else [(r, min(r + BLOCK, height), r, min(r + BLOCK, height), None)
                                                   for r in range(0, height, BLOCK)]
    for start, stop, lo, hi, block in strips:
        if not rows.start <= start < rows.stop:
            continue
        strip = (_horizontal(source[lo:hi], across, dtype, clip=down is not None) if across is not None
                 else _centred(source[lo:hi], dtype))
        if down is not None:
            strip = _rounded(np.matmul(block.astype(dtype, copy=False), strip), down.shift[start:stop, None], False)
        _put_pixels(out[start - rows.start:stop - rows.start], strip)
    return out.reshape(len(rows), width, *image.shape[2:])


def resize_bicubic(image: np.ndarray, height: int, width: int, rows: range | None = None) -> np.ndarray:
    """Antialiased bicubic resize of an [H, W, C] uint8 image, horizontal pass first (torchvision uint8 CPU,
    spec 4.9); only output `rows` (whole blocks of 32) where given."""
    return _resize(image, height, width, BICUBIC, rows)


def resize_bilinear(image: np.ndarray, height: int, width: int, rows: range | None = None) -> np.ndarray:
    """Antialiased bilinear resize of an [H, W, C] uint8 image (triangle filter, support 1 widened by the scale
    when shrinking), horizontal pass first: torchvision's `resize(..., BILINEAR, antialias=True)` on uint8 CPU
    tensors (spec 3.8 step 3); only output `rows` (whole blocks of 32) where given."""
    return _resize(image, height, width, BILINEAR, rows)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen smart resize (spec 4.9): multiples of `factor`, area within [min_pixels, max_pixels], Python rounding."""
    if max(height, width) / min(height, width) > 200:
        ratio = max(height, width) / min(height, width)
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {ratio}")
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


def _normal_table(mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """[256, C] float32: (x - 255 mean) / (255 std) for every uint8 x, in float32 arithmetic as transformers' fused
    rescale+normalize computes it pixel by pixel."""
    mean255 = (np.asarray(mean, dtype=np.float32) * np.float32(255.0)).astype(np.float32)
    std255 = (np.asarray(std, dtype=np.float32) * np.float32(255.0)).astype(np.float32)
    return (np.arange(256, dtype=np.float32)[:, None] - mean255) / std255


def normalize(image: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...], out: np.ndarray | None = None
              ) -> np.ndarray:
    """uint8 [.., H, W, C] -> float32 (x - 255 mean) / (255 std), the fused rescale+normalize of transformers;
    into `out` (C-contiguous float32, as many values) where given.

    The same float32 arithmetic, done once for each of the 256 values of each channel, then looked up (OpenCV's
    LUT): the values are the ones computed pixel by pixel, without the float32 copies of the image in between."""
    import cv2

    channels = image.shape[-1]
    table = _normal_table(mean, std).reshape(256, 1, channels)
    pixels = image.reshape(-1, image.shape[-2], channels)  # OpenCV's [rows, cols, channels]
    if out is None:
        return cv2.LUT(pixels, table).reshape(image.shape)
    cv2.LUT(pixels, table, dst=out.reshape(pixels.shape))
    return out


def rows_shape(frames: int, height: int, width: int, channels: int, patch: int, temporal: int) -> tuple[int, int]:
    """The pixel rows of `frames` frames of height x width (padded to whole temporal groups): [t * h * w,
    C * temporal * patch * patch] (float32), filled frame by frame with `put_normalized`."""
    groups = -(-frames // temporal)
    return groups * (height // patch) * (width // patch), channels * temporal * patch * patch


def put_normalized(rows: np.ndarray, positions: range, image: np.ndarray, patch: int, merge: int, temporal: int,
                   mean: tuple[float, ...], std: tuple[float, ...], top: int = 0, height: int | None = None) -> None:
    """Normalize a uint8 [H, W, C] frame into `rows` as each of frames `positions`, in (temporal group, merge block,
    in-block) row order and (C, temporal, py, px) column order (spec 4.9). One band of merge x patch pixel rows at
    a time: its bytes reordered into the rows' order (one strided copy), then each channel looked up (`normalize`'s
    table) straight into its columns of each position, with no float32 copy of the frame. `image` may be the rows
    of a frame `height` high from row `top` on (a multiple of merge x patch)."""
    import cv2

    _, width, channels = image.shape
    side, pixels = merge * patch, patch * patch
    height = height or image.shape[0]
    tables = [np.ascontiguousarray(column) for column in _normal_table(mean, std).T]
    view = rows.reshape(-1, height // side, width // side * merge * merge, channels, temporal, pixels)
    for band_top in range(0, image.shape[0], side):
        band = image[band_top:band_top + side]
        ordered = np.ascontiguousarray(band.reshape(1, merge, patch, width // side, merge, patch, channels)
                                       .transpose(0, 3, 1, 4, 6, 2, 5)).reshape(-1, channels, pixels)
        cells = (top + band_top) // side
        for position in positions:
            # [patches of the band, C, py px]: a 2-D view with a row step for each channel.
            target = view[position // temporal, cells, :, :, position % temporal]
            for channel in range(channels):
                cv2.LUT(ordered[:, channel], tables[channel], dst=target[:, channel])


# An image's part: this many units of output rows, a unit being whole blocks of the resize and of merge x patch
# (32 rows for d3), so that a photo spreads over the worker processes (a 960-row image in 8 parts).
IMAGE_PART_UNITS = 4


def fill_image_rows(images: Sequence[np.ndarray], rows: np.ndarray, part: tuple[int, int],
                    stopped: Callable[[], bool], *, height: int, width: int, patch: int, merge: int, temporal: int,
                    mean: tuple[float, ...], std: tuple[float, ...]) -> None:
    """Output rows [top, bottom) of the one image resized, normalized and written into `rows` as every frame of its
    temporal group (a `Fill` of runtime/pixel_workers.py)."""
    top, bottom = part
    if not stopped():
        band = resize_bicubic(images[0], height, width, range(top, bottom))
        put_normalized(rows, range(temporal), band, patch, merge, temporal, mean, std, top, height)


def qwen_image(rgb: np.ndarray, patch: int, merge: int, temporal: int, mean: tuple[float, ...],
               std: tuple[float, ...], min_pixels: int, max_pixels: int, workers: PixelWorkers | None = None,
               deadline: Deadline | None = None) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One RGB uint8 [H, W, 3] image -> (pixel_values rows, grid (1, h, w) in patches): smart resize, bicubic,
    normalize into pixel rows, the frame repeated to `temporal` frames (spec 4.9); in `workers` where given."""
    height, width = smart_resize(rgb.shape[0], rgb.shape[1], patch * merge, min_pixels, max_pixels)
    shape = rows_shape(temporal, height, width, rgb.shape[2], patch, temporal)
    fill = partial(fill_image_rows, height=height, width=width, patch=patch, merge=merge, temporal=temporal,
                   mean=mean, std=std)
    grid = (1, height // patch, width // patch)
    step = IMAGE_PART_UNITS * math.lcm(BLOCK, patch * merge)
    parts = [(top, min(top + step, height)) for top in range(0, height, step)]
    run = workers.fill if workers is not None else fill_here
    return run(fill, [rgb], shape, parts, deadline or Deadline()), grid
