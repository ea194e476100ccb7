"""SigLIP2-NaFlex position embeddings for one crop (spec 3.8 step 5), without torch.

The checkpoint stores a square S×S table of position embeddings; for a crop of h×w patches the vision tower
resizes it with `F.interpolate(table, size=(h, w), mode="bilinear", align_corners=False, antialias=True)` in float32
(transformers' `Siglip2VisionEmbeddings.resize_positional_embeddings`). Torch's CPU kernel for that is separable:
the width is resampled first, then the height (an axis whose size does not change is skipped), each pass a sum of
float32 taps of the triangle filter, its support widened by the scale when shrinking and its weights normalised to
sum 1 per output cell. The arithmetic below keeps torch's float32/float64 mix and its order of additions, which makes
it bit-exact against torch 2.13's x86-64 CPU build (elsewhere it agrees to a few ulps).

One torch quirk is not reproduced: for an output one cell wide whose height changes, torch's kernel repeats the
first row; LFM2-VL crops are at least two patches a side, and this port computes the true resize there.
"""

from __future__ import annotations

import math

import numpy as np

_F32 = np.float32


def _triangle_taps(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Input indices [out, K], float32 weights [out, K] (zero past each row's taps) and the tap count per row
    [out] of the antialiased bilinear filter, align_corners=False, scale = in/out."""
    scale = _F32(in_size) / _F32(out_size)
    support = _F32(scale) if scale >= 1.0 else _F32(1.0)
    inv_scale = _F32(1.0 / float(scale)) if scale >= 1.0 else _F32(1.0)
    max_taps = int(math.ceil(float(support))) * 2 + 1
    index = np.zeros((out_size, max_taps), dtype=np.int64)
    weights = np.zeros((out_size, max_taps), dtype=np.float32)
    sizes = np.zeros(out_size, dtype=np.int64)
    for i in range(out_size):
        center = _F32(float(scale) * (i + 0.5))
        lo = max(int(float(_F32(center - support)) + 0.5), 0)
        size = min(int(float(_F32(center + support)) + 0.5), in_size) - lo
        size = min(max(size, 0), max_taps)
        offsets = (np.arange(lo, lo + size).astype(np.float32) - center).astype(np.float64) + 0.5
        x = np.abs((offsets * float(inv_scale)).astype(np.float32))
        taps = np.where(x < 1.0, (1.0 - x.astype(np.float64)).astype(np.float32), _F32(0.0))
        total = _F32(0.0)
        for tap in taps:
            total = _F32(total + tap)
        if total != 0.0:
            taps = (taps / total).astype(np.float32)
        index[i] = np.minimum(lo + np.arange(max_taps), in_size - 1)
        weights[i, :size] = taps
        sizes[i] = size
    return index, weights, sizes


def _fused_add(acc: np.ndarray, tap: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """float32 acc + tap * weight rounded once, as a fused multiply-add: in float64, where the product of two float32
    values is exact (in place, with no float64 copy of `acc`)."""
    wide = tap.astype(np.float64)
    wide *= weight
    wide += acc
    return wide.astype(np.float32)


def _resample_axis(values: np.ndarray, out_size: int, axis: int) -> np.ndarray:
    """One float32 pass along `axis`, taps accumulated left to right in float32 in the order torch's compiled
    loop (x86-64, AVX2/AVX512 build) adds them: after the first product, the taps come in groups of four whose
    products are rounded to float32 before each addition; the one to three taps left over are fused
    multiply-adds (emulated in float64, where the product of two float32 values is exact)."""
    index, weights, sizes = _triangle_taps(values.shape[axis], out_size)
    source = np.moveaxis(values, axis, 0)
    extra = (slice(None),) + (None,) * (source.ndim - 1)
    grouped = (np.maximum(sizes, 1) - 1) // 4 * 4  # taps 1..grouped are added unfused
    acc = source[index[:, 0]] * weights[:, 0][extra]
    for k in range(1, index.shape[1]):
        tap, weight = source[index[:, k]], weights[:, k][extra]
        # Each way of adding is computed only where some output adds tap k that way: an upsampled table (every
        # tap fused) made both, and its float64 copies, for 55 ms a crop grid at d1-3B's width on two cores.
        unfused = acc + tap * weight if k <= grouped.max() else None
        fused = None if k <= grouped.min() else _fused_add(acc, tap, weight)
        acc = (fused if unfused is None else unfused if fused is None
               else np.where((k <= grouped)[extra], unfused, fused))
    return np.moveaxis(acc, 0, axis)


def siglip_positions(table: np.ndarray, height: int, width: int) -> np.ndarray:
    """Position embeddings of one crop of `height`×`width` patches (spec 3.8 step 5: `spatial_shapes` is the
    crop's patch grid): `table` float32 [S, S, C] (the position_embedding weight reshaped to its square) resized
    antialiased-bilinearly to [height, width, C] and returned row-major as [height * width, C] float32, the rows
    in the crop's patch order."""
    if table.ndim != 3:
        raise ValueError(f"table: expected [S, S, C], got shape {table.shape}")
    if height < 1 or width < 1:
        raise ValueError(f"height, width: must be positive, got {height}x{width}")
    values = np.asarray(table, dtype=np.float32)
    if values.shape[1] != width:
        values = _resample_axis(values, width, axis=1)
    if values.shape[0] != height:
        values = _resample_axis(values, height, axis=0)
    return np.ascontiguousarray(values.reshape(height * width, values.shape[-1]))
