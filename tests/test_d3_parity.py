"""Answer parity on CPU (spec 4.3, 4.13; appendix D 9, 13): the ONNX artifact vs the torch model
(transformers `Qwen3_5Model` + the readout) on the same token ids, in both attention modes."""

from __future__ import annotations

import numpy as np
import pytest

from systemone.export.d3 import D3ExportConfig
from systemone.models.family import first_argmax
from systemone.runtime.artifact import Artifact
from systemone.runtime.service import DecisionService
from systemone.runtime.text_batch import text_positions

STATES = [None, "The parcel arrived crushed and the customer wants a refund.", {"error": "Disk at 98%", "host": "db1"},
          "नमस्ते — एक छोटा संदेश", ["a", 1, {"b": None}], "x" * 300, "Short.", {"tickets": list(range(40))}]


def question_set(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    n_choice = int(rng.integers(1, 30))
    levels = int(rng.integers(2, 11))
    return {
        f"noul-{seed}": {"type": "noul", "instructions": f"Is case {seed} urgent?",
                         "criteria": {"true": "yes, today"} if seed % 2 else None},
        f"choice-{seed}": {"type": "choice", "instructions": "Which option fits?",
                           "criteria": {f"option {i}": (f"about {i}" if i % 2 else None) for i in range(n_choice)}},
        f"score-{seed}": {"type": "score", "criteria": [f"level {i}" for i in range(levels)]},
    }


REQUESTS = [{"state": STATES[i % len(STATES)], "questions": question_set(i)} for i in range(70)]


def torch_probabilities(service: DecisionService, reference: D3ExportConfig, body: dict) -> dict[str, list[float]]:
    """The torch model on each question's own prompt, read the way spec 4.13 reads it."""
    probs = {}
    for prompt in service.render(body):
        logits = reference.reference_logits(prompt.token_ids, text_positions(len(prompt.token_ids)))
        probs[prompt.question.id] = list(service.family.read(prompt.question, logits.tolist()).probs)
    return probs


def onnx_probabilities(service: DecisionService, body: dict) -> dict[str, list[float]]:
    return {qid: list(answer["probabilities"].values()) for qid, answer in service.decide(body)["answers"].items()}


@pytest.fixture(scope="module", params=["noncausal_full_attention", "causal"])
def mode_pair(request, d3_checkpoint, d3_artifact, d3_causal_checkpoint, d3_causal_artifact):
    checkpoint, artifact = ((d3_checkpoint, d3_artifact) if request.param == "noncausal_full_attention"
                            else (d3_causal_checkpoint, d3_causal_artifact))
    service = DecisionService(Artifact.load(artifact), device="cpu")
    reference = D3ExportConfig(checkpoint)
    assert reference.attention_mode == request.param
    return service, reference


def test_onnx_matches_torch_on_200_questions(mode_pair):
    """>= 200 questions per attention mode: every pick equal, max |dp| <= 1e-4."""
    service, reference = mode_pair
    count, worst, spread = 0, 0.0, []
    for body in REQUESTS:
        want = torch_probabilities(service, reference, body)
        got = onnx_probabilities(service, body)
        for qid, probs in want.items():
            assert first_argmax(got[qid]) == first_argmax(probs), qid
            worst = max(worst, float(np.abs(np.array(got[qid]) - np.array(probs)).max()))
            spread.append(max(probs))
            count += 1
    assert count >= 200
    assert worst <= 1e-4, worst
    # The checkpoint's answers are not degenerate: picks are not all certain, so the tolerance means something.
    assert np.median(spread) < 0.99


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
