"""The artifact's tokenizer: `tokenizer.json` exactly as the reference tokenizes (spec 3.4, 4.7).

The export writes the tokenizer the reference builds (for d3, transformers' Qwen3.5 rebuild: NFC + the Qwen3.5
split regex), so the runtime loads it as it is. Prompts are encoded in one piece without added special tokens;
special tokens written in the text are matched, as vLLM matches them.

A request's prompts share their start (the state), so `encode_sharing` takes the first prompt's ids for that
start and encodes only the rest of each: exact where the tokenizer's pieces are local (docs/tokenization.md).
"""

from __future__ import annotations

import functools
import hashlib
import json
import string
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

from tokenizers import Encoding, Tokenizer, models

# The split patterns of LFM2 (d1) and Qwen3.5 (d3). In either, an ASCII letter or digit followed by ASCII punctuation
# is a boundary between pieces, and no piece before it depends on text more than two characters after it.
LOCAL_SPLITS = frozenset({
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
})
BEFORE, AFTER = frozenset(string.ascii_letters + string.digits), frozenset(string.punctuation)
# How far back from where the prompts part a shared start is looked for; past it each prompt is encoded whole.
SEARCH_CHARS = 256
# The tokenizers library holds the GIL through `encode` and lets go of it only in `encode_batch`: a text longer
# than this is encoded as a batch of one, so the event loop keeps answering (1M CJK characters: 2.2 s, the loop held
# for 2.2 s by `encode`, for 36 ms at most by `encode_batch`). Shorter texts keep `encode`, which costs less a call.
GIL_FREE_CHARS = 4096
# Texts with at most this many characters of their own together are tokenized in one batch before any is checked.
CHECK_ALL_AT_ONCE_CHARS = 256 << 10

Checks = Callable[[int, int], None]  # (a text's index, its token count): raises for a prompt too long


def _state(component: object | None) -> dict | None:
    """A tokenizer component's own settings (its JSON), without the vocabulary the whole file carries."""
    return None if component is None else json.loads(component.__getstate__())


def _local_pieces(tokenizer: Tokenizer) -> bool:
    """Whether a tokenizer is one whose pieces `encode_sharing` may cut: no normalizer or NFC (an ASCII character
    composes with nothing), one of LOCAL_SPLITS then byte-level without its own regex, BPE without dropout."""
    pre = _state(tokenizer.pre_tokenizer) or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    return (_state(tokenizer.normalizer) in (None, {"type": "NFC"})
            and len(steps) == 2
            and steps[0].get("type") == "Split" and steps[0].get("behavior") == "Isolated"
            and not steps[0].get("invert") and steps[0].get("pattern", {}).get("Regex") in LOCAL_SPLITS
            and steps[1].get("type") == "ByteLevel" and not steps[1].get("use_regex")
            and not steps[1].get("add_prefix_space")
            and isinstance(tokenizer.model, models.BPE) and tokenizer.model.dropout is None)


def shared_prefix(prompts: Sequence[Sequence[int]]) -> int:
    """Tokens every prompt starts with, leaving each at least its last token to read (a causal family's prefix
    read once for a request's questions)."""
    shortest = min(len(p) for p in prompts)
    length = min((common_start(prompts[0], other, 512) for other in prompts[1:]), default=shortest)
    return min(length, shortest - 1)


def common_start(a: Sequence, b: Sequence, step: int = 4096) -> int:
    """How many items two texts (or id lists) start with alike: equal spans of `step` skipped, then the differing
    one halved (slices compare in C)."""
    n, low = min(len(a), len(b)), 0
    while low < n and a[low:low + step] == b[low:low + step]:
        low += step
    if low >= n:
        return n
    high = min(low + step, n)  # a[low:high] != b[low:high]
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if a[low:middle] == b[low:middle] else (low, middle)
    return low if a[low] != b[low] else high


class ParsedTokenizer:
    """A tokenizer file's text parsed, without truncation or padding, and what is read off its whole vocabulary once."""

    def __init__(self, text: str):
        self.tokenizer = Tokenizer.from_str(text)
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()

    @functools.cached_property
    def max_token_chars(self) -> int:
        return max(len(token) for token in self.tokenizer.get_vocab(with_added_tokens=True))


# Tokenizers parsed in this process, by the contents of their file: parsing Qwen3.5's is most of an artifact's load
# (docs/decisions/tokenizer-load.md), and a process that loads an artifact again (serve after the CLI's checks, the
# tests) reads the same file. A parsed tokenizer is only read after, from any thread.
_PARSED: OrderedDict[str, ParsedTokenizer] = OrderedDict()
_PARSED_KEPT = 4
_PARSING = threading.Lock()


def parsed_tokenizer(path: str | Path) -> ParsedTokenizer:
    """The tokenizer in the file `path`, parsed once per contents in a process."""
    data = Path(path).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    with _PARSING:
        if digest not in _PARSED:
            _PARSED[digest] = ParsedTokenizer(data.decode("utf-8"))
            while len(_PARSED) > _PARSED_KEPT:
                _PARSED.popitem(last=False)
        _PARSED.move_to_end(digest)
        return _PARSED[digest]


class PromptTokenizer:
    def __init__(self, path: str | Path):
        self._parsed = parsed_tokenizer(path)
        self._tokenizer = self._parsed.tokenizer
        # Whether `encode_sharing` cuts (where exact); False encodes every text whole (timing's reference). Read
        # from the loaded tokenizer's components, not by parsing the file again.
        self.share_starts = _local_pieces(self._tokenizer)
        # An added token is matched across a cut only if it spans it: a cut this far inside the shared start has
        # the same added tokens around it in every prompt.
        added = self._tokenizer.get_added_tokens_decoder().values()
        self._margin = max((len(token.content) for token in added), default=0) + 3

    def encode(self, text: str, check: Callable[[int], None] | None = None) -> list[int]:
        """`text`'s ids; `check` is given their count first, and may refuse a text too long before its ids are made
        (2.9 million of them took 0.19 s, the GIL held)."""
        if len(text) > GIL_FREE_CHARS:  # the batch call lets the other threads (the event loop) run meanwhile
            encoding = self._encodings([text])[0]
        else:
            encoding = self._tokenizer.encode(text, add_special_tokens=False)
        if check is not None:
            check(len(encoding))
        return encoding.ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._ids(texts)

    def _encodings(self, texts: list[str]) -> list[Encoding]:
        """Every batch goes through here (the tokenizers library lets go of the GIL for it)."""
        return self._tokenizer.encode_batch(texts, add_special_tokens=False)

    def _ids(self, texts: list[str], before: int = 0, check: Checks | None = None, first: int = 0
             ) -> list[list[int]]:
        """Each text's ids, `check(first + i, before + count)` given the i-th text's count before its ids are
        made."""
        out = []
        for index, encoding in enumerate(self._encodings(texts)):
            if check is not None:
                check(first + index, before + len(encoding))
            out.append(encoding.ids)
        return out

    def encode_sharing(self, head: str, head_ids: Sequence[int], texts: Sequence[str], check: Checks | None = None,
                       first: int = 0) -> list[list[int]]:
        """The ids of `texts`, as `encode_batch` gives them, where `head_ids` are `head`'s. Texts that start as
        `head` does take `head_ids` up to a cut in that start (an ASCII letter or digit, then ASCII punctuation,
        far enough from where they part) and are encoded only from there; the cut is used where `head`'s own ids
        end with its rest's encoding, that is where it falls between two of `head`'s tokens. `check(first + i,
        count)` is given each text's count before its ids are made."""
        if not self.share_starts or not texts:
            return self._ids(list(texts), 0, check, first)
        shared = min(common_start(head, text) for text in texts) - self._margin
        cut = next((c for c in range(shared, max(shared - SEARCH_CHARS, 0), -1)
                    if head[c - 1] in BEFORE and head[c] in AFTER), None)
        if cut is None:
            return self._ids(list(texts), 0, check, first)
        rest = self.encode(head[cut:])
        kept = len(head_ids) - len(rest)
        if kept <= 0 or list(head_ids[kept:]) != rest:
            return self._ids(list(texts), 0, check, first)
        start = list(head_ids[:kept])
        return [start + ids for ids in self._ids([text[cut:] for text in texts], kept, check, first)]

    def encode_checked(self, head: str, head_ids: Sequence[int], texts: Sequence[str], check: Checks
                       ) -> list[list[int]]:
        """`encode_sharing`'s ids of `texts`, each text's token count passed to `check(index, count)` (which refuses
        a prompt too long) before the texts after it are encoded. Texts of much of their own (past what they share
        with `head`) are encoded in groups of 1, 2, 4, ..., so a refusal costs at most twice the tokenizing of the
        texts before it, not the tokenizing of them all."""
        texts = list(texts)
        own = sum(len(text) - common_start(head, text) for text in texts)
        size = len(texts) if own <= CHECK_ALL_AT_ONCE_CHARS else 1
        out: list[list[int]] = []
        while len(out) < len(texts):
            out += self.encode_sharing(head, head_ids, texts[len(out):len(out) + size], check, len(out))
            size *= 2
        return out

    def token_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def added_ids(self) -> set[int]:
        """Ids of the added vocabulary (special and added tokens)."""
        return set(self._tokenizer.get_added_tokens_decoder())

    def max_token_chars(self) -> int:
        """Characters of the longest vocabulary entry (vLLM's bound on prompt characters per token, spec 3.9)."""
        return self._parsed.max_token_chars
