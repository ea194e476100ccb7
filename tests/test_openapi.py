"""`/openapi.json` (what `/docs` shows) describes the real bodies of POST /v1/systemone, while the body is still
parsed by our own parser (its statuses and messages are pinned in test_d3_api.py)."""

from __future__ import annotations

import dataclasses

import pytest
from fastapi.testclient import TestClient

from systemone.models.request import DecisionRequest
from systemone.server.app import create_app


@pytest.fixture(scope="module")
def openapi(d3_service) -> dict:
    response = TestClient(create_app(d3_service)).get("/openapi.json")
    assert response.status_code == 200
    return response.json()


def resolve(openapi: dict, schema: dict) -> dict:
    ref = schema.get("$ref")
    return openapi["components"]["schemas"][ref.rsplit("/", 1)[1]] if ref else schema


def test_the_request_body_lists_every_field_the_parser_reads(openapi):
    body = openapi["paths"]["/v1/systemone"]["post"]["requestBody"]
    assert body["required"] is True
    request = resolve(openapi, body["content"]["application/json"]["schema"])
    parsed = {field.name for field in dataclasses.fields(DecisionRequest)}
    assert set(request["properties"]) == parsed | {"cache_salt", "priority"}
    assert set(request["required"]) == {"state", "questions"}


def test_the_three_question_types_are_described(openapi):
    request = openapi["components"]["schemas"]["DecisionRequest"]
    variants = request["properties"]["questions"]["additionalProperties"]["anyOf"]
    types = {}
    for variant in variants:
        schema = resolve(openapi, variant)
        types[schema["properties"]["type"]["const"]] = schema
    assert set(types) == {"noul", "choice", "score"}
    assert types["score"]["properties"]["criteria"]["minItems"] == 2
    assert all(set(schema["properties"]) == {"type", "instructions", "criteria"} for schema in types.values())


def test_the_response_and_error_bodies_are_described(openapi):
    responses = openapi["paths"]["/v1/systemone"]["post"]["responses"]
    assert {"200", "400", "401", "404", "413", "415", "422", "503"} <= set(responses)
    answer = resolve(openapi, responses["200"]["content"]["application/json"]["schema"])
    assert list(answer["properties"]) == ["id", "object", "created", "model", "answers", "usage", "diagnostics",
                                          "joint"]
    kinds = {resolve(openapi, v)["properties"]["type"]["const"]
             for v in answer["properties"]["answers"]["additionalProperties"]["anyOf"]}
    assert kinds == {"noul", "choice", "score"}
    error = resolve(openapi, responses["404"]["content"]["application/json"]["schema"])
    assert set(error["properties"]) == {"error", "detail"}


def test_the_documented_schema_does_not_parse_bodies(d3_service):
    """An unknown top-level field is still ignored (decision 3) and a wrong type is still our 422."""
    client = TestClient(create_app(d3_service))
    question = {"q": {"type": "noul"}}
    assert client.post("/v1/systemone", json={"state": 1, "questions": question, "extra": 1}).status_code == 200
    response = client.post("/v1/systemone", json={"state": 1, "questions": []})
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "questions"]


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_the_docs_pages_load_every_asset_from_the_server_itself(d3_service, page):
    """Offline, as this server often runs: the page names no other host, and every script, style and icon it names,
    and the schema it reads, come from the server."""
    import re

    client = TestClient(create_app(d3_service))
    html = client.get(page)
    assert html.status_code == 200 and html.headers["content-type"].startswith("text/html")
    referenced = set(re.findall(r'(?:src|href)="([^"]+)"', html.text)) | set(re.findall(r"url: '([^']+)'", html.text))
    referenced |= set(re.findall(r'spec-url="([^"]+)"', html.text))
    assert "/openapi.json" in referenced and len(referenced) >= 3, referenced
    assert not re.search(r"https?://", html.text), "the page names another host"
    for url in referenced:
        asset = client.get(url)
        assert asset.status_code == 200 and len(asset.content) > 100, url
        if url.endswith(".js"):
            assert "javascript" in asset.headers["content-type"], url
    assert "requestBody" in client.get("/openapi.json").json()["paths"]["/v1/systemone"]["post"]


def test_with_an_api_key_no_docs_page_or_asset_is_served(d3_service):
    from systemone.server.app import ServerOptions

    client = TestClient(create_app(d3_service, ServerOptions(api_key="k")))
    for path in ("/docs", "/redoc", "/openapi.json", "/docs-assets/swagger-ui-bundle.js"):
        assert client.get(path).status_code == 404, path
