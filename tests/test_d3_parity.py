"""Answer parity on CPU (spec 4.3, 4.13; appendix D 9, 13): the ONNX artifact vs the torch model
(transformers `Qwen3_5Model` + the readout) on the same token ids, in both attention modes."""

from __future__ import annotations

import numpy as np
import pytest

from systemone.export.d3.answer_parity import compare, parity_requests, question_set
from systemone.export.d3.config import D3ExportConfig
from systemone.runtime.artifact import Artifact
from systemone.runtime.d3.code_logits import text_positions
from systemone.runtime.engine import EngineOptions
from systemone.runtime.service import DecisionService

REQUESTS = parity_requests(70)


@pytest.fixture(scope="module", params=["noncausal_full_attention", "causal"])
def mode_pair(request, d3_checkpoint, d3_artifact, d3_causal_checkpoint, d3_causal_artifact):
    checkpoint, artifact = ((d3_checkpoint, d3_artifact) if request.param == "noncausal_full_attention"
                            else (d3_causal_checkpoint, d3_causal_artifact))
    service = DecisionService(Artifact.load(artifact), EngineOptions(device="cpu"))
    reference = D3ExportConfig(checkpoint)
    assert reference.attention_mode == request.param
    return service, reference


def test_onnx_matches_torch_on_200_questions(mode_pair):
    """>= 200 questions per attention mode: every pick equal, max |dp| <= 1e-4."""
    service, reference = mode_pair
    report = compare(service, reference, REQUESTS)
    assert report["questions"] >= 200
    assert report["picks_differing"] == []
    assert report["max_abs_dp"] <= 1e-4, report["max_abs_dp"]
    # The checkpoint's answers are not degenerate: picks are not all certain, so the tolerance means something.
    assert report["median_top_probability"] < 0.99


def test_noncausal_mode_changes_the_answer(d3_checkpoint):
    """Appendix D 13: noncausal_full_attention makes full-attention layers bidirectional; on the same weights the
    last token's code logits differ from the causal read."""
    reference = D3ExportConfig(d3_checkpoint)
    ids = list(range(1000, 1060))
    bidirectional = reference.reference_logits(ids, text_positions(len(ids)))
    reference.decision_config = type(reference.decision_config)(
        **{**reference.decision_config.__dict__, "attention_mode": "causal"})
    causal = reference.reference_logits(ids, text_positions(len(ids)))
    assert np.abs(bidirectional - causal).max() > 1e-2


def test_probabilities_do_not_move_when_batched(d3_service):
    """A question's answer does not depend on the other questions it is batched with (<= 1e-5)."""
    state = {"ticket": "Refund not received", "tier": "gold"}
    questions = question_set(3) | question_set(11) | question_set(20)
    together = d3_service.decide({"state": state, "questions": questions})["answers"]
    for qid, question in questions.items():
        alone = d3_service.decide({"state": state, "questions": {qid: question}})["answers"][qid]
        diff = np.abs(np.array(list(alone["probabilities"].values()))
                      - np.array(list(together[qid]["probabilities"].values()))).max()
        assert diff <= 1e-5, (qid, diff)


def test_answer_does_not_depend_on_question_id_or_order(d3_service):
    state = "Order 1234 is late."
    question = {"type": "choice", "criteria": {"refund": None, "wait": "keep waiting", "cancel": None}}
    first = d3_service.decide({"state": state, "questions": {"a": question, "b": {"type": "noul"}}})["answers"]
    second = d3_service.decide({"state": state, "questions": {"b": {"type": "noul"}, "zz z": question}})["answers"]
    assert first["a"]["probabilities"] == pytest.approx(second["zz z"]["probabilities"], abs=1e-6)
