"""The HTTP contract of d3 on POST /v1/systemone beyond what both families share (test_api_contract.py): d3's
option limits and checks (spec 2.3, 4.5, 6.4), prompt length (6.2), thinking (6.3) and its response (5)."""

from __future__ import annotations

import base64
import re

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from systemone.runtime.artifact import Artifact
from systemone.runtime.engine import EngineOptions
from systemone.runtime.service import DecisionService
from systemone.server.app import create_app
from tests.vision_fixtures import fixture_image
from tests.http_helpers import assert_error, post
from tests.media_helpers import encoded

SERVED = "vllm-sr/d3-tiny"
NOUL = {"type": "noul", "instructions": "Is it urgent?"}


@pytest.fixture(scope="module")
def client(d3_service):
    return TestClient(create_app(d3_service))


# -- spec 1.3 step 4: questions ---------------------------------------------------------------------------------
@pytest.mark.parametrize("questions, message", [
    ({"q": {"type": "choice", "criteria": {f"o{i}": None for i in range(256)}}},
     "question 'q': at most 255 options for this model"),
])
def test_question_rules(client, questions, message):
    assert_error(post(client, {"state": None, "questions": questions}), 400, message)


def test_255_choice_options_are_accepted(client):
    """Spec 2.3: d3's limit is len(codes) (255)."""
    response = post(client, {"state": None, "questions": {"q": {"type": "choice",
                                                                 "criteria": {f"o{i}": None for i in range(255)}}}})
    assert response.status_code == 200
    assert len(response.json()["answers"]["q"]["probabilities"]) == 255


def test_videos_past_the_limit_are_refused(client):
    """vLLM's --limit-mm-per-prompt message, with this server's limit (4 videos by default); images: the shared
    contract (test_api_contract.py)."""
    response = post(client, {"state": None, "questions": {"q": NOUL}, "videos": ["data:,"] * 5})
    assert_error(response, 400, "At most 4 video(s) may be provided in one prompt. (parameter=video)", param="video")


def test_unfetchable_media_is_a_4xx_naming_its_place(client):
    """decision 1: a media URL that cannot be fetched is a 4xx (vLLM: 500), naming images[i]."""
    response = post(client, {"state": None, "questions": {"q": NOUL}, "images": ["http://127.0.0.1:1/a.png"]})
    body = assert_error(response, 400, "media: images[0]: host '127.0.0.1' resolves to a non-public address")
    assert body["error"]["type"] == "BadRequestError"


# -- spec 1.3 step 8, 4.5, 6.4: d3 family checks ----------------------------------------------------------------
def test_top_level_instructions_are_refused(client):
    assert_error(post(client, {"state": None, "questions": {"q": NOUL}, "instructions": "Be strict."}), 400,
                 "this model reads a fixed prompt, so it takes no instructions")


@pytest.mark.parametrize("instructions", ["", None])
def test_empty_top_level_instructions_are_accepted(client, instructions):
    assert post(client, {"state": None, "questions": {"q": NOUL}, "instructions": instructions}).status_code == 200


def test_choice_option_names_must_be_non_empty(client):
    response = post(client, {"state": None, "questions": {"q": {"type": "choice", "criteria": {"": None, "b": None}}}})
    assert_error(response, 400, "question 'q': option names must be non-empty")


@pytest.mark.parametrize("levels", [[f"l{i}" for i in range(11)], ["", "x"]])
def test_score_needs_2_to_10_non_empty_levels(client, levels):
    response = post(client, {"state": None, "questions": {"q": {"type": "score", "criteria": levels}}})
    assert_error(response, 400, "question 'q': a score has 2 to 10 non-empty levels")


def test_instructions_check_runs_before_option_checks(client):
    questions = {"q": {"type": "choice", "criteria": {"": None}}}
    assert_error(post(client, {"state": None, "questions": questions, "instructions": "x"}), 400,
                 "takes no instructions")


def test_option_checks_run_for_all_questions_before_media(client):
    questions = {"a": NOUL, "b": {"type": "score", "criteria": ["", "x"]}}
    assert_error(post(client, {"state": None, "questions": questions, "videos": ["https://example.com/v.mp4"]}),
                 400, "question 'b': a score has 2 to 10 non-empty levels")


# -- spec 6.2: prompt too long ----------------------------------------------------------------------------------
def test_prompt_longer_than_max_model_len_is_refused_not_truncated(d3_artifact, d3_service):
    body = {"state": "word " * 50, "questions": {"q": NOUL}}
    (prompt,) = d3_service.render(body)
    n = len(prompt.token_ids)

    def limited(max_model_len: int) -> TestClient:
        service = DecisionService(Artifact.load(d3_artifact), EngineOptions(device="cpu", max_model_len=max_model_len))
        service.adopt_batch_sizing(d3_service.batch_sizing())  # as `serve` takes a kept one: no measurement here
        return TestClient(create_app(service))

    assert post(limited(n), body).status_code == 200  # n == max_model_len is allowed (spec 4.12)
    assert_error(post(limited(n - 1), body), 400, f"question 'q': the prompt has {n} tokens, more than "
                                                  f"max_model_len={n - 1}; nothing is truncated")


# -- spec 6.3: thinking is ignored by d3 ------------------------------------------------------------------------
def test_enable_thinking_is_ignored(client, d3_service):
    body = {"state": "x", "questions": {"q": NOUL}}
    thinking = {**body, "chat_template_kwargs": {"enable_thinking": True}}
    assert post(client, thinking).status_code == 200
    assert d3_service.render(thinking)[0].token_ids == d3_service.render(body)[0].token_ids


# -- spec 5: response assembly ----------------------------------------------------------------------------------
def test_response_shape_and_usage(client, d3_service):
    body = {"state": {"ticket": "late"}, "questions": {
        "team": {"type": "choice", "criteria": {"billing": "money", "outage": None}},
        "urgent": {"type": "noul"},
        "mood": {"type": "score", "criteria": ["calm", "annoyed", "furious"]}}}
    response = post(client, body)
    assert response.status_code == 200
    data = response.json()
    assert list(data) == ["id", "object", "created", "model", "answers", "usage", "diagnostics", "joint"]
    assert data["object"] == "structured_decision" and data["model"] == SERVED and data["joint"] is None
    assert data["id"].startswith("decision-") and len(data["id"]) == len("decision-") + 16
    assert list(data["answers"]) == ["team", "urgent", "mood"]
    assert data["usage"] == {"input_tokens": sum(len(p.token_ids) for p in d3_service.render(body)),
                             "output_tokens": 0}
    assert all(d == {"label_mass": 1.0, "argmax_is_label": True} for d in data["diagnostics"].values())
    team, urgent, mood = (data["answers"][k] for k in ("team", "urgent", "mood"))
    assert list(team) == ["type", "choice", "probabilities", "confidence"]
    assert team["choice"] == max(team["probabilities"], key=team["probabilities"].get)
    assert team["confidence"] == max(team["probabilities"].values())
    assert list(urgent) == ["type", "noul", "probabilities", "confidence"]
    assert urgent["noul"] == urgent["probabilities"]["yes"]
    assert urgent["confidence"] == max(urgent["probabilities"].values())
    assert list(mood) == ["type", "score", "legend", "probabilities", "confidence"]
    assert mood["legend"] == {"0": "calm", "1": "annoyed", "2": "furious"}
    assert mood["score"] == pytest.approx(sum(int(k) * p for k, p in mood["probabilities"].items()))
    for answer in data["answers"].values():
        assert sum(answer["probabilities"].values()) == pytest.approx(1.0, abs=1e-9)


def test_one_option_choice_is_certain(client):
    """Spec 7.3: a one-option choice answers probability 1 and confidence == label_mass."""
    answer = post(client, {"state": "x", "questions": {"q": {"type": "choice", "criteria": {"billing": None}}}}
                  ).json()["answers"]["q"]
    assert answer["probabilities"] == {"billing": 1.0} and answer["confidence"] == 1.0


def test_metrics_count_the_pixel_jobs_made_in_the_media_worker_processes(d3_service):
    """A video's pixel rows are made in the media worker processes (the session's service has one): /metrics counts
    the job there, and none run in threads for want of shared memory or a live worker."""
    def counter(text: str, name: str) -> int:
        return int(re.search(rf"^{name} (\d+)$", text, re.M).group(1))

    frames = [encoded(Image.fromarray(fixture_image("vga-640x480")[i * 8:i * 8 + 240, :320]), "JPEG")
              for i in range(4)]
    video = "data:video/jpeg;base64," + ",".join(base64.b64encode(f).decode() for f in frames)
    with TestClient(create_app(d3_service)) as client:
        before = client.get("/metrics").text
        assert post(client, {"state": None, "videos": [video], "questions": {"q": NOUL}}).status_code == 200
        after = client.get("/metrics").text
    made, fallback = "systemone_media_process_jobs_total", "systemone_media_fallback_jobs_total"
    assert counter(after, made) == counter(before, made) + 1
    assert counter(after, fallback) == counter(before, fallback)


def test_a_score_the_graph_gives_as_nan_is_a_500_naming_the_question_not_a_crash(d3_artifact, monkeypatch, caplog):
    """A non-finite score is the model's fault, not the request's: 500 with a message that names the question (not
    the encoder's bare "internal error: ValueError"), and one error line in the server's log."""
    from dataclasses import replace

    service = DecisionService(Artifact.load(d3_artifact), EngineOptions(device="cpu"), served_model_names=[SERVED])
    real_read = service.family.read

    def nan_scores(question, labels, readout):
        return real_read(question, labels, replace(readout, scores={k: float("nan") for k in readout.scores}))

    monkeypatch.setattr(service.family, "read", nan_scores)
    try:
        with TestClient(create_app(service)) as nan_client, caplog.at_level("ERROR"):
            response = post(nan_client, {"state": None, "questions": {"urgent": NOUL}})
    finally:
        service.close()
    body = assert_error(response, 500, "the model's scores for question 'urgent' are not all finite numbers; the "
                                       "model or its export is at fault, not the request")
    assert body["error"]["type"] == "InternalServerError"
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0].endswith(body["error"]["message"]), errors
