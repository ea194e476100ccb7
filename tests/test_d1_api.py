"""The HTTP contract of d1 on POST /v1/systemone beyond what both families share (test_api_contract.py): spec
7.6's d1 column, the d1 family checks in spec 1.3 step 8's order, the prompt-length messages of 3.9, and the
response assembly of spec 5."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from systemone.models.errors import DecisionError
from systemone.runtime.artifact import Artifact
from systemone.runtime.engine import EngineOptions
from systemone.runtime.media_errors import MediaError
from systemone.runtime.service import DecisionService
from systemone.server.app import create_app
from tests.http_helpers import assert_error, post
from tests.media_helpers import HeldMedia, data_url, gradient_png

SERVED = "LiquidAI/d1-tiny"
NOUL = {"type": "noul", "instructions": "Is it urgent?"}


@pytest.fixture(scope="module")
def client(d1_service):
    return TestClient(create_app(d1_service))


@pytest.mark.parametrize("questions,message", [
    ({"q": {"type": "choice", "criteria": {f"o{i}": None for i in range(27)}}},
     "question 'q': at most 26 options for this model"),
    ({"q": {"type": "score", "criteria": [str(i) for i in range(11)]}}, "question 'q': at most 10 options for this model"),
])
def test_option_limits(client, questions, message):
    """Spec 2.3 and 7.6 cases 6-7 (d1 column); the rules both families share are in test_api_contract.py."""
    assert_error(post(client, {"state": None, "questions": questions}), 400, message)


@pytest.mark.parametrize("questions", [{"q": {"type": "score", "criteria": ["", "x"]}},
                                       {"q": {"type": "choice", "criteria": {"": None, "b": None}}}])
def test_empty_names_are_accepted_by_d1(client, questions):
    """Spec 7.6 cases 10, 11: d1 takes an empty level or option name (d3 does not)."""
    assert post(client, {"state": "x", "questions": questions}).status_code == 200


def test_instructions_are_a_system_turn(client, d1_service):
    """Spec 7.6 case 12 / 6.4: d1 answers 200 and the instructions become the system message."""
    body = {"state": "x", "instructions": "Be strict.", "questions": {"q": NOUL}}
    assert post(client, body).status_code == 200
    (prompt,) = d1_service.render(body)
    assert prompt.text.startswith("<|startoftext|><|im_start|>system\nBe strict.<|im_end|>\n<|im_start|>user\n")


def test_thinking_is_refused_before_images_are_fetched(client):
    """Spec 7.6 case 13 / 1.3 step 8: the thinking check comes before the image fetch."""
    body = {"state": None, "questions": {"q": NOUL}, "chat_template_kwargs": {"enable_thinking": True},
            "images": ["http://192.0.2.1/never-fetched.png"]}
    assert_error(post(client, body), 400, "a read is the reply's first token, so thinking must be off")


@pytest.mark.parametrize("field,message", [("audio", "this model does not take audio inputs"),
                                           ("videos", "this model does not take video inputs")])
def test_unsupported_modalities(client, field, message):
    """Spec 7.6 cases 14, 15: d1 takes images only."""
    assert_error(post(client, {"state": None, "questions": {"q": NOUL}, field: ["data:x;base64,AAAA"]}), 400, message)


@pytest.mark.parametrize("url,status,message", [
    ("data:image/png;base64AAAA", 400, "Invalid data URL"),
    ("ftp://x/y.png", 400, "The URL must be either a HTTP, data or file URL."),
    ("data:image/png;base64,aGVsbG8=", 400, "Failed to load image"),
    ("data:image/png,AAAA", 400, "Only base64 data URLs are supported"),
])
def test_bad_images_are_4xx(client, url, status, message):
    """Spec 7.6 cases 17-20 with decision 1 (never a 5xx for client input)."""
    response = post(client, {"state": None, "questions": {"q": NOUL}, "images": [url]})
    assert response.status_code == status, response.text
    assert message in response.json()["error"]["message"]


def test_bytes_pillow_cannot_read_get_the_specs_message_with_no_address(client):
    """Spec 1.4, 6.1 / 7.6 case 20, with the field named: Pillow's own message names the buffer by its memory
    address, which tells a client nothing and differs from one read of the same bytes to the next."""
    response = post(client, {"state": None, "questions": {"q": NOUL}, "images": ["data:image/png;base64,aGVsbG8="]})
    assert response.json()["error"]["message"] == ("media: images[0]: Failed to load image: cannot identify image file "
                                                   "<_io.BytesIO object>")


def test_response_shape_usage_and_diagnostics(client, d1_service):
    """Spec 5 / 7.6 cases 25-27: vLLM's keys and order, output_tokens = questions, input_tokens = every full prompt
    (state and image tokens repeated), confidence = top probability x label_mass, noul = P(yes)."""
    body = {"model": SERVED, "state": {"order": 7}, "images": [data_url(gradient_png(200, 100))],
            "questions": {"u": NOUL, "t": {"type": "choice", "criteria": {"a": "billing", "b_c": None}},
                          "s": {"type": "score", "criteria": ["low", "high"]}}}
    data = post(client, body).json()
    assert list(data) == ["id", "object", "created", "model", "answers", "usage", "diagnostics", "joint"]
    assert data["object"] == "structured_decision" and data["model"] == SERVED and data["joint"] is None
    assert list(data["answers"]) == ["u", "t", "s"] and list(data["diagnostics"]) == ["u", "t", "s"]
    prompts = d1_service.render(body)
    assert data["usage"] == {"input_tokens": sum(len(p.token_ids) for p in prompts), "output_tokens": 3}
    u, t, s = (data["answers"][k] for k in "uts")
    mass = {k: data["diagnostics"][k]["label_mass"] for k in "uts"}
    assert list(u) == ["type", "noul", "probabilities", "confidence"]
    assert u["noul"] == u["probabilities"]["yes"]
    assert u["confidence"] == pytest.approx(max(u["probabilities"].values()) * mass["u"])
    assert list(t) == ["type", "choice", "probabilities", "confidence"] and list(t["probabilities"]) == ["a", "b_c"]
    assert t["confidence"] == pytest.approx(max(t["probabilities"].values()) * mass["t"])
    assert list(s) == ["type", "score", "legend", "probabilities", "confidence"]
    assert s["legend"] == {"0": "low", "1": "high"}
    assert s["score"] == pytest.approx(s["probabilities"]["1"])
    for diag in data["diagnostics"].values():
        assert 0 < diag["label_mass"] <= 1 and isinstance(diag["argmax_is_label"], bool)


def test_label_checks_come_after_the_image_fetch(client):
    """Spec 1.3 step 8 (d1): image fetch, then prompts, then label groups: a bad image wins over a bad label."""
    body = {"state": None, "images": ["data:image/png;base64,aGVsbG8="],
            "questions": {"q": {"type": "choice", "criteria": {"丙": None, "x": None}}}}
    assert "Failed to load image" in post(client, body).json()["error"]["message"]
    body.pop("images")
    assert_error(post(client, body), 400, "question 'q': label '丙' is not one distinct token for this model")


def test_an_image_token_in_the_text_is_refused(client):
    """Spec 8 Q7 decided: `<image>` written in the state would take an image's place; 400 naming it."""
    assert_error(post(client, {"state": "look <image> here", "questions": {"q": NOUL}}), 400,
                 "question 'q': the prompt holds 1 <image> tokens for 0 image(s)")


def test_prompt_length_limits(d1_artifact, d1_service):
    """Spec 3.9: text tokens over max_model_len (with vLLM's "at least" at M+1), the decoder prompt after image
    expansion longer than or equal to max_model_len; nothing is truncated."""
    body = {"state": "x", "questions": {"q": NOUL}}
    (prompt,) = d1_service.render(body)
    n = len(prompt.token_ids)

    def client_for(m):
        return TestClient(create_app(DecisionService(Artifact.load(d1_artifact),
                                                    EngineOptions(device="cpu", max_model_len=m))))

    assert post(client_for(n + 1), body).status_code == 200
    assert_error(post(client_for(n), body), 400, f"The decoder prompt (length {n}) plus the number of requested "
                                                 f"output tokens (at least 1) is longer than the maximum model length "
                                                 f"of {n}.")
    assert_error(post(client_for(n - 1), body), 400, f"However, your prompt contains at least {n} input tokens",
                 param="input_tokens")
    # vLLM's tokenizer stops at M + 1 tokens, so any longer prompt reports "at least M + 1".
    assert_error(post(client_for(n - 2), body), 400, f"However, your prompt contains at least {n - 1} input tokens",
                 param="input_tokens")
    with_image = {**body, "images": [data_url(gradient_png(200, 100))]}
    # The prompt gains one <image>, which becomes <|image_start|> + 72 <image> + <|image_end|> (200x100, spec 3.8).
    assert_error(post(client_for(n + 10), with_image), 400, f"The decoder prompt (length {n + 74}) is longer than "
                                                             f"the maximum model length of {n + 10}.")
    small = client_for(4)
    long_text = {"state": "y" * 200, "questions": {"q": NOUL}}
    assert_error(post(small, long_text), 400, "characters (more than", param="input_text")


def test_an_image_error_wins_over_a_prompt_too_long(d1_artifact):
    """Spec 1.3 step 8: images are read before the prompts are checked. The prompts are tokenized while the images
    load, yet a request with an unreadable image and a state too long for the model gets the image's error, over
    HTTP and through DecisionService.prepare; with a readable image, the prompt's."""
    service = DecisionService(Artifact.load(d1_artifact), EngineOptions(device="cpu", max_model_len=20))
    client = TestClient(create_app(service))
    bad = {"state": "x " * 50, "images": ["data:image/png;base64,aGVsbG8="], "questions": {"q": NOUL}}
    assert_error(post(client, bad), 400, "Failed to load image")
    with pytest.raises(MediaError, match="Failed to load image"):
        service.prepare(bad)
    good = {**bad, "images": [data_url(gradient_png(200, 100))]}
    assert_error(post(client, good), 400, "However, your prompt contains at least 21 input tokens",
                 param="input_tokens")
    with pytest.raises(DecisionError, match="at least 21 input tokens"):
        service.prepare(good)


@pytest.mark.parametrize("path", ["DecisionService.prepare", "HTTP"])
def test_a_fault_while_the_prompts_are_drafted_stops_the_requests_media(d1_service, monkeypatch, path):
    """A request's prompts are drafted while its image loads; when the draft fails with a fault (not a request
    error), nothing will read the image, so its job stops at once instead of holding a media thread."""
    media = HeldMedia(seconds=30)

    def faulty_draft(request, questions):
        assert media.started.wait(5)
        raise RuntimeError("a fault while drafting")

    monkeypatch.setattr(d1_service.engine, "media", media)
    monkeypatch.setattr(d1_service.engine, "draft", faulty_draft)
    body = {"state": "x", "questions": {"q": NOUL}}
    if path == "HTTP":
        with TestClient(create_app(d1_service), raise_server_exceptions=False) as client:
            assert post(client, body).status_code == 500  # a fault is ours: a 500, the server goes on
    else:
        with pytest.raises(RuntimeError, match="a fault while drafting"):
            d1_service.prepare(body)
    assert media.stopped.wait(2), "the image's job ran on"


@pytest.mark.parametrize("kwargs", [
    {"tools": 5}, {"documents": [1]}, {"messages": "x"}, {"add_generation_prompt": False},
    {"continue_final_message": True}, {"tokenize": True}, {"bos_token": {"a": 1}}, {"enable_thinking": None},
    {"enable_thinking": "auto"}, {"enable_thinking": 0}, {"": 1, "a b": [None]}, {"raise_exception": 1},
])
def test_chat_template_kwargs_never_break_the_server(client, kwargs):
    """Spec 3.3: request kwargs are template variables (null/"auto" dropped, the generation prompt and thinking
    forced); whatever they hold, the answer is a 200 or a 400, never a 5xx."""
    response = post(client, {"state": "x", "questions": {"q": NOUL}, "chat_template_kwargs": kwargs})
    assert response.status_code in (200, 400), response.text
