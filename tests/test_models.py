"""The family contracts without a model: question parsing (spec 2), the d3 prompt pieces and read (spec 4.2,
4.4, 4.5, 4.13) and the answers (spec 5, with the values of vLLM's own tests, spec 7.1)."""

from __future__ import annotations

import pytest

from systemone.models.d3 import D3Family, DecisionConfig
from systemone.models.errors import DecisionError
from systemone.models.family import Readout, label_softmax
from systemone.models.questions import Question, Read, coerce_text, parse_questions
from systemone.server.errors import http_status

CODES = ["A", "B", "C", "D"]


def family(temperature: float = 0.5) -> D3Family:
    return D3Family(DecisionConfig.from_dict({"format_version": 1, "codes": CODES, "token_ids": [32, 33, 34, 35],
                                              "temperature": temperature,
                                              "attention_mode": "noncausal_full_attention"}))


def one(spec: dict, qid: str = "q") -> Question:
    return parse_questions({qid: spec}, lambda _: 255)[0]


# -- spec 2.2, 2.6 ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, text", [("  kept  ", "  kept  "), (None, ""), (5, "5"), (True, "True"),
                                         ([1, "a"], "[1, 'a']"), ({"a": 1}, "{'a': 1}"), (1e20, "1e+20"),
                                         (1.0, "1.0")])
def test_instructions_coercion(value, text):
    assert coerce_text(value) == text


def test_option_descriptions_use_python_str():
    """Spec 2.1: a description is str() of the JSON value; null stays None; "" stays ""."""
    q = one({"type": "choice", "criteria": {"a": None, "b": "", "c": 1.5, "d": {"k": [True]}}})
    assert [o.description for o in q.options] == [None, "", "1.5", "{'k': [True]}"]


def test_noul_options_are_yes_then_no():
    q = one({"type": "noul", "criteria": {"false": "late"}})
    assert [(o.name, o.description) for o in q.options] == [("yes", None), ("no", "late")]


# -- spec 4.2: decision_config.json -----------------------------------------------------------------------------
@pytest.mark.parametrize("patch, message", [
    ({"format_version": 2}, "unsupported decision_config.json format_version 2; vLLM reads version 1"),
    ({"pooling": "mean"}, "unsupported decision_config.json pooling 'mean'"),
    ({"attention_mode": "bidirectional"}, "unsupported decision_config.json attention_mode 'bidirectional'"),
    ({"token_ids": [1]}, "decision_config.json must list one token id per answer code"),
    ({"prompt": "d2"}, "unknown decision prompt 'd2'"),
    ({"temperature": 0}, "temperature must be positive"),
])
def test_decision_config_validation(patch, message):
    raw = {"format_version": 1, "codes": ["A", "B"], "token_ids": [32, 33], **patch}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DecisionConfig.from_dict(raw)


def test_decision_config_defaults():
    config = DecisionConfig.from_dict({"format_version": 1, "codes": ["A"], "token_ids": [32], "extra": 1})
    assert (config.attention_mode, config.pooling, config.temperature, config.prompt) == ("causal", "last", 1.0, "d3")


# -- spec 4.4, 4.5 (appendix D 3, 5, 8, 9) ---------------------------------------------------------------------
@pytest.mark.parametrize("state, text", [(None, "(empty)"), ("", "(empty)"), (" ", " "), ("plain", "plain"),
                                         ({"team": "billing", "n": [1, 2]}, '{"team": "billing", "n": [1, 2]}'),
                                         ({"message": "Français 日本語"}, '{"message": "Français 日本語"}'),
                                         (0, "0"), (False, "false"), ([], "[]"), ({"k": "a\nb"}, '{"k": "a\\nb"}')])
def test_d3_state_rendering(state, text):
    assert family().render_state(state) == text


def test_d3_choice_lines_name_and_description():
    q = one({"type": "choice", "criteria": {"billing": "money", "outage": None, "other": ""}})
    assert family().option_texts(q) == ["billing: money", "outage", "other: "]


def test_d3_noul_lines_put_no_first_with_defaults():
    assert family().option_texts(one({"type": "noul"})) == ["No / false", "Yes / true"]
    q = one({"type": "noul", "criteria": {"true": "", "false": "later"}})
    assert family().option_texts(q) == ["later", "Yes / true"]


def test_d3_user_text_layout():
    q = one({"type": "score", "instructions": "", "criteria": ["calm", "angry"]})
    assert family().user_text(q, "S") == ("State:\nS\n\nQuestion:\nChoose the best matching option.\n\nOptions:\n"
                                          "A: calm\nB: angry\n\nReply with only the code of the best option.")


def test_d3_read_takes_first_n_codes_divided_by_temperature():
    """Spec 4.13: softmax over the first N code logits / T; noul maps [p(code1), p(code0)] to [yes, no]."""
    logits = [1.0, 2.0, 30.0, 40.0]  # codes C, D are beyond the question's options and must not count
    noul = one({"type": "noul"})
    read = family(0.5).read(noul, family(0.5).labels(noul, None), Readout(dict(enumerate(logits))))
    # softmax([1/0.5, 2/0.5]), worked out to 50 digits (decimal) outside the code under test
    assert read.probs == pytest.approx((0.8807970779778824, 0.11920292202211756), rel=1e-14)
    assert read.label_mass == 1.0 and read.argmax_is_label is True
    three = one({"type": "choice", "criteria": {"x": None, "y": None, "z": None}})
    choice = family(0.5).read(three, family(0.5).labels(three, None), Readout(dict(enumerate(logits))))
    assert choice.probs == pytest.approx((6.47023492564546e-26, 4.780892883885469e-25, 1.0), rel=1e-14)


def test_label_softmax_is_vllms():
    """Spec 2.5: subtract the max, math.exp, divide by the left-to-right Python sum, float64."""
    probs = label_softmax([0.1, -3.0, 2.5])
    # the values worked out to 50 digits (decimal), and float64's sum of them
    assert probs == pytest.approx([0.08286222304343932, 0.0037328770566640275, 0.9134048998998966], rel=1e-15)
    assert label_softmax([1000.0, 1000.0]) == [0.5, 0.5]  # the max is subtracted first: no overflow


# -- spec 5.1 with the values of vLLM's tests (spec 7.1) -------------------------------------------------------
def test_choice_answer_shape():
    q = one({"type": "choice", "criteria": {"billing": "money", "outage": None, "other": None}})
    assert q.answer(Read((0.2, 0.7, 0.1), 0.5, True)) == {
        "type": "choice", "choice": "outage", "probabilities": {"billing": 0.2, "outage": 0.7, "other": 0.1},
        "confidence": 0.35}


def test_noul_answer_shape():
    assert one({"type": "noul"}).answer(Read((0.8, 0.2), 0.5, True)) == {
        "type": "noul", "noul": 0.8, "probabilities": {"yes": 0.8, "no": 0.2}, "confidence": 0.4}


def test_score_answer_shape():
    q = one({"type": "score", "criteria": ["calm", "annoyed", "furious"]})
    answer = q.answer(Read((0.5, 0.25, 0.25), 0.4, True))
    assert answer == {"type": "score", "score": 0.75, "legend": {"0": "calm", "1": "annoyed", "2": "furious"},
                      "probabilities": {"0": 0.5, "1": 0.25, "2": 0.25}, "confidence": 0.2}


def test_ties_pick_the_first_option():
    q = one({"type": "choice", "criteria": {"a": None, "b": None}})
    assert q.answer(Read((0.5, 0.5), 1.0, True))["choice"] == "a"


def test_duplicate_keys_keep_the_last_value():
    """Spec 8 Q8: the body is read by Python's json, where the last duplicate key wins."""
    import json

    q = one(json.loads('{"type": "choice", "criteria": {"a": "first", "a": "second"}}'))
    assert [(o.name, o.description) for o in q.options] == [("a", "second")]


def test_errors_are_decision_errors_with_status_400():
    with pytest.raises(DecisionError) as info:
        one({"type": "noul", "criteria": "yes"})
    assert http_status(info.value) == (400, "BadRequestError") and info.value.param is None
