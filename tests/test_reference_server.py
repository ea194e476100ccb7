"""The reference server of `systemone bench --serve` (the checkpoint's own runtime served as a competent torch server)
answers as our runtime does: same prompts, same media, the torch model's numbers (fp32 here, so within parity
tolerance), with a request's media through the vision tower once and all of its questions in one padded forward."""

from __future__ import annotations

import numpy as np
import pytest

from systemone.export.sample_media import image_url, jpeg_video_url
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
    engine = reference.engine
    assert engine.model.config._attn_implementation == "sdpa"  # transformers' default, not the export's eager
    runs_before = engine.session.runs
    image = image_url(640, 480, seed=3)
    bodies = [BODY, {**BODY, "images": [image]}]
    if family == "d3":  # questions of different lengths, an image used twice and a video: one tower run
        bodies.append({**BODY, "state": "short", "images": [image, image_url(320, 256, seed=4), image],
                       "videos": [jpeg_video_url(128, 96, 4, seed=5)]})
    for body in bodies:
        forwards, vision = engine.forwards, engine.vision_runs
        want, got = probabilities(ours.decide(body)), probabilities(reference.decide(body))
        assert want.keys() == got.keys()
        for qid in want:
            assert np.argmax(got[qid]) == np.argmax(want[qid])
            assert np.abs(np.array(got[qid]) - np.array(want[qid])).max() <= 1e-4, qid
        # Three questions, one padded forward; the media (when there is any) through the tower once.
        assert engine.forwards == forwards + 1
        assert engine.vision_runs == vision + ("images" in body)
    assert engine.session.runs == runs_before  # the ONNX graphs never ran: torch answered
