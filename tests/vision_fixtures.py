"""Reference outputs of transformers' Qwen2VLImageProcessor (torchvision backend, as vLLM configures it for d3:
size {shortest_edge: 65,536, longest_edge: 1,638,400} pixels, mean = std = 0.5) for deterministic test images.

The test images are generated from a seed (no image files are stored); this script, run once in an environment
with torchvision (torch 2.14.1 + torchvision 0.29.1 here; torchvision does not import beside the torch 2.13 CPU
wheel the project tests with), writes tests/fixtures/vision/qwen_processors.npz (Qwen3VLVideoProcessor outputs too, configured as
vLLM's D3ProcessingInfo configures it: per-frame cap, 196 tokens a frame, no frame sampling).

    python -m tests.vision_fixtures            # regenerate the fixture
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numpy as np

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "vision" / "qwen_processors.npz"
SIZES = {"tiny-50x50": (50, 50), "square-100": (100, 100), "vga-640x480": (640, 480), "wide-1920x1080": (1920, 1080),
         "photo-4000x3000": (4000, 3000), "strip-2000x40": (2000, 40), "tall-300x1200": (300, 1200),
         "odd-517x333": (517, 333)}
# Sampled-frame stacks (frames, width, height) for the video processor; the odd counts get padded.
VIDEOS = {"clip-5x640x360": (5, 640, 360), "clip-20x1280x720": (20, 1280, 720), "clip-4x50x50": (4, 50, 50),
          "clip-32x1920x1080": (32, 1920, 1080), "clip-7x300x1200": (7, 300, 1200)}
MIN_PIXELS, MAX_PIXELS = 65_536, 1_638_400
MEAN = STD = (0.5, 0.5, 0.5)


def fixture_image(name: str) -> np.ndarray:
    """A deterministic RGB uint8 [H, W, 3] image: gradients, a disc, stripes and noise (edges stress the resize).
    A copy the caller may write to."""
    return _made_image(name).copy()


@functools.cache  # the 4000x3000 photo takes 3.6 s to make, and every test video is cut from it
def _made_image(name: str) -> np.ndarray:
    width, height = SIZES[name]
    rng = np.random.default_rng(int(hashlib.sha256(name.encode()).hexdigest()[:8], 16))
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    r = 255 * x / max(width - 1, 1)
    g = 255 * y / max(height - 1, 1)
    disc = ((x - width * 0.4) ** 2 + (y - height * 0.6) ** 2) < (min(width, height) * 0.3) ** 2
    b = np.where(disc, 230.0, 40.0) + 60 * ((x // 7 + y // 5) % 2)
    image = np.stack([r, g, b], axis=-1) + rng.normal(0, 12, (height, width, 3))
    made = np.clip(np.rint(image), 0, 255).astype(np.uint8)
    made.flags.writeable = False
    return made


def fixture_frames(name: str) -> np.ndarray:
    """[n, H, W, 3] uint8 frames: a test image that drifts right a few pixels per frame."""
    count, width, height = VIDEOS[name]
    base = fixture_image("photo-4000x3000")[:height, : width + 2 * count]
    return np.stack([base[:, 2 * i: 2 * i + width] for i in range(count)])


def main() -> None:
    import torch
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    processor = Qwen2VLImageProcessor(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=list(MEAN),
                                      image_std=list(STD), size={"shortest_edge": MIN_PIXELS,
                                                                 "longest_edge": MAX_PIXELS})
    arrays = {}
    for name in SIZES:
        out = processor(images=[Image.fromarray(fixture_image(name))], return_tensors="pt")
        pixels = out["pixel_values"].to(torch.float32).numpy()
        arrays[f"{name}/grid_thw"] = out["image_grid_thw"].numpy()[0]
        arrays[f"{name}/sha256"] = np.frombuffer(hashlib.sha256(pixels.tobytes()).digest(), dtype=np.uint8)
        arrays[f"{name}/head"] = pixels[:64]
        arrays[f"{name}/row_sums"] = pixels.sum(axis=1)
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    videos = Qwen3VLVideoProcessor(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=list(MEAN),
                                   image_std=list(STD), size={"shortest_edge": 4096, "longest_edge": 200704 * 32},
                                   cap_pixels_per_frame=True, max_video_tokens=196, do_sample_frames=False)
    for name in VIDEOS:
        out = videos(videos=[fixture_frames(name)], return_tensors="pt", do_sample_frames=False)
        pixels = out["pixel_values_videos"].to(torch.float32).numpy()
        arrays[f"{name}/grid_thw"] = out["video_grid_thw"].numpy()[0]
        arrays[f"{name}/sha256"] = np.frombuffer(hashlib.sha256(pixels.tobytes()).digest(), dtype=np.uint8)
        arrays[f"{name}/head"] = pixels[:64]
        arrays[f"{name}/row_sums"] = pixels.sum(axis=1)
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(FIXTURE, **arrays)
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
