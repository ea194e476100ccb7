"""A request's prompts tokenized once for the start they share (runtime/tokenizer.py, docs/tokenization.md): each
prompt's ids equal its own whole encoding, for d1's tokenizer and d3's, whatever characters lie where the prompts
part; the shared start is really shared; a tokenizer whose pieces are not known to be local is encoded whole."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from systemone.runtime.tokenizer import PromptTokenizer, common_start

# Characters that stress a cut: letters and digits next to punctuation, runs of spaces and newlines, apostrophes
# before contraction letters, combining marks and Hangul jamo (which NFC composes), other scripts, emoji, and the
# pieces of special tokens.
ALPHABET = (list("abcxyzSTLMDVRE0123456789") * 3 + list(".,:;\"'{}[]()-_/<>|!?#@") * 2
            + [" ", "  ", "\n", "\n\n", "\t", " \n", "'s", "'ll", "'RE", "e\u0301", "\u0301", "\u1100\u1161",
               "\u11a8", "é", "日本", "😀", "<|im_start|>", "<|im_end|>", "<image>", "<|im_", "<|vision_end|>"])


def random_text(rng: random.Random, length: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(length))


@pytest.fixture(scope="module", params=["d1", "d3"])
def tokenizer_json(request, tmp_path_factory) -> Path:
    reference = request.getfixturevalue("d1_reference_tokenizer" if request.param == "d1" else "reference_tokenizer")
    path = tmp_path_factory.mktemp(request.param) / "tokenizer.json"
    reference.backend_tokenizer.save(str(path))  # what the export writes (spec 3.4, 4.7)
    return path


@pytest.fixture(scope="module")
def tokenizer(tokenizer_json) -> PromptTokenizer:
    return PromptTokenizer(tokenizer_json)


class Recorder:
    """The texts a tokenizer encodes in batches (its `_encodings`, which every batch goes through)."""

    def __init__(self, tokenizer: PromptTokenizer):
        self.lengths: list[int] = []
        self._encodings = tokenizer._encodings

    def __call__(self, texts: list[str]):
        self.lengths.extend(len(t) for t in texts)
        return self._encodings(texts)


def test_every_prompt_gets_its_own_whole_encoding(tokenizer, monkeypatch):
    rng = random.Random(0)
    recorder = Recorder(tokenizer)
    monkeypatch.setattr(tokenizer, "_encodings", recorder)
    cut = 0
    for _ in range(400):
        start = random_text(rng, rng.randrange(0, 200))
        head = start + random_text(rng, rng.randrange(0, 40))
        texts = [start[:rng.randrange(len(start) + 1)] if rng.random() < 0.2 else start
                 for _ in range(rng.randrange(1, 5))]
        texts = [t + random_text(rng, rng.randrange(0, 40)) for t in texts]
        recorder.lengths.clear()
        shared = tokenizer.encode_sharing(head, tokenizer.encode(head), texts)
        cut += recorder.lengths != [len(t) for t in texts]
        assert shared == [tokenizer.encode(t) for t in texts], (head, texts)
    assert cut > 100  # the shared start was taken, not only the whole encodings


def test_sixteen_prompts_of_one_state_encode_the_state_once(tokenizer, monkeypatch):
    state = json.dumps({"ticket": "Charged twice for order 1234", "history": [
        {"at": f"2026-11-{day:02d}", "note": f"customer wrote about invoice {37 * day}"} for day in range(1, 29)]},
        indent=2)
    texts = [f"<|im_start|>user\n{state}\n\n\nQUESTION:\nIs case {i} urgent?<|im_end|>\n<|im_start|>assistant\n"
             for i in range(16)]
    head_ids = tokenizer.encode(texts[0])
    recorder = Recorder(tokenizer)
    monkeypatch.setattr(tokenizer, "_encodings", recorder)
    assert tokenizer.encode_sharing(texts[0], head_ids, texts[1:]) == [tokenizer.encode(t) for t in texts[1:]]
    assert len(recorder.lengths) == 15 and max(recorder.lengths) < 100 < len(state)


def test_a_tokenizer_with_another_split_is_encoded_whole(tokenizer_json, tmp_path, monkeypatch):
    config = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    config["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] += "|x"
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(config))
    other = PromptTokenizer(path)
    texts = ["state: some text, then question one", "state: some text, then question two"]
    recorder = Recorder(other)
    monkeypatch.setattr(other, "_encodings", recorder)
    assert other.encode_sharing(texts[0], other.encode(texts[0]), texts[1:]) == [other.encode(texts[1])]
    assert recorder.lengths == [len(texts[1])]


@pytest.mark.parametrize("step", [1, 3, 4096])
def test_the_common_start_of_two_texts(step):
    rng = random.Random(step)
    for _ in range(3000):
        a = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 40)))
        b = a[:rng.randrange(len(a) + 1)] + "".join(rng.choice("ab") for _ in range(rng.randrange(0, 8)))
        expected = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_start(a, b, step) == expected, (a, b)


def test_a_tokenizer_file_is_parsed_once_for_its_contents_wherever_it_lies(tmp_path):
    from tokenizers import Tokenizer, models

    def saved(name: str, vocab: dict[str, int]) -> Path:
        path = tmp_path / name / "tokenizer.json"
        path.parent.mkdir()
        Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")).save(str(path))
        return path

    first, copy = saved("a", {"[UNK]": 0, "yes": 1}), saved("b", {"[UNK]": 0, "yes": 1})
    other = saved("c", {"[UNK]": 0, "no": 1})
    assert PromptTokenizer(first)._tokenizer is PromptTokenizer(copy)._tokenizer
    assert PromptTokenizer(other)._tokenizer is not PromptTokenizer(first)._tokenizer
    assert PromptTokenizer(other).token_id("no") == 1 and PromptTokenizer(copy).token_id("no") is None
