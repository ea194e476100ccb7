"""d3 videos (spec 4.10): OpenCV decoding (as vLLM's `qwen3_vl` backend decodes), frame sampling at 2 fps
(4 to 32 frames), the per-frame pixel cap of vLLM's Qwen3VLVideoProcessor setup, and one timestamp per frame pair.

OpenCV rather than PyAV because it is what vLLM reads videos with: frame counts, fps and seek behaviour then agree
with the reference (spec 8 Q15).
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import partial

import numpy as np

from ..deadline import Deadline
from ..image_transform import put_normalized, resize_bicubic, rows_shape
from ..media_decode import MAX_IMAGE_PIXELS, decode_image
from ..media_allowance import MediaAllowance, MediaBudget
from ..media_fetch import MediaError, MediaTooLarge, base64_bytes
from ..pixel_workers import PixelWorkers, fill_here
from .frame_plan import Step, plan_reads, sequential_reads

SAMPLE_FPS = 2
MIN_FRAMES, MAX_FRAMES = 4, 32
UNKNOWN_FPS = 24.0
# vLLM's D3ProcessingInfo for Qwen3VLVideoProcessor: size {shortest_edge: 4,096, longest_edge: 200,704 x 32},
# cap_pixels_per_frame, max_video_tokens 196, factor 32, temporal factor 2.
VIDEO_MIN_PIXELS = 4_096
VIDEO_LONGEST_EDGE = 200_704 * 32
MAX_VIDEO_TOKENS = 196


@dataclass(frozen=True)
class SampledVideo:
    frames: tuple[np.ndarray, ...]  # [H, W, 3] uint8 RGB each (not stacked: a copy of every pixel saved)
    indices: tuple[int, ...]  # source frame index of each frame
    fps: float


def sample_indices(total: int, fps: float) -> np.ndarray:
    """Spec 4.10 step 2: n = min(max(int(total / fps * 2), 4), 32, total); rounded linspace (half to even)."""
    n = min(max(int(total / fps * SAMPLE_FPS), MIN_FRAMES), MAX_FRAMES, total)
    return np.linspace(0, total - 1, n).round().astype(int)


def _jpeg_frames(url: str, where: str, allowance: MediaAllowance, pool: Executor | None) -> SampledVideo:
    """`data:video/jpeg;base64,<jpeg>,<jpeg>,...`: every JPEG a frame, fps 2, no sampling (spec 4.10 step 2);
    at most `jpeg_video_frames` of them, each taken from the request's pixel budget; decoded in `pool`'s threads
    where there is one (Pillow releases the GIL while it decodes)."""
    parts = url.split(",")[1:]
    most = allowance.budget.jpeg_video_frames
    if len(parts) > most:
        raise MediaTooLarge(where, f"a JPEG-frame video has {len(parts)} frames, more than the {most} this server "
                                   "reads (--max-jpeg-video-frames)")

    def frame(index: int) -> np.ndarray:
        data = base64_bytes(parts[index], where, f"video frame {index}")
        return decode_image(data, f"{where}: frame {index}", allowance=allowance)

    frames = tuple((pool.map if pool is not None else map)(frame, range(len(parts))))
    if not frames or any(f.shape != frames[0].shape for f in frames):
        raise MediaError(where, "a JPEG-frame video needs at least one frame, all of one size")
    return SampledVideo(frames, tuple(range(len(frames))), float(SAMPLE_FPS))


class _SeekMissed(Exception):
    """A seek read a frame other than the one asked for: the video is read again, one frame after another."""


@dataclass(frozen=True)
class _Stream:
    keyframes: tuple[int, ...]  # frame numbers of the keyframes; empty where a seek would not land true
    frames: int  # packets demuxed (at most the ones needed)


def _demux(path: str, needed: int, fps: float, deadline: Deadline) -> _Stream | None:
    """The keyframes among the first `needed` packets, without decoding any. Seeks are kept only when every
    packet's timestamp names its place in the stream (constant frame rate, no gap): OpenCV numbers frames by
    timestamp after a seek. None where the backend cannot demux alone."""
    import cv2

    demuxer = cv2.VideoCapture(path)
    try:
        if not demuxer.isOpened() or not demuxer.set(cv2.CAP_PROP_FORMAT, -1):
            return None
        keyframes, places, count = [], [], 0
        while count < needed and demuxer.grab():
            place = round(demuxer.get(cv2.CAP_PROP_POS_MSEC) * fps / 1000)
            places.append(place)
            if demuxer.get(cv2.CAP_PROP_LRF_HAS_KEY_FRAME):
                keyframes.append(place)
            count += 1
            if count % 256 == 0:
                deadline.check()
        first = min(places, default=0)
        if sorted(p - first for p in places) != list(range(count)):
            return _Stream((), count)
        return _Stream(tuple(sorted(k - first for k in keyframes)), count)
    finally:
        demuxer.release()


def _read(capture, steps: list[Step], deadline: Deadline) -> tuple[list[np.ndarray], list[int]]:
    """The steps' frames as RGB; a frame that cannot be read is skipped, and the stream's end stops the reading."""
    import cv2

    frames, kept = [], []
    for step in steps:
        if step.seek:
            capture.set(cv2.CAP_PROP_POS_FRAMES, step.index)
        else:
            for _ in range(step.decodes - 1):
                deadline.check()
                if not capture.grab():
                    return frames, kept
        deadline.check()
        if not capture.grab():
            break
        if step.seek and int(capture.get(cv2.CAP_PROP_POS_FRAMES)) != step.index + 1:
            raise _SeekMissed
        ok, frame = capture.retrieve()
        if ok and frame is not None:
            frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
            kept.append(step.index)
    return frames, kept


def _check_decoding(steps: list[Step], pixels: int, where: str, allowance: MediaAllowance) -> None:
    decoded = sum(step.decodes for step in steps) * pixels
    most = allowance.budget.video_decode_pixels
    if decoded > most:
        raise MediaTooLarge(where, f"reading its sampled frames would decode {sum(s.decodes for s in steps):,} "
                                   f"frames ({decoded:,} pixels), more than the {most:,} pixels this server decodes "
                                   "for one video (--max-video-decode-pixels)")


def _decode_sampled(capture, path: str, where: str, allowance: MediaAllowance, deadline: Deadline
                    ) -> tuple[list[np.ndarray], list[int], float]:
    import cv2

    if not capture.isOpened():
        raise MediaError(where, "Could not open video stream")
    total = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
    fps = float(capture.get(cv2.CAP_PROP_FPS)) or UNKNOWN_FPS
    width, height = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)), int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
    if width * height > MAX_IMAGE_PIXELS:
        raise MediaError(where, f"Video frame dimensions {width}x{height} ({width * height} pixels) exceed the "
                                f"maximum of {MAX_IMAGE_PIXELS} pixels.")
    if width * height > allowance.budget.video_frame_pixels:
        raise MediaTooLarge(where, f"Video frame dimensions {width}x{height} ({width * height:,} pixels) exceed "
                                   f"the {allowance.budget.video_frame_pixels:,}-pixel limit of a video frame "
                                   "(--max-video-frame-pixels)")
    if total <= 0:
        raise MediaError(where, "Could not open video stream: it has no frames")
    indices = sample_indices(total, fps).tolist()
    allowance.take_pixels(width * height * len(indices), where, f"{len(indices)} sampled frames of {width}x{height}")
    stream = _demux(path, indices[-1] + 1, fps, deadline)
    steps = (plan_reads(indices, stream.keyframes, stream.frames) if stream is not None
             else sequential_reads(indices, total))
    _check_decoding(steps, width * height, where, allowance)
    try:
        frames, kept = _read(capture, steps, deadline)
    except _SeekMissed:
        steps = sequential_reads(indices, total)
        _check_decoding(steps, width * height, where, allowance)
        capture.open(path)  # from the first frame again
        frames, kept = _read(capture, steps, deadline)
    return frames, kept, fps


def decode_video(data: bytes, where: str, url: str = "", allowance: MediaAllowance | None = None,
                 deadline: Deadline | None = None, pool: Executor | None = None) -> SampledVideo:
    """Video bytes -> the sampled RGB frames, their source indices and the source fps. The frame size (at most
    `video_frame_pixels`), the sampled frames' pixels (from the request's budget) and the pixels decoded to reach
    them (`video_decode_pixels`) are checked from the container before a frame is decoded; only sampled frames are
    kept, and the request's deadline stops the decoding between frames."""
    allowance = allowance or MediaAllowance(MediaBudget())
    deadline = deadline or Deadline()
    if url[:16].lower().startswith("data:video/jpeg"):
        return _jpeg_frames(url, where, allowance, pool)
    import cv2

    with tempfile.NamedTemporaryFile(suffix=".video", delete=False) as f:
        f.write(data)
        path = f.name
    capture = cv2.VideoCapture(path)
    try:
        frames, kept, fps = _decode_sampled(capture, path, where, allowance, deadline)
    finally:
        capture.release()
        os.unlink(path)
    if not frames:
        raise MediaError(where, "Could not read any frame of the video")
    return SampledVideo(tuple(frames), tuple(kept), fps)


def video_size(frames: int, height: int, width: int, factor: int = 32, temporal: int = 2) -> tuple[int, int]:
    """Spec 4.10 step 3: the video smart resize with the per-frame cap, one size for all frames."""
    if frames < temporal:
        raise ValueError(f"t:{frames} must be larger than temporal_factor:{temporal}")
    per_frame = max(min(MAX_VIDEO_TOKENS * factor * factor, VIDEO_LONGEST_EDGE // frames),
                    int(VIDEO_MIN_PIXELS * 1.05))
    max_pixels = per_frame * frames
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < VIDEO_MIN_PIXELS:
        beta = math.sqrt(VIDEO_MIN_PIXELS / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def frame_places(frames: int, temporal: int) -> list[range]:
    """Where each frame goes in the pixel rows: its own place, and the last frame also in the places that pad the
    count to whole temporal groups (spec 4.10)."""
    return [range(i, i + 1) for i in range(frames - 1)] + [range(frames - 1, frames + -frames % temporal)]


def fill_video_rows(frames: Sequence[np.ndarray], rows: np.ndarray, part: tuple[int, int],
                    stopped: Callable[[], bool], *, height: int, width: int, patch: int, merge: int, temporal: int,
                    mean: tuple[float, ...], std: tuple[float, ...]) -> None:
    """Frames [first, last) of `part` resized, normalized and written into their places in `rows` (a `Fill` of
    runtime/pixel_workers.py); stops between frames once `stopped()`."""
    places = frame_places(len(frames), temporal)
    for index in range(*part):
        if stopped():
            return
        put_normalized(rows, places[index], resize_bicubic(frames[index], height, width), patch, merge, temporal,
                       mean, std)


def qwen_video(frames: Sequence[np.ndarray], patch: int, merge: int, temporal: int, mean: tuple[float, ...],
               std: tuple[float, ...], workers: PixelWorkers | None = None, deadline: Deadline | None = None
               ) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Sampled frames -> (pixel_values rows, grid (t, h, w)): every frame resized to one size, normalized and
    written into its place in the rows; an odd count padded with the last frame (spec 4.10). With `workers`, the
    frames go through them a temporal group at a time (in worker processes where it has them), each into its own
    rows, so no stack of frames is made."""
    height, width = video_size(len(frames), *frames[0].shape[:2], patch * merge, temporal)
    shape = rows_shape(len(frames), height, width, frames[0].shape[2], patch, temporal)
    fill = partial(fill_video_rows, height=height, width=width, patch=patch, merge=merge, temporal=temporal,
                   mean=mean, std=std)
    grid = (-(-len(frames) // temporal), height // patch, width // patch)
    parts = [(first, min(first + temporal, len(frames))) for first in range(0, len(frames), temporal)]
    run = workers.fill if workers is not None else fill_here
    return run(fill, frames, shape, parts, deadline or Deadline()), grid


def timestamps(indices: tuple[int, ...], fps: float, temporal: int = 2) -> tuple[float, ...]:
    """One per temporal group: indices padded to even with the last, each pair's mean time in seconds."""
    padded = list(indices) + [indices[-1]] * (-len(indices) % temporal)
    seconds = [i / fps for i in padded]
    return tuple((seconds[i] + seconds[i + temporal - 1]) / 2 for i in range(0, len(seconds), temporal))
