"""Decoding fetched bytes into RGB frames (spec 3.8 step 1, 4.8): Pillow with a format allow-list, dimensions
read from the header and refused before the pixels are decoded, a PNG's data inflated by libdeflate
(png_inflate.py), EXIF orientation applied, transparency composited onto white."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from .media_allowance import MediaAllowance
from .media_fetch import MediaError
from .png_inflate import stored_png

MAX_IMAGE_PIXELS = 178_956_970  # vLLM's VLLM_MAX_IMAGE_PIXELS default
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
WHITE = (255, 255, 255)
# decode_image checks every image's header against its own limit before any pixel is decoded, so Pillow's
# process-wide bomb check (which would refuse first, without the dimensions) is handed over to it.
Image.MAX_IMAGE_PIXELS = None


def decode_image(data: bytes, where: str, max_pixels: int = MAX_IMAGE_PIXELS,
                 allowance: MediaAllowance | None = None) -> np.ndarray:
    """Image bytes -> RGB uint8 [H, W, 3]; its pixels taken from the request's `allowance` before decoding.

    JPEG's draft mode (decoding at 1/2 to 1/8 scale) would make large photos cheaper, but the pixels would differ
    from the reference's full decode and resize, so images are decoded in full within the budget instead."""
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        width, height = image.size
        if width * height > max_pixels:
            raise MediaError(where, f"Image dimensions {width}x{height} ({width * height} pixels) exceed the "
                                    f"maximum of {max_pixels} pixels.")
        if width < 1 or height < 1:
            raise MediaError(where, f"Image dimensions {width}x{height} are empty")
        if allowance is not None:
            allowance.take_pixels(width * height, where, f"Image {width}x{height}")
        # Checked and counted from the header above: only now is the image data inflated.
        if image.format == "PNG" and (stored := stored_png(data)) is not None:
            image = Image.open(io.BytesIO(stored), formats=("PNG",))
        image.load()
        # In place, and no conversion of an RGB image: both would copy every pixel (a video's frames come here).
        ImageOps.exif_transpose(image, in_place=True)
        if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
            rgba = image.convert("RGBA")
            background = Image.new("RGBA", rgba.size, WHITE + (255,))
            image = Image.alpha_composite(background, rgba)
        return np.asarray(image if image.mode == "RGB" else image.convert("RGB"), dtype=np.uint8)
    except MediaError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError, MemoryError) as exc:
        raise MediaError(where, f"Failed to load image: {exc}") from None
