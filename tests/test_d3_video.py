"""d3 video preprocessing (spec 4.10; appendix D 11): frame sampling and timestamps as the spec's example, OpenCV
decoding, and pixel values equal, bit for bit, to transformers' Qwen3VLVideoProcessor as vLLM configures it."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from tests.vision_fixtures import FIXTURE, MEAN, STD, VIDEOS, fixture_frames
from systemone.models.errors import TimedOut
from systemone.runtime.d3.frame_plan import plan_reads
from systemone.runtime.d3.video import decode_video, qwen_video, sample_indices, timestamps, video_size
from systemone.runtime.deadline import Deadline
from systemone.runtime.media_allowance import MediaAllowance, MediaBudget
from systemone.runtime.media_errors import MediaTooLarge
from systemone.runtime.pixel_workers import PixelWorkers
from systemone.server.errors import http_status
from tests.media_helpers import with_one_keyframe, write_video

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
    assert len(video.frames) == 20 and {f.shape for f in video.frames} == {(720, 1280, 3)}


@pytest.mark.parametrize("workers", ["none", "threads", "processes"])
@pytest.mark.parametrize("name", list(VIDEOS))
def test_pixel_values_equal_the_video_processor(name, workers, pixel_processes):
    """Bit for bit, whether the frames are resized one after another, in threads, or in worker processes."""
    pool = {"none": None, "threads": PixelWorkers(0, threads=3), "processes": pixel_processes}[workers]
    pixels, grid = qwen_video(fixture_frames(name), 16, 2, 2, MEAN, STD, pool)
    assert list(grid) == REFERENCE[f"{name}/grid_thw"].tolist()
    assert np.abs(pixels[:64] - REFERENCE[f"{name}/head"]).max() == 0.0
    assert hashlib.sha256(pixels.astype(np.float32).tobytes()).digest() == REFERENCE[f"{name}/sha256"].tobytes()


def test_single_frame_videos_are_refused():
    with pytest.raises(ValueError, match="t:1 must be larger than temporal_factor:2"):
        video_size(1, 100, 100)


# -- decoding only what sampling needs (docs/operations.md: bounds under hostile load) ----------------------
def _one_after_another(path):
    """Spec 4.10 step 2 as the reference reads: grab every frame up to the last sampled one, retrieve the sampled."""
    import cv2

    capture = cv2.VideoCapture(str(path))
    total, fps = int(capture.get(cv2.CAP_PROP_FRAME_COUNT)), capture.get(cv2.CAP_PROP_FPS)
    wanted, frames = sample_indices(total, fps).tolist(), {}
    for index in range(wanted[-1] + 1):
        assert capture.grab()
        if index in wanted:
            frames[index] = cv2.cvtColor(capture.retrieve()[1], cv2.COLOR_BGR2RGB)
    capture.release()
    return frames


@pytest.mark.parametrize("codec, name", [("MJPG", "long.avi"), ("mp4v", "long.mp4")])
def test_seeking_reads_the_frames_that_reading_one_after_another_reads(tmp_path, codec, name):
    """1,200 frames, 32 sampled ~39 apart: seeks skip most frames, and land on the very same pixels."""
    data = write_video(tmp_path / name, frames=1200, fps=30.0, width=320, height=240, codec=codec)
    expected = _one_after_another(tmp_path / name)
    video = decode_video(data, "videos[0]")
    assert list(video.indices) == list(expected) == sample_indices(1200, 30.0).tolist()
    for frame, index in zip(video.frames, video.indices):
        assert np.array_equal(frame, expected[index])


def test_the_pixels_decoded_for_one_video_are_bounded_before_decoding(tmp_path):
    """MJPEG: frame 0, then 31 seeks of 17 decoded frames each, not the 1,200 a read one after another would; a
    budget below even that is a 413 naming the flag."""
    data = write_video(tmp_path / "long.avi", frames=1200, fps=30.0, width=320, height=240, codec="MJPG")
    frame = 320 * 240
    video = decode_video(data, "videos[0]", allowance=MediaAllowance(MediaBudget(video_decode_pixels=600 * frame)))
    assert len(video.indices) == 32
    with pytest.raises(MediaTooLarge, match=r"decode 528 frames .* \(--max-video-decode-pixels\)") as info:
        decode_video(data, "videos[1]", allowance=MediaAllowance(MediaBudget(video_decode_pixels=500 * frame)))
    assert http_status(info.value)[0] == 413 and info.value.message.startswith("media: videos[1]: ")


def test_a_stream_with_one_keyframe_is_read_on_and_its_decoding_counted_before_it_starts(tmp_path):
    """The same 1,200 frames of mp4v (a keyframe every 12), and with its container saying frame 0 is the only
    keyframe (a long GOP): seeking would decode from the start each time, so the stream is read on, 1,200 frames
    decoded against 700; the same sampled pixels either way; and a budget between the two refuses only the long
    GOP, before a frame is decoded."""
    data = write_video(tmp_path / "long.mp4", frames=1200, fps=30.0, width=320, height=240)
    long_gop = with_one_keyframe(data)
    frame = 320 * 240
    budget = MediaAllowance(MediaBudget(video_decode_pixels=800 * frame))
    short, long = decode_video(data, "videos[0]", allowance=budget), decode_video(long_gop, "videos[0]")
    assert list(short.indices) == list(long.indices) == sample_indices(1200, 30.0).tolist()
    assert all(np.array_equal(a, b) for a, b in zip(short.frames, long.frames, strict=True))
    with pytest.raises(MediaTooLarge, match=r"decode 1,200 frames .* \(--max-video-decode-pixels\)") as info:
        decode_video(long_gop, "videos[1]", allowance=MediaAllowance(MediaBudget(video_decode_pixels=800 * frame)))
    assert http_status(info.value)[0] == 413 and info.value.message.startswith("media: videos[1]: ")


def test_an_abandoned_request_stops_the_decoding(tmp_path):
    data = write_video(tmp_path / "ten.mp4", frames=300, fps=30.0, width=320, height=240)
    deadline = Deadline()
    deadline.cancel()
    with pytest.raises(TimedOut):
        decode_video(data, "videos[0]", deadline=deadline)


@pytest.mark.parametrize("keyframes, seeks, decodes", [
    (range(1200), [False] + [True] * 31, 1 + 31 * 17),  # intra-only: each seek decodes 16 lead frames + its own
    ((0,), [False] * 32, 1200),  # one keyframe: a seek would decode from the start, so read on
])
def test_each_sampled_frame_is_reached_the_cheaper_way(keyframes, seeks, decodes):
    steps = plan_reads(sample_indices(1200, 30.0).tolist(), tuple(keyframes), 1200)
    assert [s.index for s in steps] == sample_indices(1200, 30.0).tolist()
    assert [s.seek for s in steps] == seeks and sum(s.decodes for s in steps) == decodes


def test_with_a_keyframe_every_12_frames_no_sampled_frame_costs_more_than_a_seek():
    steps = plan_reads(sample_indices(1200, 30.0).tolist(), tuple(range(0, 1200, 12)), 1200)
    assert max(s.decodes for s in steps) <= 16 + 12 and sum(s.decodes for s in steps) < 1200


def test_a_stream_shorter_than_its_header_is_read_to_its_end():
    assert [s.index for s in plan_reads([0, 50, 99], (0,), 60)] == [0, 50]
