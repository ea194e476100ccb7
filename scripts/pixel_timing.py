"""The pixel work of media requests (runtime/image_transform.py), timed at the sizes that serving meets: the
antialiased resizes (a photo capped to d1's 1024x1024 pixels, 1182x886, to its 2x2 tiles and its thumbnail; the
bench's 1024x1024 image to its thumbnail; a 720p video frame and the photo to d3's sizes; a 12-megapixel photo to
d3's cap), d1's whole image processor, and d3's pixel rows (resize, normalize, rows) of the photo and of a frame.
With --before FILE (an earlier runtime/image_transform.py, e.g. from `git show REV:runtime/image_transform.py`),
each case runs with that module and this one in turn, alternating which goes first, and both answers must be equal
(d1's processor takes only the resize from FILE).
One thread, no worker processes: the time is the pixel work's own. glibc's allocator as `systemone serve` sets it
(server/allocator.py: buffers of 1 MiB and more mapped afresh each time; or --default-allocator). Median and
minimum of --repeats runs, ms.

    python scripts/pixel_timing.py [--before FILE] [--repeats 25] [--default-allocator]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np

from systemone.runtime import image_transform
from systemone.runtime.d1 import image_processor
from systemone.runtime.d1.image_processor import Lfm2ImageConfig, cap_pixels, lfm2_image
from systemone.runtime.d3.media import IMAGE_MAX_PIXELS, IMAGE_MIN_PIXELS
from systemone.server.allocator import release_freed_memory

D3_PATCH, D3_MERGE, D3_TEMPORAL = 16, 2, 2  # Qwen3.5's vision tower (d3)
D3_MEAN = D3_STD = (0.5, 0.5, 0.5)


def load_before(path: Path) -> ModuleType:
    """FILE as a module of the runtime package, so that its relative imports resolve."""
    spec = importlib.util.spec_from_file_location("systemone.runtime._image_transform_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def cases() -> list[tuple[str, Callable[[ModuleType], np.ndarray]]]:
    rng = np.random.default_rng(0)
    photo = cap_pixels(rng.integers(0, 256, (1080, 1440, 3), dtype=np.uint8))  # 1182x886
    square = rng.integers(0, 256, (1024, 1024, 3), dtype=np.uint8)
    frame = rng.integers(0, 256, (720, 1280, 3), dtype=np.uint8)
    large = rng.integers(0, 256, (3000, 4000, 3), dtype=np.uint8)
    config = Lfm2ImageConfig()

    def d1_processor(module: ModuleType, image: np.ndarray) -> np.ndarray:
        image_processor.resize_bilinear = module.resize_bilinear  # the processor's one resize
        try:
            return lfm2_image(image, config).patches
        finally:
            image_processor.resize_bilinear = image_transform.resize_bilinear

    def d3_frame_rows(module: ModuleType, frame: np.ndarray) -> np.ndarray:
        # One frame of a temporal pair: the other's columns stay zero in both modules' rows.
        rows = np.zeros(module.rows_shape(1, 320, 576, 3, D3_PATCH, D3_TEMPORAL), dtype=np.float32)
        module.put_normalized(rows, range(1), module.resize_bicubic(frame, 320, 576), D3_PATCH, D3_MERGE,
                              D3_TEMPORAL, D3_MEAN, D3_STD)
        return rows

    return [
        ("d1 bilinear 1182x886 -> 1024x1024 (2x2 tiles)", lambda m: m.resize_bilinear(photo, 1024, 1024)),
        ("d1 bilinear 1182x886 -> 608x448 (thumbnail)", lambda m: m.resize_bilinear(photo, 448, 608)),
        ("d1 bilinear 1024x1024 -> 512x512 (thumbnail)", lambda m: m.resize_bilinear(square, 512, 512)),
        ("d3 bicubic 1280x720 -> 576x320 (video frame)", lambda m: m.resize_bicubic(frame, 320, 576)),
        ("d3 bicubic 1182x886 -> 1120x840 (photo)", lambda m: m.resize_bicubic(photo, 840, 1120)),
        ("d3 bicubic 4000x3000 -> 1536x1152 (12 MP photo)", lambda m: m.resize_bicubic(large, 1152, 1536)),
        ("d1 processor, 1182x886 photo", lambda m: d1_processor(m, photo)),
        ("d1 processor, 1024x1024 image", lambda m: d1_processor(m, square)),
        ("d3 pixel rows, 1182x886 photo", lambda m: m.qwen_image(photo, D3_PATCH, D3_MERGE, D3_TEMPORAL, D3_MEAN,
                                                                 D3_STD, IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS)[0]),
        ("d3 pixel rows, 720p video frame", lambda m: d3_frame_rows(m, frame)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, help="an earlier runtime/image_transform.py to time against")
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--default-allocator", action="store_true",
                        help="glibc's default allocator, not the server's settings")
    args = parser.parse_args()
    if not args.default_allocator and not release_freed_memory():
        print("not glibc: the allocator's defaults", flush=True)
    modules = {"this": image_transform}
    if args.before:
        modules = {"before": load_before(args.before), **modules}
    for name, run in cases():
        answers = {label: run(module) for label, module in modules.items()}  # warm-up, and the equality check
        if len(answers) == 2 and not np.array_equal(*answers.values()):
            raise SystemExit(f"{name}: the two modules' answers differ")
        times: dict[str, list[float]] = {label: [] for label in modules}
        order = list(modules)
        for i in range(args.repeats):
            for label in order if i % 2 else order[::-1]:
                start = time.perf_counter()
                run(modules[label])
                times[label].append((time.perf_counter() - start) * 1e3)
        parts = [f"{label} {np.median(t):.2f} (min {min(t):.2f})" for label, t in times.items()]
        if len(times) == 2:
            parts.append(f"{np.median(times['before']) / np.median(times['this']):.2f}x")
        print(f"{name}: " + " | ".join(parts), flush=True)


if __name__ == "__main__":
    main()
