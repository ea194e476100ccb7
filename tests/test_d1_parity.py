"""Answer parity on CPU for d1 (spec 3.7, 3.8; issue: state prefix reuse): the runtime, which prefills a request's
shared prefix once and reads the questions as suffixes on its state, against transformers' LFM2-VL run on each
question's whole prompt with its own vision tower."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from systemone.export.d1.answer_parity import (compare, onnx_reads, parity_requests, sixteen_questions,
                                              whole_prompt_reads)
from systemone.export.d1.config import D1ExportConfig
from systemone.export.sample_media import image_url
from tests.answer_helpers import max_probability_diff


@pytest.fixture(autouse=True)
def unsliced(d1_service, monkeypatch):
    """The calls these tests count are those of a prompt read whole: no time slice, whatever call cost another test
    measured into the shared service (on a loaded host a prompt's measured cost passes the slice and is chunked)."""
    monkeypatch.setattr(d1_service.engine, "budget", dataclasses.replace(d1_service.engine.budget, slice_s=None))


@pytest.fixture(scope="module")
def reference(d1_checkpoint):
    return D1ExportConfig(d1_checkpoint)


def test_onnx_with_prefix_reuse_matches_torch_on_210_questions(d1_service, reference):
    """>= 200 questions of all three types, a third with spec 3.8's image sizes: every pick equal, the same
    argmax_is_label, max |dp| and max |d label_mass| <= 1e-4."""
    report = compare(d1_service, reference, parity_requests(70))
    assert report["questions"] >= 200 and report["questions_with_images"] >= 60
    assert report["picks_differing"] == []
    assert report["argmax_is_label_differing"] == []
    assert report["max_abs_dp"] <= 1e-4, report["max_abs_dp"]
    assert report["max_abs_d_label_mass"] <= 1e-4, report["max_abs_d_label_mass"]
    # The random checkpoint's answers are not degenerate: picks are not all certain.
    assert report["median_top_probability"] < 0.99


def test_prefix_reuse_reads_what_whole_prompts_read(d1_service):
    """Reuse changes no token and no number beyond float noise: suffix reads on the prefix's state equal the whole
    prompts read from an empty state (16 questions, a long state and a 1024x1024 image)."""
    prepared = d1_service.prepare(sixteen_questions(True))
    assert d1_service.engine.prefix_split(prepared)
    reused = onnx_reads(d1_service, prepared)
    whole = whole_prompt_reads(d1_service, prepared)
    for a, b in zip(reused, whole):
        assert np.abs(np.array(a.probs) - np.array(b.probs)).max() < 1e-5
        assert abs(a.label_mass - b.label_mass) < 1e-5 * max(a.label_mass, 1e-30) + 1e-12
        assert a.argmax_is_label == b.argmax_is_label


def test_a_question_reads_the_same_alone_or_among_others(d1_service):
    """Batching and padding do not leak between questions (right padding, causal attention and convolution)."""
    body = sixteen_questions(False)
    together = d1_service.decide(body)["answers"]
    for qid in list(body["questions"])[:4]:
        alone = d1_service.decide({**body, "questions": {qid: body["questions"][qid]}})["answers"][qid]
        for key, p in alone["probabilities"].items():
            assert abs(p - together[qid]["probabilities"][key]) < 1e-5


def test_a_one_question_text_request_is_one_graph_call(d1_service):
    """Nothing to share, so no prefill: the whole prompt is one call, reading what a prefill and a one-token read
    on it read."""
    body = sixteen_questions(False)
    qid = next(iter(body["questions"]))
    prepared = d1_service.prepare({**body, "questions": {qid: body["questions"][qid]}})
    session = d1_service.engine.session
    runs = session.runs
    one_call = onnx_reads(d1_service, prepared)[0]
    assert session.runs == runs + 1
    runner = d1_service.engine.runner
    (row,) = d1_service.engine.rows(prepared, None)
    (readout,) = runner.read_suffixes(runner.prefill(runner.start(), row.part(0, row.length - 1)),
                                      [row.part(row.length - 1)])
    prefilled = d1_service.family.read(prepared.questions[0], prepared.labels[0], readout)
    assert np.abs(np.array(one_call.probs) - np.array(prefilled.probs)).max() < 1e-5


def test_the_prefix_state_stays_on_the_device_and_the_reads_fetch_only_their_outputs(d1_service, monkeypatch):
    """The prefix prefilled in one chunk leaves its state where the graph made it (on a GPU, a round trip through
    host memory saved), and every batch of questions reads that same state; a read fetches the label
    log-probabilities and greedy token alone (the state its rows add is dropped where it was made: on a GPU,
    copying it back took half the run)."""
    session = d1_service.engine.session
    reads, prefills = [], []
    run, run_bound = session.run, session.run_bound

    def spy_run(feeds, run_options=None, fetch=None):
        reads.append((fetch, [feeds[name] for name in feeds if name.startswith("past_")]))
        return run(feeds, run_options, fetch)

    def spy_run_bound(feeds, run_options=None, on_host=()):
        prefills.append(run_bound(feeds, run_options, on_host))
        return prefills[-1]

    monkeypatch.setattr(session, "run", spy_run)
    monkeypatch.setattr(session, "run_bound", spy_run_bound)
    body = sixteen_questions(False)
    answers = d1_service.decide(body)["answers"]
    assert len(answers) == 16
    # run_bound is also what a read's run(fetch=...) calls: the prefill is the first call, the reads the rest.
    assert len(reads) >= 2 and {fetch for fetch, _ in reads} == {("label_logprobs", "argmax")}
    state = [prefills[0][name] for name in d1_service.engine.runner.layout.names("new")]
    for _, past in reads:
        assert [id(v) for v in past] == [id(v) for v in state]


def test_the_prefix_is_prefilled_in_chunks_within_the_attention_budget(d1_service):
    """A prefix longer than one chunk of the attention budget is prefilled chunk by chunk on the growing state and
    reads what one whole pass reads."""
    engine = d1_service.engine
    prepared = d1_service.prepare(sixteen_questions(False))
    whole = onnx_reads(d1_service, prepared)
    runner = engine.runner
    budget = runner.budget
    try:
        # chunks of ~128 tokens after 128
        runner.budget = dataclasses.replace(budget, attention_budget=2 * 4 * d1_service.engine.budget.heads * 128 * 256)
        assert runner.budget.chunk_length(500) < 300
        chunked = onnx_reads(d1_service, prepared)
    finally:
        runner.budget = budget
    for a, b in zip(whole, chunked):
        assert np.abs(np.array(a.probs) - np.array(b.probs)).max() < 1e-5


def test_with_prefix_reuse_off_every_whole_prompt_is_read_with_the_same_answers(d1_artifact, d1_service,
                                                                                 monkeypatch):
    """`--no-prefix-reuse`: no prefix is prefilled for an image request or a many-question one; each question's
    whole prompt is a row of calls shared with other requests, with the default's answers within 1e-5."""
    from systemone.runtime.artifact import Artifact
    from systemone.runtime.engine import EngineOptions
    from systemone.runtime.service import DecisionService

    service = DecisionService(Artifact.load(d1_artifact), EngineOptions(device="cpu", prefix_reuse=False),
                              served_model_names=["LiquidAI/d1-tiny"])
    monkeypatch.setattr(service.engine.runner, "prefilling", lambda *a, **k: pytest.fail("a prefix was prefilled"))
    # An image request of 16 questions (one 512x512 tile: each whole prompt is read, 1,268 tokens) and a text one.
    with_image = {**sixteen_questions(False), "images": [image_url(512, 512, seed=7)]}
    try:
        for body in (with_image, sixteen_questions(False)):
            assert not service.engine.runs_whole(service.prepare(body))
            assert max_probability_diff(service.decide(body)["answers"], d1_service.decide(body)["answers"]) <= 1e-5
    finally:
        service.close()
