"""A family is one module set and one registration: a third family, defined here with its own prompt, labels,
read and engine, is recognised, loaded and served end to end through the registry alone."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from fastapi.testclient import TestClient
from onnx import TensorProto, helper
from tokenizers import Tokenizer

from systemone.models.family import Encode, Family, Labels, Readout, label_softmax
from systemone.models.questions import Question, Read
from systemone.models.registry import FAMILIES, FamilyEntry, UnknownFamily
from systemone.models.request import DecisionRequest
from systemone.runtime.artifact import Artifact, ArtifactError, GraphEntry, Manifest
from systemone.runtime.batch import pad_right
from systemone.runtime.engine import Engine, EngineOptions, Prepared
from systemone.runtime.prompt import RenderedPrompt, render_texts
from systemone.runtime.service import DecisionService
from systemone.runtime.session import GraphSession
from systemone.server.app import create_app

TOKENIZER = Path(__file__).parent / "fixtures" / "qwen3_5" / "tokenizer.json.gz"
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
SLOTS = 4
WEIGHTS = np.array([[1.0, -2.0, 0.5, 3.0]], dtype=np.float32) / 1000.0


class ToyFamily(Family):
    """Asks "STATE? QUESTION" and reads slot i of a 4-wide score vector as option i."""

    name = "toy"
    modalities = frozenset()

    def option_limit(self, question_type: str) -> int:
        return SLOTS

    def check_request(self, request: DecisionRequest, questions: list[Question]) -> None:
        pass

    def render_state(self, state: Any, max_chars: int | None = None) -> str:
        return json.dumps(state)

    def messages(self, request: DecisionRequest, question: Question, state_text: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": f"{state_text}? {question.instructions}"}]

    def labels(self, question: Question, encode: Encode) -> Labels:
        return Labels(tuple((i,) for i in range(len(question.options))))

    def read(self, question: Question, labels: Labels, readout: Readout) -> Read:
        return Read(tuple(label_softmax([readout.scores[g[0]] for g in labels.groups])), 1.0, True)


class ToyEngine(Engine):
    """Its graph: the sum of each prompt's token ids times a fixed 4-wide weight row."""

    def __init__(self, artifact: Artifact, options: EngineOptions):
        self.artifact = artifact
        self.family = artifact.family
        self.max_model_len = artifact.max_model_len
        self.session = GraphSession(artifact.graph_path("text"), options.device)

    def prepare(self, request: DecisionRequest, questions: list[Question], media: None = None,
                draft: None = None) -> Prepared:
        texts = render_texts(self.artifact.template, self.family, request, questions)
        ids = self.artifact.tokenizer.encode_batch(texts)
        prompts = [RenderedPrompt(q, t, i) for q, t, i in zip(questions, texts, ids)]
        return Prepared(request, questions, prompts, [self.family.labels(q, None) for q in questions])

    def run(self, prepared: Prepared, run_options: Any = None) -> list[Readout]:
        ids, _ = pad_right([p.token_ids for p in prepared.prompts])
        (scores,) = self.session.run({"input_ids": ids}, run_options)
        return [Readout(dict(enumerate(row.tolist()))) for row in scores]


def toy_graph(path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Cast", ["input_ids"], ["ids_f"], to=TensorProto.FLOAT),
         helper.make_node("ReduceSum", ["ids_f", "axes"], ["total"], keepdims=1),
         helper.make_node("MatMul", ["total", "weights"], ["scores"])],
        "toy",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", SLOTS])],
        [helper.make_tensor("axes", TensorProto.INT64, [1], [1]),
         helper.make_tensor("weights", TensorProto.FLOAT, [1, SLOTS], WEIGHTS.ravel().tolist())])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))


TOY = FamilyEntry("toy", ToyFamily, "tests.test_family_registry:ToyEngine", None,
                  lambda config, files: config.get("architectures") == ["ToyForDecisions"])
REGISTRY = FAMILIES.with_family(TOY)


@pytest.fixture(scope="module")
def toy_artifact(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("toy")
    toy_graph(root / "text.onnx")
    (root / "tokenizer.json").write_bytes(gzip.decompress(TOKENIZER.read_bytes()))
    (root / "chat_template.jinja").write_text(TEMPLATE)
    Manifest(family="toy", source="acme/toy", checkpoint="", max_model_len=512,
             graphs={"text": GraphEntry("text.onnx", {"input_ids": ["batch", "sequence"]}, ["scores"])},
             parity={}, special_tokens={}, tokenizer_class="TokenizersBackend").write(root)
    return root


def test_a_family_is_recognised_by_its_registration(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["ToyForDecisions"]}))
    assert REGISTRY.recognise(tmp_path).name == "toy"
    with pytest.raises(UnknownFamily, match="not a checkpoint of a known family"):
        FAMILIES.recognise(tmp_path)


def test_an_artifact_of_an_unregistered_family_is_refused(toy_artifact):
    with pytest.raises(ArtifactError, match="unknown model family 'toy'"):
        Artifact.load(toy_artifact)


def test_a_third_family_is_served_end_to_end(toy_artifact):
    service = DecisionService(Artifact.load(toy_artifact, REGISTRY), EngineOptions(device="cpu"))
    client = TestClient(create_app(service))
    body = {"state": {"door": "open"}, "questions": {
        "exit": {"type": "choice", "instructions": "Which way?", "criteria": {"left": None, "right": None, "up": None}},
        "safe": {"type": "noul", "instructions": "Is it safe?"}}}
    response = client.post("/v1/systemone", json=body)
    assert response.status_code == 200, response.text
    answers = response.json()["answers"]

    # The expected numbers, computed here from the tokenizer and the graph's definition alone.
    tokenizer = Tokenizer.from_str(gzip.decompress(TOKENIZER.read_bytes()).decode("utf-8"))
    for qid, count in (("exit", 3), ("safe", 2)):
        text = f"<user>{json.dumps(body['state'])}? {body['questions'][qid]['instructions']}"
        total = float(sum(tokenizer.encode(text, add_special_tokens=False).ids))
        scores = [total * float(w) for w in WEIGHTS[0, :count]]
        exps = [math.exp(s - max(scores)) for s in scores]
        want = [e / sum(exps) for e in exps]
        got = list(answers[qid]["probabilities"].values())
        assert got == pytest.approx(want, abs=1e-5)
    assert answers["exit"]["type"] == "choice" and answers["safe"]["type"] == "noul"
    assert response.json()["model"] == "acme/toy"

    # The family's option limit is its own, and a bad request is refused before any graph runs.
    runs = service.engine.session.runs
    too_many = {"state": 1, "questions": {"q": {"type": "choice", "criteria": {c: None for c in "abcde"}}}}
    refused = client.post("/v1/systemone", json=too_many)
    assert refused.status_code == 400 and "at most 4 options" in refused.json()["error"]["message"]
    assert service.engine.session.runs == runs


def test_serve_describes_a_family_without_media_or_shared_batches(toy_artifact, monkeypatch, capsys):
    """Media and shared batches are optional in a family's engine: `serve` says they are absent, and starts."""
    from systemone import cli
    from systemone.server import lifecycle

    monkeypatch.setattr(cli, "_service", lambda args: DecisionService(Artifact.load(toy_artifact, REGISTRY),
                                                                     EngineOptions(device="cpu")))
    monkeypatch.setattr(lifecycle, "run_server", lambda app, listener, stop, **kwargs: None)
    assert cli.main(["serve", str(toy_artifact), "--device", "cpu", "--port", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "systemone serve: proxy         none: this family takes no media" in lines
    assert "systemone serve: batch tokens  one request a call: this family's engine shares no batches" in lines


# One question of each registered type; a type registered without a sample here fails the test below.
SAMPLE_CRITERIA: dict[str, Any] = {"choice": {"refund": "money back", "replace": None, "reject": None},
                                   "noul": {"true": "the parcel is damaged"},
                                   "score": ["none", "some", "much"]}


@pytest.mark.parametrize("entry", list(FAMILIES), ids=lambda entry: entry.name)
def test_every_registered_family_answers_every_registered_question_type(entry, request):
    """Each family of the registry, served from its tiny artifact (the `<name>_service` fixture a family brings
    with it), answers a question of each registered type with that type's answer, probabilities summing to 1."""
    from systemone.models.questions import QUESTION_TYPES

    assert set(SAMPLE_CRITERIA) == set(QUESTION_TYPES), "give every registered question type a sample question"
    service = request.getfixturevalue(f"{entry.name}_service")
    questions = {f"q-{name}": {"type": name, "instructions": "What should happen to the order?", "criteria": criteria}
                 for name, criteria in SAMPLE_CRITERIA.items()}
    answers = service.answer(service.prepare({"state": "The parcel arrived crushed.", "questions": questions}))
    for name in QUESTION_TYPES:
        answer = answers["answers"][f"q-{name}"]
        assert answer["type"] == name and math.isclose(sum(answer["probabilities"].values()), 1.0, abs_tol=1e-4)
