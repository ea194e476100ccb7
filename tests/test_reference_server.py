"""The reference server of `systemone bench --serve` (transformers eager, one question at a time) answers as our
runtime does: same prompts, same media, the torch model's numbers (fp32 here, so within parity tolerance)."""

from __future__ import annotations

import numpy as np
import pytest

from systemone.export.sample_media import image_url
from systemone.reference_server import reference_service

BODY = {"state": {"ticket": "Refund not received after 10 days", "tier": "gold"},
        "questions": {"urgent": {"type": "noul", "instructions": "Is it urgent?"},
                      "team": {"type": "choice", "criteria": {"billing": "money", "support": None, "sales": None}},
                      "mood": {"type": "score", "criteria": ["calm", "annoyed", "furious"]}}}


def probabilities(response: dict) -> dict[str, list[float]]:
    return {qid: list(a["probabilities"].values()) for qid, a in response["answers"].items()}


@pytest.mark.parametrize("family", ["d3", "d1"])
def test_the_reference_answers_as_the_runtime(family, request):
    ours = request.getfixturevalue(f"{family}_service")
    reference = reference_service(request.getfixturevalue(f"{family}_checkpoint"),
                                  request.getfixturevalue(f"{family}_artifact"), "cpu", "float32")
    runs_before = reference.engine.session.runs
    for body in (BODY, {**BODY, "images": [image_url(640, 480, seed=3)]}):
        want, got = probabilities(ours.decide(body)), probabilities(reference.decide(body))
        assert want.keys() == got.keys()
        for qid in want:
            assert np.argmax(got[qid]) == np.argmax(want[qid])
            assert np.abs(np.array(got[qid]) - np.array(want[qid])).max() <= 1e-4, qid
    assert reference.engine.session.runs == runs_before  # the ONNX graphs never ran: torch answered
