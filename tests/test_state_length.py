"""A state too long for the model is refused before any per-question work (spec 3.9, 4.12): the first
question's prompt is checked (characters, then tokens) before the others are rendered or tokenized, so the cost of
a refusal does not grow with the number of questions."""

from __future__ import annotations

import json
import re
import time

import pytest

from systemone.models.errors import DecisionError
from systemone.runtime.prompt import render_texts
from tests.memory_probe import probe

QUESTIONS = {f"q{i}": {"type": "noul", "instructions": f"Is it urgent? ({i})"} for i in range(64)}


def refused_within(service, body, seconds):
    start = time.monotonic()
    with pytest.raises(DecisionError) as info:
        service.prepare(body)
    took = time.monotonic() - start
    assert took < seconds, f"refused after {took:.1f} s"
    return info.value.message


def test_d3_a_state_over_the_character_bound_is_refused_before_tokenizing(d3_service):
    most = d3_service.max_model_len * d3_service.engine.max_chars_per_token
    message = refused_within(d3_service, {"state": "word " * (most // 5 + 1000), "questions": QUESTIONS}, 3)
    assert message.startswith("question 'q0': the prompt has ") and f"more than the {most}" in message


def test_d3_a_state_over_the_token_limit_is_refused_after_one_question(d3_service):
    """About 100,000 tokens of state under the character bound: 64 tokenizations of it took 20 s and more."""
    state = " ".join(f"w{i}" for i in range(50_000))
    message = refused_within(d3_service, {"state": state, "questions": QUESTIONS}, 3)
    assert message.startswith("question 'q0': the prompt has ") and "max_model_len=" in message


class CountingTokenizer:
    """The tokenizers library's tokenizer, counting the characters it is asked to encode."""

    def __init__(self, inner):
        self.inner, self.chars = inner, 0

    def encode(self, text, *args, **kwargs):
        self.chars += len(text)
        return self.inner.encode(text, *args, **kwargs)

    def encode_batch(self, texts, *args, **kwargs):
        self.chars += sum(len(text) for text in texts)
        return self.inner.encode_batch(texts, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("family", ["d3", "d1"])
def test_a_short_first_question_and_long_others_cost_one_long_tokenizing(request, monkeypatch, family):
    """Issue 50 item 7: only the first prompt was checked before all were tokenized, so a short first question and
    14 long ones (58.5 MB) cost 48 s and 4.41 GB before their 400. Every prompt's characters are checked as it is
    rendered, and each is checked on its tokens before those after it are tokenized: here 14 questions of 150,000
    words, each under the character bound and over the token limit, are refused after one of them is tokenized."""
    service = request.getfixturevalue(f"{family}_service")
    tokenizer = service.engine.artifact.tokenizer
    counting = CountingTokenizer(tokenizer._tokenizer)
    monkeypatch.setattr(tokenizer, "_tokenizer", counting)
    long = " ".join(f"w{i}" for i in range(150_000))
    questions = {"q0": {"type": "noul"}, **{f"q{i}": {"type": "noul", "instructions": long} for i in range(1, 15)}}
    message = refused_within(service, {"state": "x", "questions": questions}, 10)
    assert ("question 'q1'" in message) if family == "d3" else ("input tokens" in message), message
    assert counting.chars < 2 * len(long), (counting.chars, len(long))


def test_d1_a_state_over_the_limits_is_refused_after_one_question(d1_service):
    state = " ".join(f"w{i}" for i in range(100_000))
    message = refused_within(d1_service, {"state": state, "questions": QUESTIONS}, 3)
    assert "input tokens, which exceeds this limit" in message or "characters (more than" in message


@pytest.mark.parametrize("family", ["d3", "d1"])
def test_a_json_state_of_3_million_numbers_is_refused_with_its_memory_bounded(request, tmp_path, family):
    """Read as the server reads a body, then refused on its characters: its peak memory is the document and its
    rendering, not an object per value. Before, the body check made three objects a value (about 480 MB), and d1's
    indented rendering a string a value (about 200 MB); now d3 peaks near 0 MB and d1 near 60 MB over the loaded
    server (tests/memory_probe.py samples RSS)."""
    artifact = request.getfixturevalue(f"{family}_artifact")
    out = probe(artifact, {"state": [0] * 3_000_000, "questions": QUESTIONS}, tmp_path, 1500)
    assert out.get("status") == 400 and "characters" in out["message"], out
    assert out["peak_increase_mb"] < 150, out


def deep(items: int) -> list:
    """`items` one-item lists 250 levels down: indented two spaces a level, about 1,500 characters each."""
    return json.loads("[" * 250 + ",".join(["[0]"] * items) + "]" * 250)


def test_d1_a_deeply_nested_state_is_refused_on_its_length_without_being_rendered(d1_service, d1_artifact, tmp_path):
    """d1 shows a JSON state indented (spec 3.1), so a state's text can be hundreds of times its bytes. Its length
    is worked out first, and the refusal names the number of characters rendering it gives. 200,000 lists (an
    800 KB body, 302 million characters) took 7.7 s and 314 MB before, when the text was made."""
    body = {"state": deep(20_000), "questions": QUESTIONS}
    request, questions = d1_service.validate(body)
    engine = d1_service.engine
    made = len(render_texts(engine.artifact.template, engine.family, request, questions[:1])[0])
    message = refused_within(d1_service, body, 3)
    assert f"your prompt contains {made} characters" in message, message
    out = probe(d1_artifact, {"state": deep(200_000), "questions": QUESTIONS}, tmp_path, 1500)
    assert out.get("status") == 400 and int(re.search(r"contains (\d+) characters", out["message"])[1]) > 3e8, out
    assert out["peak_increase_mb"] < 100 and out["seconds"] < 3, out
