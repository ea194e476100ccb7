"""The gate's torch reference for a checkpoint too large for the device (export/d3/streamed_reference.py): every
prompt run through one group of decoder layers at a time reads exactly as the whole model read prompt by prompt."""

from __future__ import annotations

import numpy as np
import pytest

from systemone.export.d3.answer_parity import parity_requests, reference_pairs, runtime_answers
from systemone.export.d3.config import D3ExportConfig
from systemone.runtime.artifact import Artifact
from systemone.runtime.engine import EngineOptions
from systemone.runtime.service import DecisionService


@pytest.mark.parametrize("mode", ["noncausal_full_attention", "causal"])
def test_a_layer_streamed_reference_reads_every_prompt_as_the_whole_model(mode, request):
    checkpoint = request.getfixturevalue("d3_checkpoint" if mode != "causal" else "d3_causal_checkpoint")
    artifact = request.getfixturevalue("d3_artifact" if mode != "causal" else "d3_causal_artifact")
    service = DecisionService(Artifact.load(artifact), EngineOptions(device="cpu"))
    answers = runtime_answers(service, parity_requests(5, media_every=1))  # images, two images, a video
    service.close()
    asked = answers[1]
    assert any(q.images is not None for q in asked) and any(q.videos is not None for q in asked)
    prompts = [(q.token_ids, q.positions, q.images, q.videos) for q in asked]

    config = D3ExportConfig(checkpoint)
    assert config.attention_mode == mode
    with config.reference_on("cpu"):
        whole = config.reference_logits_many(prompts)  # prompt by prompt on the whole model
    config.release_reference()
    config.stream_bytes = 1  # one decoder layer on the device at a time
    with config.reference_on("cpu"):
        streamed = reference_pairs(answers, config)  # the gate's own path
    assert config._reference is None  # the whole model was never loaded

    class Whole:
        def reference_logits_many(self, _prompts):
            return whole

    for want, got in zip(reference_pairs(answers, Whole()), streamed, strict=True):
        assert (want.question, want.got) == (got.question, got.got)
        np.testing.assert_allclose(got.want, want.want, rtol=0, atol=1e-6)
