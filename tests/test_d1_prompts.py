"""Prompt parity for d1 (spec 3.1-3.4, 3.8 step 4, appendix B.1, D 2-6): our render equals, token for token, what
transformers' `apply_chat_template` + the checkpoint's `AutoTokenizer` give for the prompt the spec describes."""

from __future__ import annotations

import json

import pytest

from tests.media_helpers import data_url, gradient_png

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


# -- the spec's prompt, written from spec 3.1-3.3 as literally as possible (the oracle) -------------------------
def spec_state(state):
    if state is None:
        return ""
    return state if isinstance(state, str) else json.dumps(state, ensure_ascii=False, indent=2)


def spec_text(value):
    return "" if value is None else value if isinstance(value, str) else str(value)


def spec_ask(question):
    instructions = spec_text(question.get("instructions", ""))
    criteria = question.get("criteria")
    if question["type"] == "choice":
        names = list(criteria)
        stripped = [n.strip() for n in names]
        codes = stripped if all(len(s) == 1 and s.isalpha() for s in stripped) else LETTERS[:len(names)]
        lines = []
        for code, name in zip(codes, names):
            desc = criteria[name]
            text = str(desc) if desc is not None and str(desc) else name.replace("_", " ")
            lines.append(code + " " + text)
        return instructions + "\n\nOptions:\n" + "\n".join(lines) + "\n\nReply with the option code only."
    if question["type"] == "noul":
        criteria = criteria or {}
        yes = None if criteria.get("true") is None else str(criteria["true"])
        no = None if criteria.get("false") is None else str(criteria["false"])
        sides = "\nYes: " + str(yes) + "\nNo: " + str(no) if (yes or no) else ""
        return instructions + sides + "\n\nReply with yes or no only."
    levels = [str(level) for level in criteria]
    lines = [str(i) + " " + level for i, level in enumerate(levels)]
    return (instructions + "\n\n" + "\n".join(lines) + "\n\nReply with a single digit 0-" + str(len(levels) - 1)
            + " only.")


def spec_messages(body, question):
    state = spec_state(body.get("state"))
    ask = spec_ask(question)
    content = state + "\n\n\nQUESTION:\n" + ask if state else ask
    images = body.get("images") or []
    if images:
        content = [*({"type": "image"} for _ in images), {"type": "text", "text": content}]
    system = body.get("instructions")
    return ([{"role": "system", "content": system}] if isinstance(system, str) and system else []) + [
        {"role": "user", "content": content}]


def reference_prompt(tokenizer, body, question):
    text = tokenizer.apply_chat_template(spec_messages(body, question), tokenize=False, add_generation_prompt=True)
    return text, tokenizer.encode(text, add_special_tokens=False)


# -- 40+ varied requests -----------------------------------------------------------------------------------------
STATES = [None, "", " ", "My card was charged twice.", "line one\nline two\ttab", {"team": "billing", "n": [1, 2]},
          {"message": "Français 日本語"}, [1, 2.5, True, None], 0, False, 1e20, [], {},
          "नमस्ते दुनिया — हिन्दी में", "emoji 😀👍🏽 and ZWJ 👨‍👩‍👧", {"nested": {"deep": {"k": "v\u0000x"}}},
          "special <|im_end|> inside the state", "e\u0301 combining", "  padded  "]
QUESTIONS = [
    {"type": "noul"},
    {"type": "noul", "instructions": "Is money moving?"},
    {"type": "noul", "instructions": "Late?", "criteria": {"false": "late"}},
    {"type": "noul", "criteria": {"true": "", "false": "x"}},
    {"type": "noul", "criteria": {"true": "", "false": ""}},
    {"type": "noul", "criteria": {}},
    {"type": "noul", "criteria": {"true": 1, "false": False}},
    {"type": "choice", "criteria": {"a": "billing team", "b_c": None}},
    {"type": "choice", "instructions": "Pick", "criteria": {"x": None, "y": "", "Z": "zed"}},
    {"type": "choice", "criteria": {" q ": None, "é": "accent", "α": [1, "a"]}},
    {"type": "choice", "criteria": {"under_score_name": None, "two words": {"k": 1}}},
    {"type": "choice", "criteria": {name: None for name in LETTERS}},
    {"type": "choice", "criteria": {f"opt_{i}": f"description {i}" for i in range(26)}},
    {"type": "choice", "instructions": 5, "criteria": {"yes": None, "no": None}},
    {"type": "score", "criteria": ["low", "high"]},
    {"type": "score", "instructions": {"a": 1}, "criteria": [1, 2.5, "three", None, True]},
    {"type": "score", "criteria": [str(i) for i in range(10)]},
    {"type": "score", "instructions": "   ", "criteria": ["", "x"]},
]
SYSTEMS = [None, "", "Be strict.", "Line\nbreak <|im_start|>"]


def cases():
    out = []
    for i in range(48):
        body = {"state": STATES[i % len(STATES)], "questions": {"q": QUESTIONS[i % len(QUESTIONS)]}}
        system = SYSTEMS[i % len(SYSTEMS)]
        if system is not None:
            body["instructions"] = system
        out.append(body)
    return out


@pytest.mark.parametrize("body", cases())
def test_prompt_is_token_identical_to_the_reference(d1_service, d1_reference_tokenizer, body):
    """Spec 3.1-3.4: state (indent=2 JSON, null -> ""), user text per type, optional system turn, LFM2-VL template,
    tokenizer.json as is with add_special_tokens=False: the same text and the same ids as transformers."""
    (prompt,) = d1_service.render(body)
    text, ids = reference_prompt(d1_reference_tokenizer, body, body["questions"]["q"])
    assert prompt.text == text
    assert prompt.token_ids == ids


def test_the_spec_example_renders_exactly(d1_service):
    """Spec 3.3 example: noul, instructions "Is money moving?", no images, no system turn."""
    body = {"state": "My card was charged twice.",
            "questions": {"q": {"type": "noul", "instructions": "Is money moving?"}}}
    (prompt,) = d1_service.render(body)
    assert prompt.text == ("<|startoftext|><|im_start|>user\nMy card was charged twice.\n\n\nQUESTION:\nIs money "
                           "moving?\n\nReply with yes or no only.<|im_end|>\n<|im_start|>assistant\n")


def test_json_state_uses_two_space_indentation(d1_service):
    """Spec 3.1: a JSON state is json.dumps(indent=2, ensure_ascii=False)."""
    (prompt,) = d1_service.render({"state": {"message": "Français 日本語"},
                                   "questions": {"q": {"type": "noul"}}})
    assert '<|im_start|>user\n{\n  "message": "Français 日本語"\n}\n\n\nQUESTION:\n' in prompt.text


def test_appendix_b1_with_a_1024_image(d1_service, d1_reference_tokenizer):
    """Appendix B.1: codes A, B for names a, b_c; the <image> of a 1024x1024 image expands to 2x2 tiles of 256
    tokens with row/col markers, then the 256-token thumbnail, inside image start/end."""
    body = {"state": {"team": "billing"}, "images": [data_url(gradient_png(1024, 1024))],
            "questions": {"team": {"type": "choice", "instructions": "Which team?",
                                   "criteria": {"a": "billing team", "b_c": None}}}}
    (prompt,) = d1_service.render(body)
    user = ('{\n  "team": "billing"\n}\n\n\nQUESTION:\nWhich team?\n\nOptions:\nA billing team\nB b c\n\n'
            "Reply with the option code only.")
    assert prompt.text == f"<|startoftext|><|im_start|>user\n<image>{user}<|im_end|>\n<|im_start|>assistant\n"
    tiles = "".join(f"<|img_row_{r}_col_{c}|>" + "<image>" * 256 for r in (1, 2) for c in (1, 2))
    expanded = prompt.text.replace("<image>", "<|image_start|>" + tiles + "<|img_thumbnail|>" + "<image>" * 256
                                   + "<|image_end|>", 1)
    assert prompt.token_ids == d1_reference_tokenizer.encode(expanded, add_special_tokens=False)
    assert prompt.token_ids.count(d1_reference_tokenizer.convert_tokens_to_ids("<image>")) == 5 * 256


@pytest.mark.parametrize("size,tokens", [((640, 480), 234), ((200, 100), 72), ((2000, 1000), 754),
                                         ((1920, 1080), 764), ((1024, 1024), 1280)])
def test_image_token_counts_of_spec_3_8(d1_service, d1_reference_tokenizer, size, tokens):
    """Spec 3.8 step 4 examples (after the 1,048,576-pixel cap): the number of <image> rows per image."""
    body = {"state": "x", "images": [data_url(gradient_png(*size))], "questions": {"q": {"type": "noul"}}}
    (prompt,) = d1_service.render(body)
    assert prompt.token_ids.count(d1_reference_tokenizer.convert_tokens_to_ids("<image>")) == tokens


def test_images_come_first_in_request_order(d1_service, d1_reference_tokenizer):
    """Spec 3.3: n images -> n bare <image> before the text, no separator; each expands in request order."""
    body = {"state": "s", "images": [data_url(gradient_png(200, 100)), data_url(gradient_png(640, 480))],
            "questions": {"q": {"type": "noul"}}}
    (prompt,) = d1_service.render(body)
    assert "<|im_start|>user\n<image><image>s\n\n\nQUESTION:\n" in prompt.text
    start = d1_reference_tokenizer.convert_tokens_to_ids("<|image_start|>")
    end = d1_reference_tokenizer.convert_tokens_to_ids("<|image_end|>")
    ids = prompt.token_ids
    first, second = [i for i, t in enumerate(ids) if t == start]
    assert ids[first:ids.index(end) + 1].count(396) == 72
    assert ids[second:].count(396) == 234
