"""The d3 text graph's run: rows (token ids, M-RoPE positions, each row's own media rows) -> the readout's code
logits at each row's last token. One call is one right-padded batch; rows of different requests may share it.

A causal graph also takes the state of the tokens before its own (runtime/d3/state.py): whole prompts read from
an empty state, and a request's questions can be read as suffixes on its shared prefix, prefilled once."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import numpy as np

from ...models.errors import DeviceMemoryExhausted
from ..batch import BatchBudget, CallCost, MediaRows, TextRow, drive, pad_right, run_in_halves
from ..session import GraphSession
from ..text_state import Past, StateLayout

CODE_LOGITS = ("code_logits",)  # what a call fetches; a causal graph's new state stays on the device


def text_positions(length: int) -> np.ndarray:
    """3-D M-RoPE positions of a text-only prompt: (p, p, p) for p = 0..length-1 (spec 4.11)."""
    return np.broadcast_to(np.arange(length, dtype=np.int64), (3, length))


def code_logit_feeds(prompts: Sequence[Sequence[int]], positions: Sequence[np.ndarray], media: MediaRows | None,
                     hidden: int) -> dict[str, np.ndarray]:
    """One request's prompts as one batch (`row_feeds`), its media rows in every row (spec 4.8: the media prefix is
    shared)."""
    return row_feeds([TextRow(p, pos, media) for p, pos in zip(prompts, positions, strict=True)], hidden)


def row_feeds(rows: Sequence[TextRow], hidden: int, width: int | None = None) -> dict[str, np.ndarray]:
    """One right-padded [B, L] batch (L: the longest row, or `width`) with its mask, [3, B, L] positions (text
    positions where a row has none) and each row's own media rows at that row's positions (rows of different
    requests carry different media)."""
    ids, mask = pad_right([row.token_ids for row in rows], width=width)
    batch, width = ids.shape
    pos = np.zeros((3, batch, width), dtype=np.int64)
    for index, row in enumerate(rows):
        position = row.positions if row.positions is not None else text_positions(row.length)
        pos[:, index, :position.shape[1]] = position
    media = MediaRows.in_rows([row.media for row in rows], width, hidden)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos, **media.feeds()}


class D3TextRunner:
    def __init__(self, session: GraphSession, budget: BatchBudget, hidden: int, layout: StateLayout | None = None):
        self.session = session
        self.budget = budget
        self.hidden = hidden
        self.cost: CallCost | None = None  # how rows of different lengths are grouped (`BatchBudget.plan`)
        self.layout = layout  # the state a causal graph carries; None: the graph takes none
        self.empty: dict[str, np.ndarray] = layout.empty(read_only=True) if layout is not None else {}
        self._empty_on_device: Past | None = None

    def start(self) -> Past:
        """The state of a prompt from its start, on the device once (d3-nano's zero recurrent states are 18 MB)."""
        if self._empty_on_device is None:
            self._empty_on_device = Past(0, self.empty).moved(self.session.device_values)
        return self._empty_on_device

    def run_batch(self, rows: Sequence[TextRow], run_options=None, prefix: Past | None = None) -> np.ndarray:
        """One graph call: code logits [len(rows), n_codes] float32, in row order, on `prefix` where given (a
        causal graph; else from the start). Text-only rows from the start that fit a captured bucket are padded to
        it and replay its CUDA graph: filler rows of one token, every row padded to the bucket's length (exact:
        each row is read at its own last token, its padded keys masked or after it)."""
        text_only = all(row.media is None or not row.media.positions.size for row in rows)
        bucket = (self.session.capture_shape(len(rows), max(row.length for row in rows))
                  if text_only and prefix is None else None)
        if bucket is None:
            feeds = row_feeds(rows, self.hidden)
            if self.layout is None:
                (logits,) = self.session.run(feeds, run_options)
                return logits
            feeds.update((prefix or self.start()).states)
            (logits,) = self.session.run(feeds, run_options, fetch=CODE_LOGITS)
            return logits
        batch, width = bucket
        filler = [TextRow([0])] * (batch - len(rows))
        # The same read-only zero state every replay, which the replay does not copy again.
        feeds = {**row_feeds([*rows, *filler], self.hidden, width), **self.empty}
        (logits,) = self.session.run_captured(feeds, fetch=CODE_LOGITS if self.layout is not None else None)
        return logits[:len(rows)]

    def prefill(self, row: TextRow, run_options=None) -> Past:
        """The state after `row` (a request's shared prefix, media rows and all) read from the start, left on the
        device for its suffixes."""
        return drive(self.prefilling(row, run_options))

    def prefilling(self, row: TextRow, run_options=None) -> Generator[None, None, Past]:
        """`prefill` as steps: one call a chunk, each as long as the budgets and the time slice allow (one call
        where the prefix fits them), each chunk on the state the one before it left."""
        if self.layout is None:
            raise RuntimeError("this text graph carries no state: every prompt is read whole")
        prefix, start = self.start(), 0
        while start < row.length:
            if start:
                yield
            size = min(self.budget.chunk_length(start, self.cost), row.length - start)
            media = None if row.media is None else row.media.window(start, start + size)
            chunk = TextRow(row.token_ids[start:start + size], row.positions[:, start:start + size], media)
            out = self.session.run_bound({**row_feeds([chunk], self.hidden), **prefix.states}, run_options)
            prefix = self._after(prefix, size, out)
            start += size
        return prefix

    def _after(self, prefix: Past, size: int, out: dict[str, Any]) -> Past:
        """The state after a call of `size` tokens on `prefix`, on the device: the first call's outputs kept where
        they are, a later one's joined to the prefix's on the host (`StateLayout.after`) and put back."""
        new = [out[name] for name in self.layout.names("new")]
        if not prefix.length:
            return Past(size, dict(zip(self.layout.names("past"), new, strict=True))).moved(self.session.held)
        return self.layout.after(prefix, size, new).moved(self.session.device_values)

    def read_suffixes(self, prefix: Past, rows: Sequence[TextRow], run_options=None) -> np.ndarray:
        """Code logits [len(rows), n_codes] of `rows` (each a question's tokens after the prefix, with their
        positions) read on `prefix`, in padded calls within the budget."""
        return drive(self.reading_suffixes(prefix, rows, run_options))

    def reading_suffixes(self, prefix: Past, rows: Sequence[TextRow], run_options=None
                         ) -> Generator[None, None, np.ndarray]:
        """`read_suffixes` as steps, one call a step."""
        out: list[np.ndarray | None] = [None] * len(rows)
        for number, group in enumerate(self.budget.plan([row.length for row in rows], prefix.length, self.cost)):
            if number:
                yield
            for index, logits in zip(group, self.run_batch([rows[i] for i in group], run_options, prefix),
                                     strict=True):
                out[index] = logits
        return np.stack(out)

    def capture(self) -> None:
        """Every bucket's CUDA graph, captured now on this thread (`GraphSession.capture_buckets`)."""
        self.session.capture_buckets(lambda batch, width: self.run_batch([TextRow([0] * width)] * batch))

    def run(self, prompts: Sequence[Sequence[int]], run_options=None, positions: Sequence[np.ndarray] | None = None,
            media: MediaRows | None = None) -> np.ndarray:
        """One request's code logits [len(prompts), n_codes], in prompt order. Positions default to text
        positions; `media` rows sit at the same positions in every prompt (spec 4.8: the media prefix is
        shared)."""
        if positions is None:
            positions = [text_positions(len(p)) for p in prompts]
        return self.run_rows([TextRow(p, pos, media) for p, pos in zip(prompts, positions, strict=True)], run_options)

    def run_rows(self, rows: Sequence[TextRow], run_options=None) -> np.ndarray:
        """Code logits [len(rows), n_codes] float32, in row order, in padded sub-batches within the budget."""
        return drive(self.running_rows(rows, run_options))

    def running_rows(self, rows: Sequence[TextRow], run_options=None) -> Generator[None, None, np.ndarray]:
        """`run_rows` as steps, one call (or its halves, where the device memory refuses it) a step."""
        out: list[np.ndarray | None] = [None] * len(rows)
        for number, group in enumerate(self.budget.plan([row.length for row in rows], cost=self.cost)):
            if number:
                yield
            results = run_in_halves(lambda part: self.run_batch([rows[i] for i in part], run_options), group)
            for index, result in zip(group, results, strict=True):
                if isinstance(result, DeviceMemoryExhausted):
                    raise result  # a row the arena cannot hold alone: the request cannot be answered now
                out[index] = result
        return np.stack(out)
