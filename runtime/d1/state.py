"""Runs the d1 text graph: a request's shared prefix prefilled once, its questions read as a batch of suffixes.

The graph (export/lfm2_text.py) takes the LFM2 state of everything before its tokens (attention keys/values and
the short-convolution windows, batch 1) and returns the label log-probabilities and greedy token at each row's last
token, plus the state its own tokens add. A prefix is prefilled in chunks (each within the attention-memory
budget), so a long state with images never materialises one huge score matrix; the questions then run as
right-padded batches on its state (runtime/text_state.py).
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from typing import Any

import numpy as np

from ..batch import UNMEASURED_COST, BatchBudget, CallCost, MediaRows, drive, pad_right
from ..session import GraphSession
from ..text_state import Past, StateLayout, StateTensor


def layout_of(fields: Mapping[str, Any]) -> StateLayout:
    """The decoder's state (runtime/text_state.py), from the artifact manifest's model fields: an attention
    layer's keys and values, a short-convolution layer's window."""
    tensors = []
    for layer, kind in enumerate(fields["layer_types"]):
        if kind == "full_attention":
            shape = (1, int(fields["num_key_value_heads"]), 0, int(fields["head_dim"]))
            tensors += [StateTensor("key", layer, shape), StateTensor("value", layer, shape)]
        else:
            tensors.append(StateTensor("conv", layer, (1, int(fields["hidden_size"]), int(fields["conv_window"]))))
    return StateLayout(tuple(tensors))


READS = ("label_logprobs", "argmax")  # the text graph's outputs a read fetches; its new state is the rest
# Label ids a captured call reads (its label input has one shape in every bucket): a call's labels are padded to
# this many; a call of more (many long option lists together) runs uncaptured.
LABEL_SLOTS = 128


class D1TextRunner:
    def __init__(self, session: GraphSession, budget: BatchBudget, hidden: int, layout: StateLayout):
        self.session = session
        self.budget = budget
        self.hidden = hidden
        self.layout = layout
        # How calls are grouped (`BatchBudget.plan`): the questions' suffixes differ a lot in length (a 26-option
        # choice against a yes/no), and a call's fixed part weighs against padding differently on each device.
        self.cost: CallCost | None = UNMEASURED_COST
        self.past_names = layout.names("past")
        self.new_names = layout.names("new")

    # -- state -----------------------------------------------------------------------------------------------
    def start(self) -> Past:
        """No tokens yet: no keys, zero convolution windows (the causal convolution's zero padding)."""
        return Past(0, self.layout.empty())

    def feeds(self, ids: np.ndarray, last: np.ndarray, labels: np.ndarray, past: Past,
              media: MediaRows | None) -> dict[str, Any]:
        """The text graph's inputs: `ids` [B, L] on `past`, each row read at `last`, the log-probabilities of
        `labels`."""
        rows = media if media is not None and len(media.positions) else MediaRows.none(self.hidden)
        feeds = {"input_ids": ids, **rows.feeds(), "last_index": last, "label_ids": labels}
        feeds.update(past.states)
        return feeds

    def prefill(self, past: Past, ids: Sequence[int], media: MediaRows | None = None,
                run_options=None) -> Past:
        """The past after `ids` more tokens (media rows at prompt positions), prefilled chunk by chunk."""
        return drive(self.prefilling(past, ids, media, run_options))

    def prefilling(self, past: Past, ids: Sequence[int], media: MediaRows | None = None,
                   run_options=None) -> Generator[None, None, Past]:
        """`prefill` as steps, one chunk a step; a chunk is as long as the budgets and the time slice allow."""
        labels = np.zeros((1,), np.int64)
        start = 0
        while start < len(ids):
            if start:
                yield
            size = min(self.budget.chunk_length(past.length, self.cost), len(ids) - start)
            chunk = np.asarray(ids[start:start + size], dtype=np.int64)[None]
            rows = None if media is None else media.window(past.length, past.length + size)
            feeds = self.feeds(chunk, np.array([size - 1]), labels, past, rows)
            if past.length == 0 and size == len(ids):
                # One chunk from nothing: its new state is the whole state, left on the device for the reads
                # (on a GPU it made a round trip through pageable host memory, tens of MB at d1-3B's size).
                out = self.session.run_bound(feeds, run_options)
                new = [out[name] for name in self.new_names]
                past = Past(size, dict(zip(self.past_names, new, strict=True))).moved(self.session.held)
            else:  # every output, through the binding: the past's state may be on the device already
                out = self.session.run(feeds, run_options, fetch=self.session.output_names)
                past = self.layout.after(past, size, out[len(READS):])
            start += size
        return past

    # -- reads -----------------------------------------------------------------------------------------------
    def _run_rows(self, base: Past, rows: Sequence[Sequence[int]], labels: np.ndarray,
                  media: MediaRows | None, run_options) -> tuple[np.ndarray, np.ndarray]:
        """One graph call: `rows` right-padded on `base`, media rows at the same positions in every row; the
        label log-probabilities and greedy token at each row's last token."""
        # Only the reads come back: the state these rows add is never used.
        logprobs, argmax = self.session.run(self._row_feeds(base, rows, labels, media), run_options, fetch=READS)
        return logprobs, argmax

    def _row_feeds(self, base: Past, rows: Sequence[Sequence[int]], labels: np.ndarray,
                   media: MediaRows | None = None, width: int | None = None) -> dict[str, Any]:
        """The feeds of one call: `rows` right-padded (to `width` where given) on `base`, each read at its last
        token, media rows at the same positions in every row."""
        ids, _ = pad_right(rows, width=width)
        if media is not None:
            media = media.in_every_row(*ids.shape)
        last = np.array([len(r) - 1 for r in rows], np.int64)
        return self.feeds(ids, last, labels, base, media)

    def read_suffixes(self, past: Past, suffixes: Sequence[Sequence[int]], label_ids: Sequence[int],
                      run_options=None) -> tuple[np.ndarray, np.ndarray]:
        """Each suffix read on the past: log-probabilities [len(suffixes), K] at `label_ids` and the greedy
        token [len(suffixes)] at each suffix's last token. Suffixes run in padded batches of similar lengths within
        the budgets; one too long for a batch of its own is prefilled (all but its last chunk) on a copy of the
        past first."""
        return drive(self.reading_suffixes(past, suffixes, label_ids, run_options))

    def reading_suffixes(self, past: Past, suffixes: Sequence[Sequence[int]], label_ids: Sequence[int],
                         run_options=None) -> Generator[None, None, tuple[np.ndarray, np.ndarray]]:
        """`read_suffixes` as steps, one call a step."""
        labels = np.asarray(label_ids, dtype=np.int64)
        logprobs = np.zeros((len(suffixes), len(labels)), np.float32)
        argmax = np.zeros((len(suffixes),), np.int64)
        fitting = []
        for index, suffix in enumerate(suffixes):
            n = len(suffix)
            if self.budget.fits(1, n, past.length):
                fitting.append(index)
                continue
            keep = self.budget.chunk_length(past.length + n)  # the last chunk, read on the extended state
            own = yield from self.prefilling(past, suffix[:n - keep], run_options=run_options)
            yield
            logprobs[[index]], argmax[[index]] = self._run_rows(own, [suffix[n - keep:]], labels, None, run_options)
            yield
        batches = self.budget.plan([len(suffixes[i]) for i in fitting], past.length, self.cost)
        # The prefix's state goes to the device once, not once a batch.
        past = past.moved(self.session.device_values)
        for number, batch in enumerate(batches):
            if number:
                yield
            rows = [fitting[i] for i in batch]
            logprobs[rows], argmax[rows] = self._run_rows(past, [suffixes[i] for i in rows], labels, None,
                                                          run_options)
        return logprobs, argmax

    def read_prompts(self, prompts: Sequence[Sequence[int]], label_ids: Sequence[int],
                     run_options=None) -> tuple[np.ndarray, np.ndarray]:
        """Whole prompts (of different requests) read in one call from an empty state; the caller keeps the call
        within the budget. A call that fits a captured bucket, with at most LABEL_SLOTS labels, is padded to it and
        replays its CUDA graph: filler rows of one token, every row padded to the bucket's length, the labels
        padded with repeats of the first (exact: each row is read at its own last token, and its pads come after
        it)."""
        labels = np.asarray(label_ids, dtype=np.int64)
        bucket = (self.session.capture_shape(len(prompts), max(len(p) for p in prompts))
                  if 0 < len(labels) <= LABEL_SLOTS else None)
        if bucket is None:
            return self._run_rows(self.start(), prompts, labels, None, run_options)
        batch, width = bucket
        rows = [*prompts, *[[0]] * (batch - len(prompts))]
        slots = np.concatenate([labels, np.full(LABEL_SLOTS - len(labels), labels[0], np.int64)])
        logprobs, argmax = self.session.run_captured(self._row_feeds(self.start(), rows, slots, width=width),
                                                     fetch=READS)
        return logprobs[:len(prompts), :len(labels)], argmax[:len(prompts)]

    def capture(self) -> None:
        """Every bucket's CUDA graph for whole prompts from an empty state, captured now on this thread
        (`GraphSession.capture_buckets`). Prefixes and their suffix reads (a past of any length) run uncaptured."""
        self.session.capture_buckets(lambda batch, width: self.read_prompts([[0] * width] * batch, [0]))

    def whole_logprobs(self, prompts: Sequence[Sequence[int]], label_ids: Sequence[int],
                       media: MediaRows | None = None, run_options=None) -> tuple[np.ndarray, np.ndarray]:
        """The same reads without prefix reuse: each whole prompt from an empty state, batched (the baseline the
        prefix saving is measured against). `media` rows sit at the same positions in every prompt."""
        return drive(self.reading_wholes(prompts, label_ids, media, run_options))

    def reading_wholes(self, prompts: Sequence[Sequence[int]], label_ids: Sequence[int],
                       media: MediaRows | None = None, run_options=None
                       ) -> Generator[None, None, tuple[np.ndarray, np.ndarray]]:
        """`whole_logprobs` as steps, one call a step."""
        labels = np.asarray(label_ids, dtype=np.int64)
        logprobs = np.zeros((len(prompts), len(labels)), np.float32)
        argmax = np.zeros((len(prompts),), np.int64)
        empty = self.start()
        for number, rows in enumerate(self.budget.plan([len(p) for p in prompts], 0, self.cost)):
            if number:
                yield
            logprobs[rows], argmax[rows] = self._run_rows(empty, [prompts[i] for i in rows], labels, media,
                                                          run_options)
        return logprobs, argmax
