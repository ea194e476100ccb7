"""Media the answer gates' requests carry, generated: deterministic by seed, as data URLs, so a gate needs no
fixture files and no network. A gradient with noise, so neighbouring patches differ and none is blank."""

from __future__ import annotations

import base64
import functools
import io

import numpy as np
from PIL import Image


def sample_rgb(width: int, height: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), (x * 3 + y) % 256], axis=-1)
    return np.clip(rgb + rng.integers(-20, 21, rgb.shape), 0, 255).astype(np.uint8)


def _encoded(rgb: np.ndarray, fmt: str) -> str:
    buffer = io.BytesIO()
    Image.fromarray(rgb).save(buffer, fmt)
    return base64.b64encode(buffer.getvalue()).decode()


# Kept: each gate of an export, and each parity run, asks for the same requests' media again.
@functools.lru_cache(maxsize=48)
def image_url(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> str:
    """An image as a data URL: PNG (lossless, so the gates' pixels are exactly the generated ones; the noise makes it
    a slow decode, 2.4 MB at 1024x1024) or JPEG (as photos are sent)."""
    return f"data:image/{fmt.lower()};base64," + _encoded(sample_rgb(width, height, seed), fmt)


@functools.lru_cache(maxsize=16)
def jpeg_video_url(width: int, height: int, frames: int, seed: int = 0) -> str:
    """A video as JPEG frames in one data URL (`data:video/jpeg;base64,<jpeg>,<jpeg>,...`: every frame read, at
    2 fps, nothing to demux), each frame its own image."""
    return "data:video/jpeg;base64," + ",".join(_encoded(sample_rgb(width, height, seed + k), "JPEG")
                                                for k in range(frames))
