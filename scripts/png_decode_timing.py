"""Where a PNG's decode goes: the bench's 1024x1024 image (noise, which does not compress; `systemone bench`'s
image requests) and a screenshot-like 1920x1080 one (flat panels and lines, which compress 50-fold) decoded by the
runtime (runtime/media_decode.py: libdeflate inflates the data, Pillow unfilters it) and by Pillow alone,
alternating, beside OpenCV's decode and the two inflates of the data alone. Medians, ms. Then how long a thread
beside the decode waits for the GIL at most, while the bench's PNG is stored again and while zlib inflates it
(a media worker decodes beside the engine thread).

    python scripts/png_decode_timing.py [--repeats 25]
"""

from __future__ import annotations

import argparse
import base64
import statistics
import threading
import time
import zlib
from collections.abc import Callable

import cv2
import deflate
import numpy as np
from PIL import Image

from systemone.runtime.png_inflate import _chunks

from systemone.export.sample_media import _encoded, image_url
from systemone.runtime import media_decode, png_inflate
from systemone.runtime.media_decode import decode_image
from systemone.runtime.png_inflate import stored_png


def timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return (time.perf_counter() - start) * 1e3


def pillow_alone(png: bytes) -> np.ndarray:
    """decode_image with Pillow inflating the data itself, as before libdeflate."""
    kept, media_decode.stored_png = media_decode.stored_png, lambda data: None
    try:
        return decode_image(png, "images[0]")
    finally:
        media_decode.stored_png = kept


def longest_wait(work: Callable[[], object], times: int = 20) -> float:
    """The longest gap, ms, between two steps of a Python loop on this thread while `work` runs `times` times on
    another: how long that work keeps the GIL at a stretch."""
    worker = threading.Thread(target=lambda: [work() for _ in range(times)])
    longest, last = 0.0, time.perf_counter()
    worker.start()
    while worker.is_alive():
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
        sum(range(200))
    worker.join()
    return longest * 1e3


def screenshot() -> bytes:
    """Flat panels, a grid of lines and a few coloured blocks, as a page or an app window renders."""
    rgb = np.full((1080, 1920, 3), 246, np.uint8)
    rgb[:64] = (32, 48, 72)
    rgb[64:, :280] = (236, 238, 242)
    rgb[120::36, 300:1880] = 210
    rgb[100:1040, 300::160] = 200
    rng = np.random.default_rng(3)
    for y, x in rng.integers(0, 24, (40, 2)):
        rgb[120 + 36 * y:148 + 36 * y, 300 + 64 * x:340 + 64 * x] = rng.integers(0, 256, 3)
    return base64.b64decode(_encoded(rgb, "PNG"))


def cases(png: bytes) -> dict[str, Callable[[], object]]:
    """What to time; where the runtime leaves the PNG to Pillow (runtime/png_inflate.py), the stored PNG too."""
    assert np.array_equal(decode_image(png, "x"), pillow_alone(png))
    idat = b"".join(png[start + 8:end - 4] for kind, start, end in _chunks(png) if kind == b"IDAT")
    size = len(zlib.decompress(idat))
    stored = stored_png(png)
    if stored is None:  # the runtime's decode is Pillow's; how the stored form would do, for the threshold
        with_inflation = png_inflate.MAX_INFLATION
        png_inflate.MAX_INFLATION = size
        stored = stored_png(png)
        png_inflate.MAX_INFLATION = with_inflation
    return {
        "decode_image, the runtime's": lambda: decode_image(png, "images[0]"),
        "decode_image as before (Pillow alone)": lambda: pillow_alone(png),
        "  stored_png: inflated by libdeflate and stored again (or None)": lambda: stored_png(png),
        "  Pillow decoding the stored PNG (for the screenshot, had it been stored)": lambda: pillow_alone(stored),
        f"zlib {zlib.ZLIB_RUNTIME_VERSION}'s inflate of the data alone": lambda: zlib.decompress(idat),
        "libdeflate's inflate of the data alone": lambda: deflate.zlib_decompress(idat, size),
        "cv2.imdecode, for comparison": lambda: cv2.imdecode(np.frombuffer(png, np.uint8), cv2.IMREAD_COLOR),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=25)
    args = parser.parse_args()
    print(f"# python scripts/png_decode_timing.py --repeats {args.repeats}; Pillow {Image.__version__}")
    images = {"the bench's 1024x1024 PNG of noise":
              base64.b64decode(image_url(1024, 1024, seed=7, fmt="PNG").split(",", 1)[1]),
              "a screenshot-like 1920x1080 PNG": screenshot()}
    for title, png in images.items():
        runs = cases(png)
        timings: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.repeats):  # the cases alternate, so a slow moment of the machine falls on all of them
            for name, run in runs.items():
                timings[name].append(timed(run))
        inflates = len(stored_png(png) or b"") or None
        print(f"{title}: {len(png):,} B; " + ("stored again by the runtime" if inflates else
                                              f"left to Pillow (it inflates over {png_inflate.MAX_INFLATION}-fold)"))
        for name, values in timings.items():
            print(f"  {name}: {statistics.median(values):.2f} (min {min(values):.2f})")
    png = images["the bench's 1024x1024 PNG of noise"]
    idat = b"".join(png[start + 8:end - 4] for kind, start, end in _chunks(png) if kind == b"IDAT")
    print("the longest wait of a thread beside, for the GIL, ms: while the bench's PNG is stored again "
          f"{longest_wait(lambda: stored_png(png)):.2f}; while zlib inflates its data "
          f"{longest_wait(lambda: zlib.decompress(idat)):.2f}")


if __name__ == "__main__":
    main()
