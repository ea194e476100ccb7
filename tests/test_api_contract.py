"""The HTTP contract both families share on POST /v1/systemone, run once against each: the body and its schema
(spec 1.2, 1.3 step 1; decisions 2, 3), the model name (1.3 step 2), the family-independent question rules (2.1,
1.3 step 4), modalities and joint (1.3 steps 5, 7), request ids and response keys (5). Each family's own rules
are in test_d3_api.py and test_d1_api.py."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from systemone.runtime.artifact import Artifact
from systemone.runtime.engine import EngineOptions
from systemone.runtime.service import DecisionService
from systemone.server.app import create_app
from tests.http_helpers import assert_error, post

SERVED = {"d3": "vllm-sr/d3-tiny", "d1": "LiquidAI/d1-tiny"}
NOUL = {"type": "noul", "instructions": "Is it urgent?"}


@pytest.fixture(scope="module", params=["d3", "d1"])
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def client(family, request):
    return TestClient(create_app(request.getfixturevalue(f"{family}_service")))


@pytest.fixture(scope="module")
def served(family) -> str:
    return SERVED[family]


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
])
def test_question_rules(client, questions, message):
    """Spec 2.1, 1.3 step 4 and 7.6 cases 1-9: the rules every family applies, first failure wins."""
    assert_error(post(client, {"state": None, "questions": questions}), 400, message)


def test_images_past_the_limit_are_refused(client):
    """vLLM's --limit-mm-per-prompt message, with this server's limit (16 images by default)."""
    response = post(client, {"state": None, "questions": {"q": NOUL}, "images": ["data:,"] * 17})
    assert_error(response, 400, "At most 16 image(s) may be provided in one prompt. (parameter=image)", param="image")


def assert_schema_error(response, loc):
    """Schema errors: 422 in FastAPI's shape (decision 2)."""
    assert response.status_code == 422, response.text
    locs = [tuple(d["loc"]) for d in response.json()["detail"]]
    assert ("body", *loc) in locs, locs


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


def test_unknown_model_is_404(client, served):
    body = assert_error(post(client, {"model": "nope", "state": None, "questions": {"q": NOUL}}), 404,
                        f"The model `nope` does not exist. Valid aliases: {served}.", param="model")
    assert body["error"]["type"] == "NotFoundError"


@pytest.mark.parametrize("model", [None, "", "the served name"])
def test_empty_or_served_model_name_passes(client, served, model):
    model = served if model == "the served name" else model
    assert post(client, {"model": model, "state": None, "questions": {"q": NOUL}}).status_code == 200


def test_jev_latest_reaches_the_served_model_and_the_response_names_it(client, served):
    """TypeSafe's SDK sends `jev-latest` unless told otherwise (jevcompat MUST request.model-alias)."""
    response = post(client, {"model": "jev-latest", "state": None, "questions": {"q": NOUL}})
    assert response.status_code == 200 and response.json()["model"] == served


def test_the_jev_latest_alias_can_be_turned_off(family, request):
    """Off, it is a name like any other; the default served name is the checkpoint directory's name."""
    artifact = request.getfixturevalue(f"{family}_artifact")
    service = DecisionService(Artifact.load(artifact), EngineOptions(device="cpu"), aliases=())
    assert_error(post(TestClient(create_app(service)), {"model": "jev-latest", "state": None,
                                                        "questions": {"q": NOUL}}), 404,
                 f"The model `jev-latest` does not exist. Valid aliases: {family}-tiny.", param="model")


def test_model_check_comes_before_question_checks(client):
    assert post(client, {"model": "nope", "state": None, "questions": {}}).status_code == 404


def test_question_id_repr_uses_python_quoting(client):
    """Spec 2.6: repr(qid) switches to double quotes when the id holds a single quote."""
    response = post(client, {"state": None, "questions": {"it's": {"type": "score", "criteria": ["a"]}}})
    assert_error(response, 400, "question \"it's\": score criteria need at least 2 levels (got 1)")


def test_first_failing_question_wins(client):
    questions = {"a": {"type": "score", "criteria": ["x"]}, "b": {"type": "nope"}}
    assert_error(post(client, {"state": None, "questions": questions}), 400, "question 'a': score criteria")


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


def test_request_id_from_header_then_body(client):
    body = {"state": None, "questions": {"q": NOUL}, "request_id": "r1"}
    assert post(client, body).json()["id"] == "decision-r1"
    response = post(client, body, headers={"X-Request-Id": "abc"})
    assert response.json()["id"] == "decision-abc"
    assert response.headers["x-request-id"] == "abc"


def test_option_names_come_back_byte_for_byte(client):
    names = {"日本 ": None, "a_b": None, "  spaced": "d", "😀": None}
    answer = post(client, {"state": "x", "questions": {"q": {"type": "choice", "criteria": names}}}).json()
    assert list(answer["answers"]["q"]["probabilities"]) == list(names)


def test_models_and_health(client, served):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [served]
    assert [m["name"] for m in models["models"]] == [served]
    assert client.get("/health").json() == {"status": "ok"}


def test_question_ids_come_back_unchanged(client):
    """Any non-empty id (spaces, dots, dashes, Hangul, emoji) is answered under the same id."""
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
