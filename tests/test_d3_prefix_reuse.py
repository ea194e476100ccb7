"""Prefix reuse in d3's causal mode (export/d3/qwen3_5_text.py, runtime/d3/state.py): the prefix a request's questions
share (system turn, media, state) is read once and each question as a suffix on its state, with the answers of
every whole prompt read alone (<= 1e-5 on the fp32 graph). The bidirectional mode reads every whole prompt (spec
4.3): there a question's text changes how its media and state are read."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest

from systemone.export.d3.answer_parity import question_set
from systemone.export.pipeline import add_forms
from systemone.export.sample_media import image_url
from systemone.runtime.artifact import Artifact
from systemone.runtime.batch import BatchBudget, CallCost, MediaRows, TextRow
from systemone.runtime.d3.code_logits import CodeLogits, code_logits, text_positions
from systemone.runtime.d3 import state as d3_state
from systemone.runtime.engine import EngineOptions
from systemone.runtime.service import DecisionService
from systemone.runtime.session import GraphSession
from systemone.runtime.text_runner import TextRunner
from tests.answer_helpers import max_probability_diff

STATE = {"ticket": "The parcel arrived crushed; the customer wants a refund and a replacement.", "tier": "gold"}


@pytest.fixture(scope="module")
def causal_service(d3_causal_artifact) -> DecisionService:
    return DecisionService(Artifact.load(d3_causal_artifact), EngineOptions(device="cpu"))


def runner_for(artifact, graph: str = "text.onnx", budget: BatchBudget = BatchBudget()) -> TextRunner:
    fields = json.loads((artifact / "manifest.json").read_text())
    return TextRunner(GraphSession(artifact / graph, "cpu"), budget, CodeLogits(int(fields["hidden_size"])),
                      d3_state.layout_of(fields))


def whole_logits(runner: TextRunner, rows: list[TextRow]) -> np.ndarray:
    return code_logits(runner.run_rows(rows))


def suffix_logits(runner: TextRunner, prefix: TextRow, suffixes: list[TextRow]) -> np.ndarray:
    """The suffixes' code logits read on `prefix`, prefilled once."""
    return code_logits(runner.read_suffixes(runner.prefill(runner.start(), prefix), suffixes))


def softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def suffix_rows(prefix_length: int, suffixes: list[list[int]]) -> list[TextRow]:
    return [TextRow(s, text_positions(prefix_length + len(s))[:, prefix_length:]) for s in suffixes]


def test_a_prefix_prefilled_in_chunks_of_the_time_slice_reads_as_one_call(d3_causal_artifact):
    """Issue 50 item 4: a long prefix is prefilled in chunks about `slice_s` long each (here, by a cost model of
    1 ms a token and a 0.3 s slice, 300 tokens), each on the state the last left, keys and values appended, media
    rows among them: its suffixes read as on the prefix prefilled in one call."""
    fields = json.loads((d3_causal_artifact / "manifest.json").read_text())
    sliced = runner_for(d3_causal_artifact, budget=BatchBudget(slice_s=0.3))
    sliced.cost = CallCost(fixed_s=0.0, token_s=1e-3)
    whole = runner_for(d3_causal_artifact)
    rng = np.random.default_rng(7)
    prefix = rng.integers(0, 5000, 700).tolist()
    media = MediaRows(rng.standard_normal((20, int(fields["hidden_size"]))).astype(np.float32),
                      np.arange(290, 310, dtype=np.int64))  # across the first chunk's end
    suffixes = [rng.integers(0, 5000, n).tolist() for n in (1, 9, 40)]
    steps = sliced.prefilling(sliced.start(), TextRow(prefix, text_positions(700), media))
    chunks = 1
    while True:
        try:
            next(steps)
            chunks += 1
        except StopIteration as done:
            state = done.value
            break
    assert chunks == 3 and state.length == 700
    one_call = whole.prefill(whole.start(), TextRow(prefix, text_positions(700), media))
    assert np.abs(code_logits(sliced.read_suffixes(state, suffix_rows(700, suffixes)))
                  - code_logits(whole.read_suffixes(one_call, suffix_rows(700, suffixes)))).max() <= 1e-5


def test_the_causal_manifest_records_the_state_and_the_bidirectional_one_none(d3_artifact, d3_causal_artifact):
    causal = json.loads((d3_causal_artifact / "manifest.json").read_text())
    layout = d3_state.layout_of(causal)
    # Every layer carries two: a window and a recurrent state, or keys and values; the text graph takes them all.
    assert layout is not None and len(layout.tensors) == 2 * len(causal["state"]["layer_types"])
    text = onnx.load(str(d3_causal_artifact / "text.onnx"), load_external_data=False)
    assert set(layout.names("past")) <= {value.name for value in text.graph.input}
    assert d3_state.layout_of(json.loads((d3_artifact / "manifest.json").read_text())) is None


@pytest.mark.parametrize("prefix_length", [1, 63, 64, 150])
def test_suffixes_read_on_a_prefilled_prefix_match_their_whole_prompts(d3_causal_artifact, prefix_length):
    """Suffixes of 1 to 130 tokens (across the delta rule's 64-token chunks) in one right-padded call on a prefix
    prefilled once: each row's code logits are its whole prompt's."""
    runner = runner_for(d3_causal_artifact)
    rng = np.random.default_rng(prefix_length)
    prefix = rng.integers(0, 5000, prefix_length).tolist()
    suffixes = [rng.integers(0, 5000, n).tolist() for n in (1, 7, 64, 65, 130)]
    whole = whole_logits(runner, [TextRow(prefix + s, text_positions(prefix_length + len(s))) for s in suffixes])
    state = runner.prefill(runner.start(), TextRow(prefix, text_positions(prefix_length)))
    assert state.length == prefix_length
    got = code_logits(runner.read_suffixes(state, suffix_rows(prefix_length, suffixes)))
    assert np.abs(got - whole).max() <= 1e-5


def test_media_rows_in_the_prefix_are_read_once_for_every_suffix(d3_causal_artifact):
    runner = runner_for(d3_causal_artifact)
    rng = np.random.default_rng(1)
    media = MediaRows(rng.standard_normal((6, runner.reads.hidden)).astype(np.float32),
                      np.arange(4, 10, dtype=np.int64))
    prefix = rng.integers(0, 5000, 40).tolist()
    suffixes = [rng.integers(0, 5000, n).tolist() for n in (3, 30)]
    whole = whole_logits(runner, [TextRow(prefix + s, text_positions(40 + len(s)), media) for s in suffixes])
    got = suffix_logits(runner, TextRow(prefix, text_positions(40), media), suffix_rows(40, suffixes))
    assert np.abs(got - whole).max() <= 1e-5


@pytest.fixture(scope="module")
def causal_mixed_artifact(d3_causal_checkpoint, d3_causal_artifact, tmp_path_factory):
    """A copy of the causal artifact with the form d3-nano is served in on CUDA: fp16 products and fused ops, the
    delta rule's state fp32 (export/half_precision.py's float16-mixed), written only if its gate passes."""
    out = tmp_path_factory.mktemp("causal-mixed") / "art"
    shutil.copytree(d3_causal_artifact, out)
    manifest = add_forms(str(d3_causal_checkpoint), out, forms=["cuda-fused-mixed"])
    assert manifest.forms["cuda-fused-mixed"].refused is None, manifest.forms["cuda-fused-mixed"].refused
    return out


@pytest.mark.parametrize("which", ["the ladder's", "cuda-fused-mixed"])
def test_a_fused_forms_suffix_reads_match_its_whole_prompts(which, request):
    """The CUDA form's graph (fused convolution with its window, delta rule from a state, attention over the past;
    run here by onnxruntime's CPU kernels) reads suffixes on a prefix as it reads the whole prompts (half
    precision: the codes' probabilities within 2e-3; the logits, about 3 in size, within fp16's rounding). Both the
    form the tiny export's ladder writes and the mixed one: there the convolution's window leaves the fused node
    untyped, and a converter that took it for fp32 wrote a graph onnxruntime refused to load."""
    artifact = request.getfixturevalue("d3_causal_artifact" if which == "the ladder's" else "causal_mixed_artifact")
    form = Artifact.load(artifact).forms_for("cuda")[0]
    assert which == "the ladder's" or form == which
    runner = runner_for(artifact, f"text.{form}.onnx")
    rng = np.random.default_rng(2)
    prefix = rng.integers(0, 5000, 90).tolist()
    suffixes = [rng.integers(0, 5000, n).tolist() for n in (2, 41, 70)]
    whole = whole_logits(runner, [TextRow(prefix + s, text_positions(90 + len(s))) for s in suffixes])
    got = suffix_logits(runner, TextRow(prefix, text_positions(90)), suffix_rows(90, suffixes))
    assert np.abs(got - whole).max() <= 1e-2
    assert np.abs(softmax(got) - softmax(whole)).max() <= 2e-3


def test_a_request_of_several_questions_reads_its_prefix_once_with_the_answers_of_its_whole_prompts(causal_service):
    engine = causal_service.engine
    prepared = causal_service.prepare({"state": STATE, "questions": question_set(4) | question_set(9)})
    assert engine.runs_whole(prepared)
    runs = engine.session.runs
    reused = engine.run(prepared)
    assert engine.session.runs - runs <= 3  # the prefix, then the six suffixes in at most two calls
    whole = engine.runner.run_rows(engine.rows(prepared, None))
    for got, want in zip(reused, whole, strict=True):
        assert max(abs(got.scores[k] - v) for k, v in want.scores.items()) <= 1e-5


def test_an_image_requests_questions_are_read_on_its_media_prefix(causal_service):
    """The image's rows sit in the prefix every question shares (spec 4.8), read once."""
    body = {"state": STATE, "images": [image_url(200, 100, seed=3)], "questions": question_set(5)}
    prepared = causal_service.prepare(body)
    engine = causal_service.engine
    assert engine.runs_whole(prepared)
    reused = engine.run(prepared)
    whole = engine.runner.run_rows(engine.rows(prepared, engine.encode_media(prepared)))
    for got, want in zip(reused, whole, strict=True):
        assert max(abs(got.scores[k] - v) for k, v in want.scores.items()) <= 1e-5


def test_one_question_is_one_row_of_a_shared_call(causal_service):
    prepared = causal_service.prepare({"state": STATE, "questions": question_set(6)})
    one = type(prepared)(prepared.request, prepared.questions[:1], prepared.prompts[:1], prepared.labels[:1])
    assert not causal_service.engine.runs_whole(one)


def test_the_bidirectional_mode_reads_every_whole_prompt(d3_service):
    prepared = d3_service.prepare({"state": STATE, "questions": question_set(4)})
    assert not d3_service.engine.reads_prefixes and not d3_service.engine.runs_whole(prepared)


def test_with_prefix_reuse_off_a_requests_questions_are_rows_of_shared_calls_with_the_same_answers(
        d3_causal_artifact, causal_service, monkeypatch):
    """`--no-prefix-reuse`: nothing is prefilled; each question's whole prompt is a row the scheduler may share with
    other requests' rows, and the answers are the default's within 1e-5 (an image request too)."""
    service = DecisionService(Artifact.load(d3_causal_artifact), EngineOptions(device="cpu", prefix_reuse=False))
    monkeypatch.setattr(service.engine.runner, "prefilling", lambda *a, **k: pytest.fail("a prefix was prefilled"))
    try:
        for body in ({"state": STATE, "questions": question_set(4) | question_set(9)},
                     {"state": STATE, "images": [image_url(200, 100, seed=3)], "questions": question_set(5)}):
            assert causal_service.engine.runs_whole(causal_service.prepare(body))
            assert not service.engine.runs_whole(service.prepare(body))
            assert max_probability_diff(service.decide(body)["answers"],
                                        causal_service.decide(body)["answers"]) <= 1e-5
    finally:
        service.close()
