"""Reference outputs of transformers' Lfm2VlImageProcessor (class defaults, torchvision backend: the d1 image
processing of spec 3.8 step 3) and of torchvision's uint8 antialiased bilinear resize, for deterministic test
images.

The images are generated from their names (no image files are stored). Run once from the repository root in an
environment with torchvision (torch 2.14.1 + torchvision 0.29.1 + transformers 5.20.2 here; torchvision does not
import beside the torch 2.13 CPU wheel the project tests with):

    /work/tvenv/bin/python -m tests.lfm2_vision_fixtures     # writes tests/fixtures/vision/lfm2_processor.npz

Torchvision resizes uint8 images natively (int16 fixed point) only on CPUs with AVX2/AVX512 (or arm64); elsewhere
it goes through float32, which rounds differently. The script refuses to run without that native path.

Stored per image NAME (size as it reaches the processor, i.e. after the 1024×1024-pixel cap):
  NAME/rows, NAME/cols, NAME/image_size (h, w), NAME/spatial_shapes [crops, 2] from return_row_col_info=True;
  NAME/placeholder: the text transformers' Lfm2VlProcessor puts in place of the image token;
  NAME/crop{j}: crop j as the uint8 image [H, W, 3] its unpadded pixel_values encode (mean = std = 0.5 makes every
    value x = (u − 127.5) / 127.5 for an integer u, checked here: the float32 values are recovered exactly),
    stored as differences along W modulo 256 (`decode_crop` undoes it) so that it compresses;
  NAME/sha256: SHA-256 of all crops' unpadded float32 pixel_values bytes, in order.
And resize/{i}/input, resize/{i}/output: small random uint8 [H, W, 3] images and their torchvision bilinear resize.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "vision" / "lfm2_processor.npz"
# (width, height) as the processor receives them.
SIZES = {"vga-640x480": (640, 480), "small-200x100": (200, 100), "square-1024": (1024, 1024),
         "capped-1448x724": (1448, 724), "capped-1365x768": (1365, 768), "strip-4000x100": (4000, 100),
         "tiny-50x50": (50, 50), "tall-100x4000": (100, 4000), "capped-1024x1023": (1024, 1023),
         # aspect 1.25 lies exactly halfway between grids 2x2 (1.0) and 3x2 (1.5): the later 3x2 wins when the
         # area exceeds 0.5·512²·6 = 786,432 pixels (1000x800), the earlier 2x2 otherwise (900x720).
         "tie-later-1000x800": (1000, 800), "tie-earlier-900x720": (900, 720)}
RESIZE_CASES = 48
SCALE = np.float32(127.5)  # 255 · 0.5: the fused mean and std


def fixture_image(name: str) -> np.ndarray:
    """A deterministic RGB uint8 [H, W, 3] image: gradients, a disc, stripes, and noise on the left quarter (edges
    and noise stress the resize; the noise is confined so that the fixture stays small)."""
    width, height = SIZES[name]
    rng = np.random.default_rng(int(hashlib.sha256(name.encode()).hexdigest()[:8], 16))
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    r = 255 * x / max(width - 1, 1)
    g = 255 * y / max(height - 1, 1)
    disc = ((x - width * 0.6) ** 2 + (y - height * 0.5) ** 2) < (min(width, height) * 0.3) ** 2
    b = np.where(disc, 230.0, 40.0) + 60 * ((x // 7 + y // 5) % 2)
    image = np.stack([r, g, b], axis=-1)
    noisy = x < width / 4
    image[noisy] += rng.normal(0, 8, (int(noisy.sum()), 3))
    return np.clip(np.rint(image), 0, 255).astype(np.uint8)


def resize_case(index: int) -> tuple[np.ndarray, tuple[int, int]]:
    """Small random image and target (height, width) for the bilinear resize cases: up and down, both axes."""
    rng = np.random.default_rng(1000 + index)
    height, width = (int(v) for v in rng.integers(1, 41, 2))
    out = (int(rng.integers(1, 41)), int(rng.integers(1, 41)))
    return rng.integers(0, 256, (height, width, 3), dtype=np.uint8), out


def to_uint8(pixels: np.ndarray) -> np.ndarray:
    """float32 pixel values -> the integers u with x = (u − 127.5) / 127.5, asserting the round trip is exact."""
    codes = np.rint(pixels.astype(np.float64) * 127.5 + 127.5)
    assert codes.min() >= 0 and codes.max() <= 255
    codes = codes.astype(np.uint8)
    assert np.array_equal((codes.astype(np.float32) - SCALE) / SCALE, pixels), "pixel values are not u/127.5 - 1"
    return codes


def unpatchify(codes: np.ndarray, grid: tuple[int, int], patch: int = 16) -> np.ndarray:
    """[gh·gw, patch·patch·3] rows (patches row-major, each (row, col, channel)) -> image [gh·patch, gw·patch, 3]."""
    gh, gw = grid
    return codes.reshape(gh, gw, patch, patch, 3).transpose(0, 2, 1, 3, 4).reshape(gh * patch, gw * patch, 3)


def encode_crop(image: np.ndarray) -> np.ndarray:
    return np.diff(image, axis=1, prepend=np.zeros_like(image[:, :1]))  # uint8: wraps modulo 256


def decode_crop(stored: np.ndarray) -> np.ndarray:
    """Inverse of encode_crop: running sums along W modulo 256."""
    return np.cumsum(stored, axis=1, dtype=np.uint8)


def placeholder(processor, output) -> str:
    """The processor's replacement text for the image token, by transformers' own Lfm2VlProcessor code (no
    tokenizer needed: the special-token strings are its defaults)."""
    from transformers.models.lfm2_vl.processing_lfm2_vl import Lfm2VlProcessor

    class _NoTokenizer(Lfm2VlProcessor):
        def __init__(self, image_processor):  # noqa: D401 - skip ProcessorMixin's tokenizer checks
            self.image_processor = image_processor
            self.image_token = "<image>"
            self.image_start_token = "<|image_start|>"
            self.image_end_token = "<|image_end|>"
            self.image_thumbnail_token = "<|img_thumbnail|>"

    return _NoTokenizer(processor).replace_image_token(output, image_idx=0, use_image_special_tokens=True)


def main() -> None:
    import torch
    from PIL import Image
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as tvF
    from transformers.models.lfm2_vl.image_processing_lfm2_vl import Lfm2VlImageProcessor

    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        raise SystemExit("torchvision's native uint8 bilinear resize needs an AVX2/AVX512 CPU")
    processor = Lfm2VlImageProcessor()
    arrays: dict[str, np.ndarray] = {}
    for name in SIZES:
        out = processor(images=[Image.fromarray(fixture_image(name))], return_tensors="pt",
                        return_row_col_info=True)
        pixels = out["pixel_values"].to(torch.float32).numpy()
        mask = out["pixel_attention_mask"].numpy()
        shapes = out["spatial_shapes"].numpy()
        digest = hashlib.sha256()
        for j in range(pixels.shape[0]):
            count = int(mask[j].sum())
            assert mask[j, :count].all() and count == shapes[j, 0] * shapes[j, 1]
            digest.update(np.ascontiguousarray(pixels[j, :count]).tobytes())
            image = unpatchify(to_uint8(pixels[j, :count]), tuple(shapes[j]))
            arrays[f"{name}/crop{j}"] = encode_crop(image)
            assert np.array_equal(decode_crop(arrays[f"{name}/crop{j}"]), image)
        arrays[f"{name}/sha256"] = np.frombuffer(digest.digest(), dtype=np.uint8)
        arrays[f"{name}/spatial_shapes"] = shapes
        arrays[f"{name}/rows"] = np.array(int(out["image_rows"][0]))
        arrays[f"{name}/cols"] = np.array(int(out["image_cols"][0]))
        arrays[f"{name}/image_size"] = np.array([int(v) for v in out["image_sizes"][0]])
        arrays[f"{name}/placeholder"] = np.array(placeholder(processor, out))
        print(name, "crops", pixels.shape[0], "grid", arrays[f"{name}/rows"], arrays[f"{name}/cols"],
              "tokens", str(arrays[f"{name}/placeholder"]).count("<image>"))
    for i in range(RESIZE_CASES):
        image, (height, width) = resize_case(i)
        chw = torch.from_numpy(image).permute(2, 0, 1).contiguous()
        resized = tvF.resize(chw, [height, width], interpolation=InterpolationMode.BILINEAR, antialias=True)
        arrays[f"resize/{i}/input"] = image
        arrays[f"resize/{i}/output"] = resized.permute(1, 2, 0).contiguous().numpy()
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(FIXTURE, **arrays)
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
