"""The HTTP contract of d3 on POST /v1/systemone: one test per validation rule of spec 1.3, per error case of
spec 6.2-6.5, and the response assembly of spec 5 (decisions 2-4 override vLLM's statuses and shapes)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from systemone.runtime.artifact import Artifact
from systemone.runtime.engine import EngineOptions
from systemone.runtime.service import DecisionService
from systemone.server.app import create_app
from tests.http_helpers import assert_error, post

SERVED = "vllm-sr/d3-tiny"
NOUL = {"type": "noul", "instructions": "Is it urgent?"}


@pytest.fixture(scope="module")
def client(d3_service):
    return TestClient(create_app(d3_service))


def assert_schema_error(response, loc):
    """Schema errors: 422 in FastAPI's shape (decision 2)."""
    assert response.status_code == 422, response.text
    locs = [tuple(d["loc"]) for d in response.json()["detail"]]
    assert ("body", *loc) in locs, locs


# -- spec 1.1 / 1.3 step 1: body and schema ---------------------------------------------------------------------
def test_content_type_must_be_json(client):
    response = client.post("/v1/systemone", content=b'{"state": null}', headers={"Content-Type": "text/plain"})
    body = assert_error(response, 400, "Unsupported Media Type: Only 'application/json' is allowed")
    assert body["error"]["type"] == "Bad Request"


def test_content_type_parameters_and_case_are_ignored(client):
    response = client.post("/v1/systemone", content=json.dumps({"state": None, "questions": {"q": NOUL}}),
                           headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert response.status_code == 200


def test_malformed_json_is_422(client):
    response = client.post("/v1/systemone", content=b'{"state": ', headers={"Content-Type": "application/json"})
    assert response.status_code == 422
    assert response.json()["detail"][0]["type"] == "json_invalid"


def test_missing_state_is_422(client):
    assert_schema_error(post(client, {"questions": {"q": NOUL}}), ("state",))


def test_missing_questions_is_422(client):
    assert_schema_error(post(client, {"state": None}), ("questions",))


def test_questions_not_an_object_is_422(client):
    assert_schema_error(post(client, {"state": None, "questions": [NOUL]}), ("questions",))


def test_question_type_must_be_a_string(client):
    assert_schema_error(post(client, {"state": None, "questions": {"q": {"type": 1}}}), ("questions", "q", "type"))


def test_question_without_type_is_422(client):
    assert_schema_error(post(client, {"state": None, "questions": {"q": {}}}), ("questions", "q", "type"))


def test_joint_must_be_a_strict_boolean(client):
    assert_schema_error(post(client, {"state": None, "questions": {"q": NOUL}, "joint": "yes"}), ("joint",))


def test_images_must_be_a_list_of_strings(client):
    assert_schema_error(post(client, {"state": None, "questions": {"q": NOUL}, "images": [1]}), ("images", 0))


def test_body_must_be_an_object(client):
    assert_schema_error(post(client, [1, 2]), ())


def test_unknown_top_level_fields_are_ignored(client):
    """decision 3 (vLLM forbids them)."""
    assert post(client, {"state": None, "questions": {"q": NOUL}, "depends_on": "x", "stream": True}).status_code == 200


def test_cache_salt_must_be_a_non_empty_string(client):
    response = post(client, {"state": None, "questions": {"q": NOUL}, "cache_salt": ""})
    assert_error(response, 400, "Parameter 'cache_salt' must be a non-empty string if provided. "
                                "(parameter=cache_salt)", param="cache_salt")


@pytest.mark.parametrize("salt", ["a/b", "x" * 129, "at@", "nul\x00", "back\\slash"])
def test_cache_salt_length_and_characters(client, salt):
    response = post(client, {"state": None, "questions": {"q": NOUL}, "cache_salt": salt})
    assert_error(response, 400, "Parameter 'cache_salt' must be at most 128 characters and must not contain "
                                "'@', '/', '\\\\', or NUL. (parameter=cache_salt)", param="cache_salt")


# -- spec 1.3 step 2: model name --------------------------------------------------------------------------------
def test_unknown_model_is_404(client):
    body = assert_error(post(client, {"model": "nope", "state": None, "questions": {"q": NOUL}}), 404,
                        f"The model `nope` does not exist. Valid aliases: {SERVED}.", param="model")
    assert body["error"]["type"] == "NotFoundError"


@pytest.mark.parametrize("model", [None, "", SERVED])
def test_empty_or_served_model_name_passes(client, model):
    assert post(client, {"model": model, "state": None, "questions": {"q": NOUL}}).status_code == 200


def test_jev_latest_reaches_the_served_model_and_the_response_names_it(client):
    """TypeSafe's SDK sends `jev-latest` unless told otherwise (jevcompat MUST request.model-alias)."""
    response = post(client, {"model": "jev-latest", "state": None, "questions": {"q": NOUL}})
    assert response.status_code == 200 and response.json()["model"] == SERVED


def test_the_jev_latest_alias_can_be_turned_off(d3_artifact):
    service = DecisionService(Artifact.load(d3_artifact), EngineOptions(device="cpu"), aliases=())
    assert_error(post(TestClient(create_app(service)), {"model": "jev-latest", "state": None,
                                                        "questions": {"q": NOUL}}), 404,
                 "The model `jev-latest` does not exist. Valid aliases: d3-tiny.", param="model")


def test_model_check_comes_before_question_checks(client):
    assert post(client, {"model": "nope", "state": None, "questions": {}}).status_code == 404


# -- spec 1.3 step 4: questions ---------------------------------------------------------------------------------
@pytest.mark.parametrize("questions, message", [
    ({}, "questions: needs at least one question"),
    ({f"q{i}": NOUL for i in range(65)}, "questions: at most 64 for this model"),
    ({"q": {**NOUL, "depends_on": "x"}}, "question 'q': unknown field(s) ['depends_on']"),
    ({"q": {**NOUL, "x": 1, "a": 2}}, "question 'q': unknown field(s) ['a', 'x']"),
    ({"": NOUL}, "question ids must be non-empty"),
    ({"q": {"type": "Choice"}}, "unknown question type 'Choice'; supported: ['choice', 'noul', 'score']"),
    ({"q": {"type": "choice", "criteria": ["x", "y"]}},
     "question 'q': choice criteria must map option names to a description or null"),
    ({"q": {"type": "choice", "criteria": {}}},
     "question 'q': choice criteria must map option names to a description or null"),
    ({"q": {"type": "noul", "criteria": ["yes", "no"]}}, "question 'q': noul criteria must be an object with true "
                                                         "and false"),
    ({"q": {"type": "noul", "criteria": {"ture": "x"}}}, "question 'q': noul criteria must be an object with true "
                                                         "and false"),
    ({"q": {"type": "score", "criteria": ["calm"]}}, "question 'q': score criteria need at least 2 levels (got 1)"),
    ({"q": {"type": "score", "criteria": []}}, "question 'q': score criteria need at least 2 levels (got 0)"),
    ({"q": {"type": "score", "criteria": {"0": "a", "1": "b"}}},
     "question 'q': score criteria must be an ordered list of levels"),
    ({"q": {"type": "score", "criteria": ["low", "low"]}}, "question 'q': duplicate option names"),
    ({"q": {"type": "score", "criteria": [1, "1"]}}, "question 'q': duplicate option names"),
    ({"q": {"type": "choice", "criteria": {f"o{i}": None for i in range(256)}}},
     "question 'q': at most 255 options for this model"),
])
def test_question_rules(client, questions, message):
    assert_error(post(client, {"state": None, "questions": questions}), 400, message)


def test_question_id_repr_uses_python_quoting(client):
    """Spec 2.6: repr(qid) switches to double quotes when the id holds a single quote."""
    response = post(client, {"state": None, "questions": {"it's": {"type": "score", "criteria": ["a"]}}})
    assert_error(response, 400, "question \"it's\": score criteria need at least 2 levels (got 1)")


def test_first_failing_question_wins(client):
    questions = {"a": {"type": "score", "criteria": ["x"]}, "b": {"type": "nope"}}
    assert_error(post(client, {"state": None, "questions": questions}), 400, "question 'a': score criteria")


def test_255_choice_options_are_accepted(client):
    """Spec 2.3: d3's limit is len(codes) (255)."""
    response = post(client, {"state": None, "questions": {"q": {"type": "choice",
                                                                 "criteria": {f"o{i}": None for i in range(255)}}}})
    assert response.status_code == 200
    assert len(response.json()["answers"]["q"]["probabilities"]) == 255


# -- spec 1.3 steps 5 and 7: modalities, joint ------------------------------------------------------------------
def test_audio_is_refused(client):
    assert_error(post(client, {"state": None, "questions": {"q": NOUL}, "audio": ["data:audio/wav;base64,AA=="]}),
                 400, "this model does not take audio inputs")


@pytest.mark.parametrize("field", ["images", "audio", "videos"])
def test_null_and_empty_media_lists_are_ignored(client, field):
    for value in (None, []):
        assert post(client, {"state": None, "questions": {"q": NOUL}, field: value}).status_code == 200


def test_joint_is_refused(client):
    assert_error(post(client, {"state": None, "questions": {"q": NOUL}, "joint": True}), 400,
                 "joint: this model reads each question on its own; joint reads need DiffusionGemma")


def test_modalities_are_checked_before_joint(client):
    response = post(client, {"state": None, "questions": {"q": NOUL}, "joint": True, "audio": ["x"]})
    assert_error(response, 400, "this model does not take audio inputs")


def test_media_counts_are_limited_per_request(client):
    """vLLM's --limit-mm-per-prompt message, with this server's limits (16 images, 4 videos by default)."""
    response = post(client, {"state": None, "questions": {"q": NOUL}, "images": ["data:,"] * 17})
    assert_error(response, 400, "At most 16 image(s) may be provided in one prompt. (parameter=image)", param="image")
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
    exact = TestClient(create_app(DecisionService(Artifact.load(d3_artifact),
                                                  EngineOptions(device="cpu", max_model_len=n))))
    assert post(exact, body).status_code == 200  # n == max_model_len is allowed (spec 4.12)
    short = TestClient(create_app(DecisionService(Artifact.load(d3_artifact),
                                                  EngineOptions(device="cpu", max_model_len=n - 1))))
    assert_error(post(short, body), 400, f"question 'q': the prompt has {n} tokens, more than "
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


def test_request_id_from_header_then_body(client):
    body = {"state": None, "questions": {"q": NOUL}, "request_id": "r1"}
    assert post(client, body).json()["id"] == "decision-r1"
    response = post(client, body, headers={"X-Request-Id": "abc"})
    assert response.json()["id"] == "decision-abc"
    assert response.headers["x-request-id"] == "abc"


def test_one_option_choice_is_certain(client):
    """Spec 7.3: a one-option choice answers probability 1 and confidence == label_mass."""
    answer = post(client, {"state": "x", "questions": {"q": {"type": "choice", "criteria": {"billing": None}}}}
                  ).json()["answers"]["q"]
    assert answer["probabilities"] == {"billing": 1.0} and answer["confidence"] == 1.0


def test_option_names_come_back_byte_for_byte(client):
    names = {"日本 ": None, "a_b": None, "  spaced": "d", "😀": None}
    answer = post(client, {"state": "x", "questions": {"q": {"type": "choice", "criteria": names}}}).json()
    assert list(answer["answers"]["q"]["probabilities"]) == list(names)


def test_models_and_health(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [SERVED]
    assert [m["name"] for m in models["models"]] == [SERVED]
    assert client.get("/health").json() == {"status": "ok"}


def test_question_ids_come_back_unchanged(client):
    """Issue 3: any non-empty id (spaces, dots, dashes, Hangul, emoji) is answered under the same id."""
    ids = ["with space", "a.b.c", "x-y_z", "한국어 질문", "😀", " ", "a/b.txt", "'quoted\""]
    response = post(client, {"state": "x", "questions": {qid: NOUL for qid in ids}})
    assert response.status_code == 200
    assert list(response.json()["answers"]) == ids and list(response.json()["diagnostics"]) == ids


@pytest.mark.parametrize("state", ["text", {"k": "v"}, [1, "two", None], None, 3.5, True, ""])
def test_every_json_state_is_accepted(client, state):
    assert post(client, {"state": state, "questions": {"q": NOUL}}).status_code == 200


@pytest.mark.parametrize("criteria", [None, {}, {"true": "yes it is"}, {"false": ["no", 1]},
                                      {"true": {"a": 1}, "false": "no"}])
def test_noul_criteria_absent_null_one_or_two_sided(client, criteria):
    question = {"type": "noul"} if criteria is None else {"type": "noul", "criteria": criteria}
    assert post(client, {"state": "x", "questions": {"q": question}}).status_code == 200
