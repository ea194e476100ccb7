"""The Liquid read of family d1, rule by rule (spec 2.3, 3.1, 3.2, 3.6, 3.7, 5.1; appendix D 4-7)."""

from __future__ import annotations

import json
import math

import pytest

from systemone.models.d1 import ASKED, D1Family, codes, indented_json_length
from systemone.models.errors import DecisionError
from systemone.models.family import Labels, Readout, StateTooLong
from systemone.models.questions import parse_questions
from systemone.models.request import parse_request
from systemone.runtime.tokenizer import PromptTokenizer

FAMILY = D1Family()


@pytest.fixture(scope="module")
def encode(d1_checkpoint):
    return PromptTokenizer(d1_checkpoint / "tokenizer.json").encode


def question(spec: dict, qid: str = "q"):
    (parsed,) = parse_questions({qid: spec}, FAMILY.option_limit)
    return parsed


def ask(q) -> str:
    """The user text d1 asks a question with, after the state (spec 3.2)."""
    return ASKED[q.type].text(q)


@pytest.mark.parametrize("state,text", [(None, ""), ("", ""), ("  ", "  "), (0, "0"), (False, "false"), ([], "[]"),
                                        ({}, "{}"), ({"a": [1, "é"]}, '{\n  "a": [\n    1,\n    "é"\n  ]\n}')])
def test_state_rendering(state, text):
    """Spec 3.1: null -> "", strings as they are, anything else json.dumps(indent=2, ensure_ascii=False)."""
    assert FAMILY.render_state(state) == text


def test_state_rendering_is_json_dumps_with_an_indent_of_two():
    """Spec 3.1, on a state with every JSON kind, nesting, empty containers, escapes and non-ASCII text."""
    state = {"a": [1, 2.5, -0.0, 1e300, None, True, {}, [], {"b": [[], [{}]]}], "é\n\"x\"": "\u2028 \t ß", "": {"c": ""}}
    assert FAMILY.render_state(state) == json.dumps(state, ensure_ascii=False, indent=2)


@pytest.mark.parametrize("state", [0, "x", [], {}, [[]], [{}], {"a": []}, [1, [2, [3, {"k": [None, True]}]]],
                                   {"é": {"ß": ["\u2028", 1.5, -0.0]}, "": [[[[]]]]}, [[0]] * 3,
                                   json.loads("[" * 300 + "0" + "]" * 300)])
def test_the_length_of_a_state_is_known_without_rendering_it(state):
    assert indented_json_length(state) == len(json.dumps(state, ensure_ascii=False, indent=2))


def test_a_state_longer_than_asked_is_not_rendered():
    """Two spaces a level: 1,000 one-item lists 100 levels down are about 200 characters each once indented."""
    state = json.loads("[" * 100 + ",".join(["[0]"] * 1000) + "]" * 100)
    length = len(json.dumps(state, ensure_ascii=False, indent=2))
    with pytest.raises(StateTooLong) as info:
        FAMILY.render_state(state, max_chars=length - 1)
    assert info.value.length == length > 200_000
    assert FAMILY.render_state(state, max_chars=length) == json.dumps(state, ensure_ascii=False, indent=2)


def test_empty_state_means_the_question_alone():
    """Spec 3.2: no `QUESTION:` header when the rendered state is empty."""
    q = question({"type": "noul", "instructions": "Now?"})
    assert FAMILY.user_text(q, "") == "Now?\n\nReply with yes or no only."
    assert FAMILY.user_text(q, "s") == "s\n\n\nQUESTION:\nNow?\n\nReply with yes or no only."


@pytest.mark.parametrize("criteria,sides", [
    (None, ""), ({}, ""), ({"true": "", "false": ""}, ""), ({"false": "late"}, "\nYes: None\nNo: late"),
    ({"true": "", "false": "x"}, "\nYes: \nNo: x"), ({"true": 1, "false": False}, "\nYes: 1\nNo: False")])
def test_noul_sides(criteria, sides):
    """Spec 3.2 / D 5: sides only when either description is truthy; a missing side prints None."""
    assert ask(question({"type": "noul", "criteria": criteria})) == sides + "\n\nReply with yes or no only."


def test_choice_lines_codes_and_underscores():
    """Spec 3.2, 3.6 / D 4: `CODE text`, description if non-empty else the name with _ -> space; codes are the
    stripped names when all are single letters of any script, else A, B, ..."""
    q = question({"type": "choice", "instructions": "I", "criteria": {"a": "billing team", "b_c": None, "d": ""}})
    assert ask(q) == "I\n\nOptions:\nA billing team\nB b c\nC d\n\nReply with the option code only."
    assert codes(question({"type": "choice", "criteria": {" é ": None, "α": None, "Z": None}})) == ["é", "α", "Z"]
    assert codes(question({"type": "choice", "criteria": {"ab": None, "c": None}})) == ["A", "B"]


def test_score_lines():
    """Spec 3.2: `i level` lines and the digit range."""
    q = question({"type": "score", "criteria": ["low", 2, None]})
    assert ask(q) == "\n\n0 low\n1 2\n2 None\n\nReply with a single digit 0-2 only."


def test_label_groups_keep_single_token_forms(encode):
    """Spec 3.6: choice (code, " code"), noul yes/Yes/YES vs no/No/NO, score digits; a form counts only if it is
    one token standalone (LFM2 splits "YES"), in form order."""
    choice = FAMILY.labels(question({"type": "choice", "criteria": {"xx": None, "yy": None}}), encode)
    assert choice.groups == ((encode("A")[0], encode(" A")[0]), (encode("B")[0], encode(" B")[0]))
    noul = FAMILY.labels(question({"type": "noul"}), encode)
    assert len(encode("YES")) == 2
    assert noul.groups[0] == (encode("yes")[0], encode("Yes")[0])
    score = FAMILY.labels(question({"type": "score", "criteria": ["a", "b", "c"]}), encode)
    assert score.groups == tuple((encode(str(i))[0],) for i in range(3))


def test_a_letter_that_is_several_tokens_is_refused(encode):
    """Spec 3.6: a single-letter name such as 丙 becomes the code, but it is two LFM2 tokens -> 400 naming it."""
    assert len(encode("丙")) > 1
    q = question({"type": "choice", "criteria": {"丙": None, "x": None}})
    with pytest.raises(DecisionError, match=r"^question 'q': label '丙' is not one distinct token for this model$"):
        FAMILY.labels(q, encode)


def test_the_same_code_twice_is_refused(encode):
    """Spec 3.6 example: "a" and " a" both strip to a -> the second label repeats the first group -> 400."""
    q = question({"type": "choice", "criteria": {"a": None, " a": None}})
    with pytest.raises(DecisionError, match=r"label 'a' is not one distinct token"):
        FAMILY.labels(q, encode)


def test_the_read_takes_group_maxima_softmax_mass_and_argmax():
    """Spec 3.7: option score = max log-prob of its group; probs = label softmax; label_mass = sum of exp over
    every id of every group; argmax_is_label when the greedy token is a group id."""
    q = question({"type": "noul"})
    groups = Labels(((10, 11), (20,)))
    logprobs = {10: math.log(0.1), 11: math.log(0.3), 20: math.log(0.2)}
    read = FAMILY.read(q, groups, Readout(logprobs, 11))
    assert read.probs == pytest.approx((0.6, 0.4))
    assert read.label_mass == pytest.approx(0.6)
    assert read.argmax_is_label
    assert not FAMILY.read(q, groups, Readout(logprobs, 99)).argmax_is_label
    answer = q.answer(read)
    assert answer["confidence"] == pytest.approx(0.6 * 0.6)  # spec 5.1: max(p) * label_mass


def test_option_limits_name_the_limit():
    """Spec 2.3 / 7.6 cases 6 and 8: choice at most 26 (A-Z), score at most 10 levels.

    Issue 5 item 5 (more than 26 options): LFM2 encodes every one- to three-digit number as one token
    ("27" is one id), so a two-digit code could be read in one step, but no artefact gives the prompt the
    checkpoint's own runtime uses for two-digit codes, and vLLM refuses; the 400 stays, naming the limit."""
    with pytest.raises(DecisionError, match=r"^question 'q': at most 26 options for this model$"):
        question({"type": "choice", "criteria": {f"o{i}": None for i in range(27)}})
    with pytest.raises(DecisionError, match=r"^question 'q': at most 10 options for this model$"):
        question({"type": "score", "criteria": [str(i) for i in range(11)]})


def test_thinking_and_template_override_are_refused():
    """Spec 3.3 / 6.3: truthy enable_thinking -> 400; spec 8 Q16 decided: a request cannot bring its own template."""
    for kwargs, message in (({"enable_thinking": True}, "thinking must be off"),
                            ({"enable_thinking": "no"}, "thinking must be off"),
                            ({"chat_template": "{{ 1 }}"}, "chat_template")):
        request = parse_request({"state": None, "questions": {"q": {"type": "noul"}}, "chat_template_kwargs": kwargs})
        with pytest.raises(DecisionError, match=message):
            FAMILY.check_request(request, [])
    request = parse_request({"state": None, "questions": {}, "chat_template_kwargs": {"enable_thinking": False,
                                                                                     "custom": None}})
    FAMILY.check_request(request, [])
    assert FAMILY.template_kwargs(request) == {"enable_thinking": False, "add_generation_prompt": True,
                                               "continue_final_message": False}


def test_instructions_become_a_system_turn_only_when_non_empty():
    """Spec 3.3: a system message only for a non-empty top-level instructions string."""
    q = question({"type": "noul"})
    for instructions, roles in ((None, ["user"]), ("", ["user"]), ("Be strict.", ["system", "user"])):
        request = parse_request({"state": None, "questions": {"q": {"type": "noul"}}, "instructions": instructions})
        assert [m["role"] for m in FAMILY.messages(request, q, "")] == roles


def test_output_tokens_count_one_per_question():
    """Spec 5.3: d1 generates one token per question."""
    assert FAMILY.output_tokens([question({"type": "noul"})] * 3) == 3
