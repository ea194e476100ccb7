"""typesafe-sdk 0.7.5 (TypeSafe's official client) works against `systemone serve` with no change but the base
URL (decision 5): sync and async clients, zstd bodies of 1 KiB and more, its strict response parsing."""

from __future__ import annotations

import asyncio

import pytest
from typesafe_sdk import AsyncTypeSafeClient, Choice, Noul, Score, TypeSafeClient
from typesafe_sdk.constants import DEFAULT_MODEL

from systemone.runtime.artifact import Artifact
from systemone.runtime.engine import EngineOptions
from systemone.runtime.service import DecisionService
from systemone.server.app import ServerOptions
from tests.live_server import live_server

QUESTIONS = {
    "urgent": Noul(instructions="Does this need a reply today?", criteria={"true": "same day", "false": "later"}),
    "team": Choice(instructions="Which team?", criteria={"billing": "payments", "shipping": None,
                                                         "other": {"note": "anything else"}}),
    "anger": Score(instructions={"ask": "How angry?"}, criteria=["calm", "annoyed", ["very", "angry"]]),
}


@pytest.fixture(scope="module")
def sdk_service(d3_artifact):
    # The client sends its default model name unless told otherwise: serve it as an alias.
    return DecisionService(Artifact.load(d3_artifact), EngineOptions(device="cpu"),
                           served_model_names=["vllm-sr/d3-tiny", DEFAULT_MODEL])


@pytest.fixture(scope="module")
def base_url(sdk_service):
    with live_server(sdk_service) as url:
        yield url


def check_response(response, sdk_service):
    assert response.model == "vllm-sr/d3-tiny"
    assert isinstance(response.usage.input_tokens, int) and response.usage.input_tokens > 0
    assert response.usage.output_tokens == 0
    assert set(response.nouls) == {"urgent"} and set(response.choices) == {"team"} and set(response.scores) == {"anger"}
    assert response.choices["team"].choice in {"billing", "shipping", "other"}
    assert list(response.scores["anger"].legend) == [0, 1, 2]
    assert response.scores["anger"].legend[2] == "['very', 'angry']"
    assert 0.0 <= response.nouls["urgent"].noul <= 1.0


def test_sync_client_answers_all_three_types(base_url, sdk_service):
    with TypeSafeClient(api_key="any-key", base_url=base_url) as client:
        check_response(client.system_one("I was charged twice.", QUESTIONS), sdk_service)


def test_async_client_answers_all_three_types(base_url, sdk_service):
    async def ask():
        async with AsyncTypeSafeClient(api_key="any-key", base_url=base_url) as client:
            return await client.system_one({"message": "I was charged twice.", "order": 1234}, QUESTIONS)

    check_response(asyncio.run(ask()), sdk_service)


def test_bodies_over_1_kib_go_zstd_compressed(base_url, sdk_service):
    """The SDK compresses bodies of 1 KiB and more with zstd: the server must decode them."""
    state = {"ticket": "charged twice " * 200, "history": [f"message {i}" for i in range(50)]}
    seen = []

    def record(request):
        seen.append(request.headers.get("content-encoding"))

    import httpx2

    with TypeSafeClient(api_key="k", base_url=base_url,
                        http_client=httpx2.Client(event_hooks={"request": [record]})) as client:
        response = client.system_one(state, QUESTIONS)
    assert seen == ["zstd"]
    check_response(response, sdk_service)
    plain = sdk_service.decide({"state": state, "questions": {"urgent": {
        "type": "noul", "instructions": "Does this need a reply today?",
        "criteria": {"true": "same day", "false": "later"}}}})
    assert response.nouls["urgent"].noul == pytest.approx(plain["answers"]["urgent"]["noul"], abs=1e-6)


def test_models_list_parses(base_url):
    with TypeSafeClient(api_key="k", base_url=base_url) as client:
        models = client.models.list()
    assert [m.name for m in models.models] == ["vllm-sr/d3-tiny", DEFAULT_MODEL]
    assert all(len(m.release_date) == 10 for m in models.models)


def test_sdk_errors_are_typed(base_url):
    from typesafe_sdk import TypeSafeBadRequestError, TypeSafeNotFoundError

    with TypeSafeClient(api_key="k", base_url=base_url) as client:
        with pytest.raises(TypeSafeNotFoundError):
            client.system_one("x", QUESTIONS, model="nope")
        with pytest.raises(TypeSafeBadRequestError, match="a score has 2 to 10 non-empty levels"):
            client.system_one("x", {"s": Score(criteria=[f"l{i}" for i in range(11)])})


def test_api_key_is_required_when_configured(d3_artifact, sdk_service):
    from typesafe_sdk import TypeSafeAuthenticationError

    with live_server(sdk_service, ServerOptions(api_key="s3cret")) as url:
        with TypeSafeClient(api_key="wrong", base_url=url) as client:
            with pytest.raises(TypeSafeAuthenticationError):
                client.system_one("x", QUESTIONS)
        with TypeSafeClient(api_key="s3cret", base_url=url) as client:
            assert client.system_one("x", QUESTIONS).model == "vllm-sr/d3-tiny"
