"""Padded batches for the text graphs, the memory budget that bounds them, the media rows they carry, and a
call the device memory refuses run again in halves.

Both families' portable text graphs materialise full-attention scores (O(length x (past + length)) a head; d3's
CUDA form does not, and keeps the same bounds so that every form accepts the same prompts), so every batch is
planned within a padded-token budget and an attention-memory budget; the same rule bounds the longest prompt and
the chunk a prefix is prefilled in.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from ..models.errors import DeviceMemoryExhausted

T = TypeVar("T")
R = TypeVar("R")


# Padded tokens one text-graph call may hold by default (--max-batch-tokens): it bounds the activations' memory.
MAX_BATCH_TOKENS = 32768
# The whole graph run's peak over its attention scores and probabilities, measured on the tiny d3 model at its
# longest prompt (4,390 MB of RSS for 4,092 MiB of scores, 1.07x), with room to spare.
PEAK_OVER_SCORES = 1.125


def attention_bytes(batch: int, length: int, past: int, heads: int) -> int:
    """Peak memory of one graph call for `length` new tokens a row: one attention layer's scores and probabilities
    (float32), and what the rest of the run holds beside them (PEAK_OVER_SCORES)."""
    return int(PEAK_OVER_SCORES * 2 * 4 * heads * batch * length * (past + length))


@dataclass(frozen=True)
class CallCost:
    """A text-graph call's time, modelled as a fixed part (the weights read once, copies) and a part per padded
    token, and never under a floor: the least any call takes. On a GPU an uncaptured call's floor is its kernel
    launches, the host's part, which the device's own work hides once the call is large (d1-3B on an H200: 11.1,
    9.3 and 11.2 ms for 128, 256 and 512 tokens, then about 11 us a token more). Fitted at start-up
    (runtime/batch_sizing.py)."""

    fixed_s: float
    token_s: float
    floor_s: float = 0.0
    # A part per pair of tokens a row's attention reads (its new tokens times its past and new ones): what makes a
    # long prompt, or a chunk on a long prefix, cost more than its tokens (0 where not measured).
    pair_s: float = 0.0

    def seconds(self, batch: int, length: int, past: int = 0) -> float:
        return max(self.floor_s, self.fixed_s + batch * length * (self.token_s + self.pair_s * (past + length)))

    @property
    def call_s(self) -> float:
        """What one more call costs before its tokens: its fixed part, or the floor where that is more."""
        return max(self.floor_s, self.fixed_s)

    def prefix_pays(self, questions: int, prefix_tokens: int) -> bool:
        """Whether reading a prefix the `questions` share once, then their suffixes on it, saves more than the call
        it adds: the prefix's tokens times the questions but one, against a call's fixed part."""
        return (questions - 1) * prefix_tokens * self.token_s > self.call_s

    def describe(self) -> str:
        floor = f", at least {self.floor_s * 1000:.2f} ms" if self.floor_s > self.fixed_s else ""
        pairs = f" + {self.pair_s * 1e9:.2f} ns a token pair" if self.pair_s else ""
        return f"{self.fixed_s * 1000:.2f} ms a call + {self.token_s * 1e6:.2f} us a padded token{pairs}{floor}"


# Tokens a prefix chunk may always take, however slow the cost model says they are.
SLICE_FLOOR = 256

# Before start-up measures a call (or where nothing does: export's gates, `ask`): a call's fixed part worth 32
# padded tokens, so a 26-option choice's suffix and a yes/no's go in separate calls, as on a CPU, and a prefix is read
# once for several questions where it saves more than that.
UNMEASURED_COST = CallCost(fixed_s=32e-6, token_s=1e-6)


@dataclass(frozen=True)
class BatchBudget:
    max_batch_tokens: int = MAX_BATCH_TOKENS
    attention_budget: int = 4 << 30
    heads: int = 1
    # The longest a call of several rows, or a chunk of a prefix, may take by the measured cost model: a large
    # request's work is split into calls about this long, so other requests' calls run between them (None: calls
    # are bounded by memory alone).
    slice_s: float | None = None

    def fits(self, batch: int, length: int, past: int = 0) -> bool:
        return (batch * length <= self.max_batch_tokens
                and attention_bytes(batch, length, past, self.heads) <= self.attention_budget)

    def within_slice(self, batch: int, length: int, past: int = 0, cost: CallCost | None = None) -> bool:
        """Whether a call of `batch` rows stays within the time slice (one row always does: a row is not split)."""
        return batch == 1 or cost is None or self.slice_s is None or cost.seconds(batch, length, past) <= self.slice_s

    def longest_prompt(self) -> int:
        """The longest prompt one row may read at once within the attention budget."""
        return int((self.attention_budget / attention_bytes(1, 1, 0, self.heads)) ** 0.5)

    def chunk_length(self, past: int, cost: CallCost | None = None) -> int:
        """The longest run of new tokens one row may add after `past` tokens within both budgets (at least one) and,
        with a measured `cost`, within the time slice (at least SLICE_FLOOR tokens, so a prefix always advances)."""
        def fits(length: int) -> bool:
            return self.fits(1, length, past) and (
                cost is None or self.slice_s is None or length <= SLICE_FLOOR
                or cost.seconds(1, length, past) <= self.slice_s)

        low, high = 1, self.max_batch_tokens
        while low < high:  # fits() falls as the run grows
            mid = (low + high + 1) // 2
            low, high = (mid, high) if fits(mid) else (low, mid - 1)
        return low

    def plan(self, lengths: Sequence[int], past: int = 0, cost: CallCost | None = None) -> list[list[int]]:
        """Row indices per graph call, longest first, each call within both budgets. With a measured `cost`, the
        grouping the cost model says is fastest (a call's fixed part against the padding it saves); without, each
        call filled as far as the budgets allow."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        if cost is None:
            batches: list[list[int]] = []
            for index in order:
                if batches and self.fits(len(batches[-1]) + 1, lengths[batches[-1][0]], past):
                    batches[-1].append(index)
                else:
                    batches.append([index])
            return batches
        # Sorted longest first, a best grouping takes consecutive runs (a run is padded to its first row), so the
        # best split of the first j rows is the best split of some shorter head plus one run.
        best = [0.0] + [float("inf")] * len(order)
        start = [0] * (len(order) + 1)
        for end in range(1, len(order) + 1):
            for first in range(end - 1, -1, -1):
                size, longest = end - first, lengths[order[first]]
                if size > 1 and not (self.fits(size, longest, past) and self.within_slice(size, longest, past, cost)):
                    break  # a longer run holds this one: it does not fit either
                seconds = best[first] + cost.seconds(size, longest)
                if seconds <= best[end]:  # a tie goes to the longer run: fewer calls
                    best[end], start[end] = seconds, first
        batches, end = [], len(order)
        while end:
            batches.insert(0, order[start[end]:end])
            end = start[end]
        return batches


def pad_right(rows: Sequence[Sequence[int]], pad_id: int = 0, width: int | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
    """Rows right-padded to one [B, L] int64 batch (L: the longest row, or `width`), and its attention mask."""
    width = max(len(r) for r in rows) if width is None else width
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = row
        mask[i, :len(row)] = 1
    return ids, mask


@dataclass(frozen=True)
class TextRow:
    """One question's text-graph input, able to share a padded batch with rows of other requests: its token ids,
    the family's positions for them (d3: [3, n] M-RoPE; None where the graph takes none), the vision rows at its
    own prompt positions (None: text only) and the vocabulary ids its read needs (d1's label tokens; empty where
    the graph reads the same for every row)."""

    token_ids: Sequence[int]
    positions: np.ndarray | None = None
    media: MediaRows | None = None
    label_ids: tuple[int, ...] = ()

    @property
    def length(self) -> int:
        return len(self.token_ids)

    def part(self, start: int, stop: int | None = None) -> TextRow:
        """Tokens [start, stop) of the row, with their positions and the media rows among them (None where there
        are none), the media's positions made relative to `start`."""
        stop = self.length if stop is None else stop
        media = None if self.media is None else self.media.window(start, stop)
        return TextRow(self.token_ids[start:stop], None if self.positions is None else self.positions[:, start:stop],
                       media if media is not None and len(media.positions) else None, self.label_ids)


@dataclass(frozen=True)
class MediaRows:
    """Vision-graph rows and the prompt positions they fill, in row order."""

    embeds: np.ndarray  # [M, hidden] float32
    positions: np.ndarray  # [M] int64

    @classmethod
    def none(cls, hidden: int) -> MediaRows:
        return cls(np.zeros((0, hidden), np.float32), np.zeros((0,), np.int64))

    def window(self, start: int, stop: int) -> MediaRows:
        """The rows at positions [start, stop), positions made relative to `start`."""
        keep = (self.positions >= start) & (self.positions < stop)
        return MediaRows(self.embeds[keep], self.positions[keep] - start)

    @staticmethod
    def in_rows(rows: Sequence[MediaRows | None], width: int, hidden: int) -> MediaRows:
        """Each batch row's own media rows (None: a text-only row) as flat indices into a [len(rows), width] batch
        (index = row * width + position): rows of different requests carry different media."""
        present = [(row, media) for row, media in enumerate(rows) if media is not None and len(media.positions)]
        if not present:
            return MediaRows.none(hidden)
        embeds = np.concatenate([media.embeds for _, media in present]).astype(np.float32, copy=False)
        index = np.concatenate([row * width + media.positions for row, media in present]).astype(np.int64)
        return MediaRows(embeds, index)

    def feeds(self) -> dict[str, np.ndarray]:
        return {"media_embeds": self.embeds, "media_index": self.positions}


def drive(steps: Generator[None, None, R]) -> R:
    """What a generator of steps returns, its steps run one after another (no other work between them)."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def run_in_halves(run: Callable[[Sequence[T]], Sequence[R]], items: Sequence[T]) -> list[R | DeviceMemoryExhausted]:
    """`run(items)`, one result an item; where the device memory (--gpu-memory) cannot hold the call, the same items
    in two calls, down to one item a call: an item it cannot hold alone gets the error in place of its result."""
    try:
        return list(run(items))
    except DeviceMemoryExhausted as exc:
        if len(items) == 1:
            return [exc]
        half = len(items) // 2
        return run_in_halves(run, items[:half]) + run_in_halves(run, items[half:])
