"""Where the time of one seeds'-mix image request and one video request goes, stage by stage: the load generator's
own bodies (systemone/loadgen.py: request 3 is its first image, a 1280x960 photo with 4 questions; request 4 its
first video, 20 JPEG frames of 1280x720 in a `data:video/jpeg` URL, 1 question) through the functions the server
calls, each stage timed on its own, with ARTIFACT's graphs on --device (`body`: its memory bound, JSON parse and
check, and the request's validation). The `load` row is the media encoder's own `load_one` (fetch, decode and
preprocess in one call, as the media pool runs it): the stages above it should add up to it. --mp4 adds the same
20 frames as a 10 s, 30 fps MPEG-4 file (what a client more often sends): the container is demuxed once to find
the keyframes, then the sampled frames are decoded.

Median (min) milliseconds of --repeats runs after one warm-up run; the machine's other load shows in the medians.
The process runs as the server's does: glibc's allocator as `systemone serve` sets it (server/allocator.py; or
--default-allocator), one BLAS thread in each media thread (runtime/blas_threads.py), the main thread included,
and the pixel rows (resize, normalize) made in --media-processes worker processes (0: in threads here).
--throughput N... then loads the video N at a time in as many threads (the media pool's way) and reports loads a
second: how media scales over the machine's cores.

    python scripts/media_timing.py ARTIFACT [--device cpu] [--repeats 5] [--mp4] [--media-processes N]
        [--default-allocator] [--throughput 1 4 8]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")
STAGES = ("body", "fetch", "demux", "frame decode", "pixel rows", "load", "prompts",
          "vision graph", "text graph")


class Stopwatch:
    """Milliseconds per stage, one list per stage over the runs."""

    def __init__(self) -> None:
        self.ms: dict[str, list[float]] = defaultdict(list)

    def time(self, stage: str, fn: Callable[[], T]) -> T:
        start = time.perf_counter()
        out = fn()
        self.ms[stage].append((time.perf_counter() - start) * 1000)
        return out

    def cell(self, stage: str, skip: int) -> str:
        values = self.ms.get(stage, [])[skip:]
        return f"{np.median(values):8.1f} ({min(values):7.1f})" if values else ""


def mp4_body(body: dict[str, Any], frames: list[bytes]) -> dict[str, Any]:
    """The video request with its frames as a 10 s, 30 fps MPEG-4 file (each frame held 15 frames)."""
    import cv2

    from systemone.runtime.media_decode import decode_image

    rgb = [decode_image(f, "frame") for f in frames]
    height, width = rgb[0].shape[:2]
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "clip.mp4")
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), 30.0, (width, height))
        for frame in rgb:
            for _ in range(15):
                writer.write(np.ascontiguousarray(frame[..., ::-1]))
        writer.release()
        data = Path(path).read_bytes()
    return dict(body, videos=["data:video/mp4;base64," + base64.b64encode(data).decode()])


def run_once(service: Any, raw: bytes, watch: Stopwatch) -> dict[str, Any]:
    """One request through every stage; its shape (for the header)."""
    from systemone.runtime.d3 import video as d3_video
    from systemone.runtime.deadline import Deadline
    from systemone.runtime.image_transform import qwen_image
    from systemone.runtime.media_allowance import MediaAllowance
    from systemone.runtime.media_decode import decode_image
    from systemone.runtime.media_encoder import LoadedMedia
    from systemone.runtime.media_fetch import base64_bytes, fetch
    from systemone.server.body import parse_json
    from systemone.server.body_memory import parsed_size_bound

    engine, encoder = service.engine, service.engine.media

    def body() -> tuple[Any, Any]:
        parsed_size_bound(raw)  # the server charges the body this bound before it parses it
        return service.validate(parse_json(raw))

    request, questions = watch.time("body", body)
    (key, where), = encoder.jobs(request)
    kind, url = key
    temporal = encoder.temporal
    pixels = service.media_pool.pixels
    if kind == "image":
        data = watch.time("fetch", lambda: fetch(url, where, kind, encoder.policy))
        frames = watch.time("frame decode", lambda: [decode_image(data, where)])
        _, grid = watch.time("pixel rows", lambda: qwen_image(frames[0], encoder.patch, encoder.merge, temporal,
                                                               encoder.mean, encoder.std, *_image_pixels(), pixels))
    else:
        if url[:16].lower().startswith("data:video/jpeg"):
            parts = watch.time("fetch", lambda: [base64_bytes(p, where, "frame") for p in url.split(",")[1:]])
            frames = watch.time("frame decode", lambda: [decode_image(p, where) for p in parts])
        else:
            data = watch.time("fetch", lambda: fetch(url, where, kind, encoder.policy))
            watch.time("demux", lambda: demux_once(data))
            frames = watch.time("frame decode", lambda: d3_video.decode_video(data, where).frames)
        _, grid = watch.time("pixel rows", lambda: d3_video.qwen_video(frames, encoder.patch, encoder.merge, temporal,
                                                                       encoder.mean, encoder.std, pixels))
    item = watch.time("load", lambda: encoder.load_one(key, where, Deadline(),
                                                       MediaAllowance(service.media_pool.budget), pixels))
    prepared = watch.time("prompts", lambda: engine.prepare(request, questions, LoadedMedia([key], {key: item})))
    encoded = watch.time("vision graph", lambda: engine.encode_media(prepared))
    watch.time("text graph", lambda: engine.run_rows(engine.rows(prepared, encoded)))
    return {"questions": len(questions), "prompt tokens": sum(len(p.token_ids) for p in prepared.prompts),
            "source": "x".join(map(str, (len(frames), *frames[0].shape[:2]))),
            "resized to": f"{grid[1] * encoder.patch}x{grid[2] * encoder.patch}",
            "grid": "x".join(map(str, item.grid))}


def _image_pixels() -> tuple[int, int]:
    from systemone.runtime.d3.media import IMAGE_MAX_PIXELS, IMAGE_MIN_PIXELS

    return IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS


def demux_once(data: bytes) -> None:
    """The keyframe pass decode_video makes before it decodes (runtime/d3/video.py), on the same file."""
    import cv2

    from systemone.runtime.d3.video import _demux as demux
    from systemone.runtime.deadline import Deadline

    with tempfile.NamedTemporaryFile(suffix=".video") as f:
        f.write(data)
        f.flush()
        capture = cv2.VideoCapture(f.name)
        total, fps = int(capture.get(cv2.CAP_PROP_FRAME_COUNT)), capture.get(cv2.CAP_PROP_FPS)
        capture.release()
        demux(f.name, total, fps, Deadline())


def main() -> None:
    sys.path.append(str(Path(__file__).resolve().parents[1]))
    from systemone.loadgen import RequestMix
    from systemone.runtime.artifact import Artifact
    from systemone.runtime.blas_threads import one_blas_thread
    from systemone.runtime.pixel_workers import default_processes
    from systemone.server.allocator import release_freed_memory
    from systemone.runtime.engine import EngineOptions
    from systemone.runtime.service import DecisionService

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mp4", action="store_true", help="also the video as an MPEG-4 file")
    parser.add_argument("--media-processes", type=int, default=None,
                        help="processes that make pixel rows, as serve's flag (default: all cores but two, at most 16; none below 6 cores)")
    parser.add_argument("--default-allocator", action="store_true",
                        help="glibc's default allocator, not the server's settings")
    parser.add_argument("--throughput", type=int, nargs="*", default=[],
                        help="video loads at once (each in its own thread) for a loads-a-second figure")
    args = parser.parse_args()

    allocator = "glibc defaults" if args.default_allocator else (
        "the server's" if release_freed_memory() else "not glibc: defaults")
    one_blas_thread()  # the stages below run in this thread, as the media pool runs them in its own
    processes = default_processes() if args.media_processes is None else args.media_processes
    service = DecisionService(Artifact.load(args.artifact), EngineOptions(device=args.device),
                              media_processes=processes)
    service.warm_up()  # this thread times the graphs: their CUDA graphs are captured here
    service.media_pool.start()
    if service.artifact.manifest.family != "d3":
        raise SystemExit("the seeds' video requests need a d3 artifact")
    mix = RequestMix("d3")
    bodies = {"image": mix.body(3)[1], "video": mix.body(4)[1]}
    if args.mp4:
        frames = [base64.b64decode(p) for p in bodies["video"]["videos"][0].split(",")[1:]]
        bodies["video mp4"] = mp4_body(bodies["video"], frames)
    print(f"{args.artifact} on {service.provider}, {os.cpu_count()} CPUs, "
          f"media: {service.media_pool.describe()}; numpy {np.__version__}; allocator {allocator}; "
          f"median (min) ms of {args.repeats} runs")
    watches = {}
    for name, body in bodies.items():
        raw = json.dumps(body).encode()
        watch = Stopwatch()
        for _ in range(args.repeats + 1):
            shape = run_once(service, raw, watch)
        watches[name] = watch
        print(f"{name}: body {len(raw) / 1e6:.1f} MB, " + ", ".join(f"{k} {v}" for k, v in shape.items()))
    print(f"\n{'stage':14s}" + "".join(f"{name:>20s}" for name in watches))
    for stage in STAGES:
        print(f"{stage:14s}" + "".join(f"{w.cell(stage, 1):>20s}" for w in watches.values()))
    for name in ("video", "video mp4"):
        if args.throughput and name in bodies:
            print(f"\n{name} loads a second (load_one, each load in its own thread):")
            for at_once in args.throughput:
                print(f"  {at_once:3d} at once: {load_rate(service, json.dumps(bodies[name]).encode(), at_once):7.1f}")


def load_rate(service: Any, raw: bytes, at_once: int, rounds: int = 3) -> float:
    """Loads a second with `at_once` loads of the body's media in flight, over `rounds` rounds after a warm-up."""
    from systemone.runtime.blas_threads import one_blas_thread
    from systemone.runtime.deadline import Deadline
    from systemone.runtime.media_allowance import MediaAllowance
    from systemone.server.body import parse_json

    encoder = service.engine.media
    (key, where), = encoder.jobs(service.validate(parse_json(raw))[0])

    def load(_: int) -> None:
        encoder.load_one(key, where, Deadline(), MediaAllowance(service.media_pool.budget), service.media_pool.pixels)

    with ThreadPoolExecutor(at_once, initializer=one_blas_thread) as pool:
        list(pool.map(load, range(at_once)))
        start = time.perf_counter()
        list(pool.map(load, range(at_once * rounds)))
        return at_once * rounds / (time.perf_counter() - start)


if __name__ == "__main__":
    main()
