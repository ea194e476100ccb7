"""d3 video preprocessing (spec 4.10; appendix D 11): frame sampling and timestamps as the spec's example, OpenCV
decoding, and pixel values equal, bit for bit, to transformers' Qwen3VLVideoProcessor as vLLM configures it."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from scripts.vision_fixtures import FIXTURE, MEAN, STD, VIDEOS, fixture_frames
from systemone.runtime.d3.video import decode_video, qwen_video, sample_indices, timestamps, video_size
from tests.media_helpers import write_video

REFERENCE = np.load(FIXTURE)
SPEC_INDICES = [0, 16, 31, 47, 63, 79, 94, 110, 126, 142, 157, 173, 189, 205, 220, 236, 252, 268, 283, 299]
SPEC_STAMPS = ["0.3", "1.3", "2.4", "3.4", "4.5", "5.5", "6.6", "7.6", "8.7", "9.7"]


def test_spec_example_sampling_and_timestamps():
    """Spec 4.10: 10 s, 300 frames at 30 fps -> 20 frames, these indices, 576x320, these timestamps."""
    indices = sample_indices(300, 30.0)
    assert indices.tolist() == SPEC_INDICES
    assert [f"{t:.1f}" for t in timestamps(tuple(indices.tolist()), 30.0)] == SPEC_STAMPS
    assert video_size(20, 720, 1280) == (320, 576)


@pytest.mark.parametrize("total, fps, count", [(3, 30.0, 3), (10, 30.0, 4), (1000, 30.0, 32), (48, 24.0, 4),
                                               (100, 5.0, 32), (9, 2.0, 9)])
def test_frame_count_rule(total, fps, count):
    """n = min(max(int(total / fps * 2), 4), 32, total)."""
    assert len(sample_indices(total, fps)) == count


def test_opencv_decoding_reads_the_spec_frames(tmp_path):
    """A real 10 s 1280x720 30 fps file decodes to the spec's 20 frame indices."""
    data = write_video(tmp_path / "ten.mp4", frames=300, fps=30.0, width=1280, height=720)
    video = decode_video(data, "videos[0]")
    assert list(video.indices) == SPEC_INDICES and video.fps == pytest.approx(30.0)
    assert video.frames.shape == (20, 720, 1280, 3)


@pytest.mark.parametrize("name", list(VIDEOS))
def test_pixel_values_equal_the_video_processor(name):
    pixels, grid = qwen_video(fixture_frames(name), 16, 2, 2, MEAN, STD)
    assert list(grid) == REFERENCE[f"{name}/grid_thw"].tolist()
    assert np.abs(pixels[:64] - REFERENCE[f"{name}/head"]).max() == 0.0
    assert hashlib.sha256(pixels.astype(np.float32).tobytes()).digest() == REFERENCE[f"{name}/sha256"].tobytes()


def test_single_frame_videos_are_refused():
    with pytest.raises(ValueError, match="t:1 must be larger than temporal_factor:2"):
        video_size(1, 100, 100)
