"""d3 answer parity: the runtime's answers against the torch model (`D3ExportConfig.reference_logits`) on each
question's own prompt, over requests of every question type, states of every JSON kind, 1 to 29 choice options and
2 to 10 score levels. Used by the tests (CPU) and `scripts/parity.py` (CPU or CUDA)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...models.family import Readout
from ...models.questions import first_argmax
from ...runtime.d3.code_logits import text_positions
from ...runtime.service import DecisionService
from ..answer_gate import QuestionPair

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


def parity_requests(count: int = 70) -> list[dict]:
    """`count` requests of three questions each."""
    return [{"state": STATES[i % len(STATES)], "questions": question_set(i)} for i in range(count)]


def torch_probabilities(service: DecisionService, reference: Any, body: dict) -> dict[str, list[float]]:
    """The torch model (`D3ExportConfig.reference_logits`) on each question's own prompt, read as spec 4.13 reads."""
    family = service.family
    probs = {}
    for prompt in service.render(body):
        logits = reference.reference_logits(prompt.token_ids, text_positions(len(prompt.token_ids)))
        labels = family.labels(prompt.question, None)
        read = family.read(prompt.question, labels, Readout(dict(enumerate(logits.tolist()))))
        probs[prompt.question.id] = list(read.probs)
    return probs


def onnx_probabilities(service: DecisionService, body: dict) -> dict[str, list[float]]:
    """The artifact's answers through the whole runtime (one padded batch per request)."""
    return {qid: list(a["probabilities"].values()) for qid, a in service.decide(body)["answers"].items()}


def question_pairs(service: DecisionService, reference: Any, requests: list[dict]) -> list[QuestionPair]:
    """Each question of `requests`: the runtime's probabilities and the torch model's."""
    pairs = []
    for body in requests:
        want = torch_probabilities(service, reference, body)
        got = onnx_probabilities(service, body)
        pairs += [QuestionPair(qid, got[qid], probs) for qid, probs in want.items()]
    return pairs


def compare(service: DecisionService, reference: Any, requests: list[dict]) -> dict:
    """ONNX vs torch over `requests`: question count, differing picks, max |dp|, median top probability."""
    pairs = question_pairs(service, reference, requests)
    return {"questions": len(pairs),
            "picks_differing": [p.question for p in pairs if first_argmax(p.got) != first_argmax(p.want)],
            "max_abs_dp": max(float(np.abs(np.array(p.got) - np.array(p.want)).max()) for p in pairs),
            "median_top_probability": float(np.median([max(p.want) for p in pairs]))}




def sixteen_questions() -> dict:
    questions = {}
    for seed in range(6):
        questions.update(question_set(seed))
    return {"state": {"ticket": "Charged twice for order 1234", "tier": "gold"},
            "questions": dict(list(questions.items())[:16])}
