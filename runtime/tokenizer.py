"""The artifact's tokenizer: `tokenizer.json` exactly as the reference tokenizes (spec 3.4, 4.7).

The export writes the tokenizer the reference builds (for d3, transformers' Qwen3.5 rebuild: NFC + the Qwen3.5
split regex), so the runtime loads it as it is. Prompts are encoded in one piece without added special tokens;
special tokens written in the text are matched, as vLLM matches them.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


class PromptTokenizer:
    def __init__(self, path: str | Path):
        self._tokenizer = Tokenizer.from_file(str(path))
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def token_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def added_ids(self) -> set[int]:
        """Ids of the added vocabulary (special and added tokens)."""
        return set(self._tokenizer.get_added_tokens_decoder())

    def max_token_chars(self) -> int:
        """Characters of the longest vocabulary entry (vLLM's bound on prompt characters per token, spec 3.9)."""
        return max(len(token) for token in self._tokenizer.get_vocab(with_added_tokens=True))
