"""d3 images and videos end to end (spec 4.8-4.11, 6.1; decision 6): decoded like vLLM, read once per
request, answers equal to the torch model's (transformers' whole Qwen3_5Model) on the same inputs."""

from __future__ import annotations

import base64
import hashlib

import numpy as np
import pytest
from PIL import Image

from tests.vision_fixtures import fixture_image
from systemone.export.d3.config import D3ExportConfig
from systemone.models.family import Readout
from systemone.models.questions import first_argmax
from systemone.runtime.artifact import Artifact
from systemone.runtime.d3.media import IMAGE_MAX_PIXELS, IMAGE_MIN_PIXELS
from systemone.runtime.d3.video import decode_video, qwen_video
from systemone.runtime.engine import EngineOptions
from systemone.runtime.image_transform import qwen_image
from systemone.runtime.media_decode import decode_image
from systemone.runtime.media_fetch import FetchPolicy
from systemone.runtime.service import DecisionService
from tests.media_helpers import CountingServer, data_url, encoded, test_images, write_video

IMAGES = test_images()
QUESTIONS = [
    {"type": "noul", "instructions": "Is there a person in the picture?"},
    {"type": "choice", "instructions": "What is shown?", "criteria": {"animal": None, "document": "text, forms",
                                                                      "landscape": None, "chart": "a plot"}},
    {"type": "score", "instructions": "How bright is it?", "criteria": ["dark", "dim", "normal", "bright"]},
    {"type": "noul", "criteria": {"true": "the image is rotated", "false": "upright"}},
    {"type": "choice", "criteria": {f"color {i}": None for i in range(12)}},
    {"type": "score", "criteria": [f"level {i}" for i in range(10)]},
    {"type": "choice", "instructions": {"task": "orientation"}, "criteria": {"portrait": None, "landscape": None}},
]


def requests_over_images():
    names = list(IMAGES)
    bodies = []
    for i, name in enumerate(names):
        images = [data_url(IMAGES[name])]
        if i % 3 == 2:  # some requests carry two images
            images.append(data_url(IMAGES[names[(i + 1) % len(names)]]))
        state = None if i % 2 else {"caption": f"photo {i}", "source": name}
        bodies.append({"state": state, "images": images,
                       "questions": {f"{name}/q{j}": q for j, q in enumerate(QUESTIONS)}})
    return bodies


def compare(service, body, reference_logits) -> tuple[int, float]:
    """The runtime's answers vs the torch model's on each question's prompt: picks must agree; returns the
    question count and max |dp|."""
    answers = service.decide(body)["answers"]
    worst, count = 0.0, 0
    for prompt in service.render(body):
        question = prompt.question
        want = service.family.read(question, service.family.labels(question, None),
                                   Readout(dict(enumerate(reference_logits(prompt).tolist())))).probs
        got = list(answers[prompt.question.id]["probabilities"].values())
        assert first_argmax(got) == first_argmax(want), prompt.question.id
        worst = max(worst, float(np.abs(np.array(got) - np.array(want)).max()))
        count += 1
    return count, worst


@pytest.fixture(scope="module")
def reference(d3_checkpoint):
    """The torch model, its vision tower run once per media: a request's questions share its images, and the tower
    is a pure function of the pixels (the text model still reads every question's whole prompt)."""
    config = D3ExportConfig(d3_checkpoint)
    model = config.model
    encode, kept = model.get_image_features, {}

    def once_per_media(pixel_values, image_grid_thw=None, **named):  # get_image_features' own signature
        key = (hashlib.sha256(pixel_values.detach().cpu().numpy().tobytes()).hexdigest(),
               repr(image_grid_thw.tolist()), repr(sorted(named.items())))
        if key not in kept:
            kept[key] = encode(pixel_values, image_grid_thw, **named)
        return kept[key]

    model.get_image_features = once_per_media  # videos are encoded through it too
    return config


def test_images_match_the_torch_model(d3_service, reference):
    """>= 60 questions over >= 8 images: every pick equal, max |dp| <= 1e-4."""
    worst, count = 0.0, 0
    for body in requests_over_images():
        rgb = [decode_image(base64.b64decode(url.split(",", 1)[1]), "x") for url in body["images"]]
        processed = [qwen_image(x, 16, 2, 2, (0.5,) * 3, (0.5,) * 3, IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS) for x in rgb]
        images = (np.concatenate([p for p, _ in processed]), [grid for _, grid in processed])
        n, dp = compare(d3_service, body, lambda prompt: reference.reference_logits_with_media(
            prompt.token_ids, prompt.positions, images))
        count, worst = count + n, max(worst, dp)
    print(f"\nimages: {count} questions over {len(IMAGES)} images, max |dp| {worst:.2e}")
    assert count >= 60 and len(IMAGES) >= 8
    assert worst <= 1e-4


def test_spec_token_counts_in_the_prompt(d3_service):
    """Spec 4.9: 1920x1080 -> 1,590 image tokens; 50x50 -> 64 (upscaled to the 65,536-pixel floor)."""
    pad = d3_service.artifact.tokenizer.token_id("<|image_pad|>")
    for name, tokens in (("wide-1920x1080.png", 1590), ("tiny-50x50.png", 64)):
        (prompt,) = d3_service.render({"state": "x", "images": [data_url(IMAGES[name])],
                                       "questions": {"q": QUESTIONS[0]}})
        assert prompt.token_ids.count(pad) == tokens


def test_decoding_applies_exif_and_composites_transparency_on_white():
    assert decode_image(IMAGES["exif-rotated.jpg"], "x").shape == (64, 128, 3)
    rgba = decode_image(IMAGES["rgba-160x96.png"], "x")
    assert (rgba[:, :80] == 255).all() and rgba.shape == (96, 160, 3)
    palette = decode_image(IMAGES["palette-640x480.png"], "x")
    assert palette.shape == (480, 640, 3)


def test_one_fetch_and_one_vision_pass_per_media(d3_artifact, tmp_path):
    """8 questions over 2 images and 1 video: each is fetched once and encoded once (on the CPU the video once per
    frame group), whatever the number of questions."""
    video = write_video(tmp_path / "v.mp4", frames=40, fps=20.0, width=320, height=240)  # 4 frames, 2 groups
    server = CountingServer({"a.png": IMAGES["vga-640x480.jpg"], "b.png": IMAGES["tiny-50x50.png"], "v.mp4": video})
    options = EngineOptions(device="cpu", fetch_policy=FetchPolicy(allow_private_hosts=True))
    service = DecisionService(Artifact.load(d3_artifact), options)
    with server.running():
        body = {"state": "x", "images": [f"{server.url}/a.png", f"{server.url}/b.png"],
                "videos": [f"{server.url}/v.mp4"],
                "questions": {f"q{i}": QUESTIONS[i % len(QUESTIONS)] for i in range(8)}}
        before = service.engine.vision_session.runs
        response = service.decide(body)
        assert len(response["answers"]) == 8
        assert dict(server.gets) == {"a.png": 1, "b.png": 1, "v.mp4": 1}
        assert service.engine.vision_session.runs - before == 2 + 2
        # The same URL twice in one request: one fetch, one vision pass, rows for both placeholders.
        twice = {"state": "x", "images": [f"{server.url}/a.png", f"{server.url}/a.png"],
                 "questions": {"q": QUESTIONS[0]}}
        before = service.engine.vision_session.runs
        prepared = service.prepare(twice)  # reads the media; the vision graph runs when the request is answered
        service.answer(prepared)
        (prompt,) = prepared.prompts
    assert server.gets["a.png"] == 2 and service.engine.vision_session.runs - before == 1
    assert prompt.token_ids.count(service.artifact.tokenizer.token_id("<|image_pad|>")) == 2 * 300


def test_a_media_host_that_fails_for_a_moment_gets_the_answers_a_healthy_one_gets(d3_artifact, tmp_path):
    """Spec 6.1: a 5xx and a connection cut are tried again; the request is answered as if they had not happened,
    each item fetched until it loads and encoded once."""
    video = write_video(tmp_path / "v.mp4", frames=40, fps=20.0, width=320, height=240)
    files = {"a.png": IMAGES["vga-640x480.jpg"], "v.mp4": video}
    healthy = CountingServer(files)
    flaky = CountingServer(files, failures={"a.png": [503, "drop"], "v.mp4": ["short"]})
    options = EngineOptions(device="cpu", fetch_policy=FetchPolicy(allow_private_hosts=True, retry_pause_s=0.02))
    service = DecisionService(Artifact.load(d3_artifact), options)
    answers = []
    for server in (healthy, flaky):
        with server.running():
            body = {"state": "x", "images": [f"{server.url}/a.png"], "videos": [f"{server.url}/v.mp4"],
                    "questions": {f"q{i}": QUESTIONS[i % len(QUESTIONS)] for i in range(3)}}
            answers.append(service.decide(body)["answers"])
    assert dict(flaky.gets) == {"a.png": 3, "v.mp4": 2} and dict(healthy.gets) == {"a.png": 1, "v.mp4": 1}
    assert answers[1] == answers[0]


def video_requests(tmp_path):
    """4 videos: different fps, lengths and sizes; one with an odd frame count; one as JPEG frames."""
    files = {"fast.mp4": write_video(tmp_path / "fast.mp4", frames=90, fps=30.0, width=640, height=360),
             "slow.mp4": write_video(tmp_path / "slow.mp4", frames=5, fps=2.0, width=200, height=300),  # 5 frames
             "wide.mp4": write_video(tmp_path / "wide.mp4", frames=48, fps=24.0, width=1280, height=200)}
    jpegs = [encoded(Image.fromarray(fixture_image("vga-640x480")[i * 8:i * 8 + 240, :320]), "JPEG") for i in range(3)]
    urls = [data_url(data, "video/mp4") for data in files.values()]
    urls.append("data:video/jpeg;base64," + ",".join(base64.b64encode(j).decode() for j in jpegs))
    return [{"state": {"clip": i}, "videos": [url], "questions": {f"v{i}/q{j}": q for j, q in enumerate(QUESTIONS[:4])}}
            for i, url in enumerate(urls)]


def test_videos_match_the_torch_model(d3_service, reference, tmp_path):
    worst, count = 0.0, 0
    for body in video_requests(tmp_path):
        url = body["videos"][0]
        data = b"" if url.startswith("data:video/jpeg") else base64.b64decode(url.split(",", 1)[1])
        video = decode_video(data, "videos[0]", url)
        pixels, grid = qwen_video(video.frames, 16, 2, 2, (0.5,) * 3, (0.5,) * 3)
        n, dp = compare(d3_service, body, lambda prompt: reference.reference_logits_with_media(
            prompt.token_ids, prompt.positions, videos=(pixels, [grid])))
        count, worst = count + n, max(worst, dp)
    print(f"\nvideos: {count} questions over 4 videos, max |dp| {worst:.2e}")
    assert count >= 16 and worst <= 1e-4
