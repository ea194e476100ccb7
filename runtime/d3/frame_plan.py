"""How to reach a video's sampled frames while decoding as few as possible.

OpenCV's `grab()` still decodes the frame it skips (only the colour conversion of `retrieve()` is saved), so reading
frame 3,000 one frame after another decodes 3,000 frames. A seek (`CAP_PROP_POS_FRAMES`) lands on the keyframe at or
before `target - 16` and decodes forward from there, so its cost is set by where the keyframes are: cheap for
intra-only codecs (MJPEG: every frame is a keyframe), ruinous for a stream with a single keyframe. The keyframes
come from a demux-only pass (no decoding); each sampled frame is then reached whichever way decodes fewer frames.
A seek is planned only where OpenCV's frame numbers (from timestamps) are the frames' places in the stream, so it
lands on the frame that reading one after another would reach.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

# OpenCV's FFmpeg seek (CvCapture_FFMPEG::seek) first seeks 16 frames before its target, then decodes forward.
OPENCV_SEEK_LEAD = 16


@dataclass(frozen=True)
class Step:
    index: int  # the sampled frame this step reads
    seek: bool  # seek to it; else grab forward from where the previous step left off
    decodes: int  # frames decoded to read it (itself included)


def plan_reads(indices: Sequence[int], keyframes: Sequence[int], frames: int) -> list[Step]:
    """A step per sampled index (ascending) that the stream's `frames` packets can reach; `keyframes` are the
    ascending packet numbers of its keyframes (packet order stands in for display order: a codec that reorders
    frames shifts the estimate by its reorder depth, a few frames)."""
    steps, position = [], 0  # position: the frame the next grab decodes
    for index in indices:
        if index >= frames:
            break  # the stream ends before it, as reading one frame after another would find
        forward = index - position + 1
        lead = max(index - OPENCV_SEEK_LEAD, 0)
        keyframe = keyframes[bisect_right(keyframes, lead) - 1] if keyframes and keyframes[0] <= lead else 0
        by_seek = index - keyframe + 1
        seek = by_seek < forward
        steps.append(Step(index, seek, by_seek if seek else forward))
        position = index + 1
    return steps


def sequential_reads(indices: Sequence[int], frames: int) -> list[Step]:
    """Every frame up to the last sampled one, one after another (what the reference does): with no keyframe
    known, a seek never pays."""
    return plan_reads(indices, (), frames)
