"""Shared helpers of the HTTP contract tests: posting a body and checking an error in both body shapes."""

from __future__ import annotations


def post(client, body, **kwargs):
    return client.post("/v1/systemone", json=body, **kwargs)


def assert_error(response, status, message, param=None):
    """Semantic errors: vLLM's status and message, in both client families' shapes (decision 2)."""
    assert response.status_code == status, response.text
    body = response.json()
    assert body["error"]["code"] == status
    assert message in body["error"]["message"], body["error"]["message"]
    assert body["detail"]["message"] == body["error"]["message"]
    assert body["error"]["param"] == param
    return body
