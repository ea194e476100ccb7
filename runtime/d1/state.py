"""Runs the d1 text graph: a request's shared prefix prefilled once, its questions read as a batch of suffixes.

The graph (export/lfm2_text.py) takes the LFM2 state of everything before its tokens (attention keys/values and
the short-convolution windows, batch 1) and returns the label log-probabilities and greedy token at each row's last
token, plus the state its own tokens add. A prefix is prefilled in chunks (each within the attention-memory
budget), so a long state with images never materialises one huge score matrix; the questions then run as
right-padded batches on that snapshot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .session import GraphSession


@dataclass(frozen=True)
class StateLayout:
    """The decoder's layer kinds and state shapes, from the artifact manifest."""

    layer_types: tuple[str, ...]
    kv_heads: int
    head_dim: int
    heads: int
    hidden: int
    conv_window: int

    def input_names(self) -> list[str]:
        return _names(self.layer_types, "past")

    def output_names(self) -> list[str]:
        return _names(self.layer_types, "new")


def _names(layer_types: Sequence[str], prefix: str) -> list[str]:
    names = []
    for i, kind in enumerate(layer_types):
        names += [f"{prefix}_key_{i}", f"{prefix}_value_{i}"] if kind == "full_attention" else [f"{prefix}_conv_{i}"]
    return names


@dataclass(frozen=True)
class Snapshot:
    """The decoder state after `length` tokens of one prompt (batch 1)."""

    length: int
    states: tuple[np.ndarray, ...]


@dataclass(frozen=True)
class MediaRows:
    """Vision rows and the prompt positions they fill."""

    embeds: np.ndarray  # [M, hidden] float32
    positions: np.ndarray  # [M] int64


# A row shorter than this fraction of its batch's longest starts a new batch: padded positions cost as much as
# real ones, and the questions' suffixes differ a lot in length (a 26-option choice against a yes/no).
MIN_FILL = 0.75


def attention_bytes(batch: int, length: int, past: int, heads: int) -> int:
    """Memory of one attention layer's scores and probabilities (float32) for a batch of `length` new tokens."""
    return 2 * 4 * heads * batch * length * (past + length)


class D1TextRunner:
    def __init__(self, session: GraphSession, layout: StateLayout, max_batch_tokens: int = 32768,
                 attention_budget: int = 4 << 30):
        self.session = session
        self.layout = layout
        self.max_batch_tokens = max_batch_tokens
        self.attention_budget = attention_budget

    # -- state -----------------------------------------------------------------------------------------------
    def empty(self) -> Snapshot:
        """No tokens yet: no keys, zero convolution windows (the causal convolution's zero padding)."""
        lay = self.layout
        states = []
        for kind in lay.layer_types:
            if kind == "full_attention":
                states += [np.zeros((1, lay.kv_heads, 0, lay.head_dim), np.float32)] * 2
            else:
                states.append(np.zeros((1, lay.hidden, lay.conv_window), np.float32))
        return Snapshot(0, tuple(states))

    def fits(self, batch: int, length: int, past: int) -> bool:
        return (batch * length <= self.max_batch_tokens
                and attention_bytes(batch, length, past, self.layout.heads) <= self.attention_budget)

    def chunk_length(self, past: int) -> int:
        """The longest run of new tokens one row may add after `past` tokens within both budgets."""
        n = 1
        while self.fits(1, n * 2, past):
            n *= 2
        return n

    def _feeds(self, ids: np.ndarray, last: np.ndarray, labels: np.ndarray, snapshot: Snapshot,
               media: MediaRows | None) -> dict[str, np.ndarray]:
        if media is None or len(media.positions) == 0:
            embeds = np.zeros((0, self.layout.hidden), np.float32)
            index = np.zeros((0,), np.int64)
        else:
            embeds, index = media.embeds, media.positions
        feeds = {"input_ids": ids, "media_embeds": embeds, "media_index": index, "last_index": last,
                 "label_ids": labels}
        feeds.update(zip(self.layout.input_names(), snapshot.states))
        return feeds

    def extend(self, snapshot: Snapshot, ids: Sequence[int], media: MediaRows | None = None,
               run_options=None) -> Snapshot:
        """The snapshot after `ids` more tokens (media rows at prompt positions), prefilled chunk by chunk."""
        labels = np.zeros((1,), np.int64)
        start = 0
        while start < len(ids):
            size = min(self.chunk_length(snapshot.length), len(ids) - start)
            chunk = np.asarray(ids[start:start + size], dtype=np.int64)[None]
            rows = None
            if media is not None:
                lo, hi = snapshot.length, snapshot.length + size
                keep = (media.positions >= lo) & (media.positions < hi)
                rows = MediaRows(media.embeds[keep], media.positions[keep] - lo)
            out = self.session.run(self._feeds(chunk, np.array([size - 1]), labels, snapshot, rows), run_options)
            snapshot = Snapshot(snapshot.length + size, self._append(snapshot, out[2:]))
            start += size
        return snapshot

    def _append(self, snapshot: Snapshot, new: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
        states = []
        for old, add in zip(snapshot.states, new):
            states.append(np.concatenate([old, add], axis=2) if old.ndim == 4 else add)
        return tuple(states)

    # -- reads -----------------------------------------------------------------------------------------------
    def _batches(self, lengths: Sequence[int], past: int) -> list[list[int]]:
        """Row indices per graph call, longest first: rows of similar length (MIN_FILL) within both budgets."""
        batches: list[list[int]] = []
        for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
            longest = lengths[batches[-1][0]] if batches else 0
            if (batches and lengths[index] >= MIN_FILL * longest
                    and self.fits(len(batches[-1]) + 1, longest, past)):
                batches[-1].append(index)
            else:
                batches.append([index])
        return batches

    def _run_rows(self, base: Snapshot, rows: Sequence[Sequence[int]], labels: np.ndarray,
                  media: MediaRows | None, run_options) -> tuple[np.ndarray, np.ndarray]:
        """One graph call: `rows` right-padded on `base`, media rows at the same positions in every row; the
        label log-probabilities and greedy token at each row's last token."""
        width = max(len(r) for r in rows)
        ids = np.zeros((len(rows), width), np.int64)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = row
        if media is not None:
            media = MediaRows(np.tile(media.embeds, (len(rows), 1)),
                              (np.arange(len(rows))[:, None] * width + media.positions[None]).reshape(-1))
        last = np.array([len(r) - 1 for r in rows], np.int64)
        out = self.session.run(self._feeds(ids, last, labels, base, media), run_options)
        return out[0], out[1]

    def read(self, snapshot: Snapshot, suffixes: Sequence[Sequence[int]], label_ids: Sequence[int],
             run_options=None) -> tuple[np.ndarray, np.ndarray]:
        """Each suffix read on the snapshot: log-probabilities [len(suffixes), K] at `label_ids` and the greedy
        token [len(suffixes)] at each suffix's last token. Suffixes run in padded batches of similar lengths within
        the budgets; one too long for a batch of its own is prefilled (all but its last chunk) on a copy of the
        snapshot first."""
        labels = np.asarray(label_ids, dtype=np.int64)
        logprobs = np.zeros((len(suffixes), len(labels)), np.float32)
        argmax = np.zeros((len(suffixes),), np.int64)
        fitting = []
        for index, suffix in enumerate(suffixes):
            n = len(suffix)
            if self.fits(1, n, snapshot.length):
                fitting.append(index)
                continue
            keep = self.chunk_length(snapshot.length + n)  # the last chunk, read on the extended state
            own = self.extend(snapshot, suffix[:n - keep], run_options=run_options)
            logprobs[[index]], argmax[[index]] = self._run_rows(own, [suffix[n - keep:]], labels, None, run_options)
        for batch in self._batches([len(suffixes[i]) for i in fitting], snapshot.length):
            rows = [fitting[i] for i in batch]
            logprobs[rows], argmax[rows] = self._run_rows(snapshot, [suffixes[i] for i in rows], labels, None,
                                                          run_options)
        return logprobs, argmax

    def read_full(self, prompts: Sequence[Sequence[int]], label_ids: Sequence[int], media: MediaRows | None = None,
                  run_options=None) -> tuple[np.ndarray, np.ndarray]:
        """The same reads without prefix reuse: each whole prompt from an empty state, batched (the baseline the
        prefix saving is measured against). `media` rows sit at the same positions in every prompt."""
        labels = np.asarray(label_ids, dtype=np.int64)
        logprobs = np.zeros((len(prompts), len(labels)), np.float32)
        argmax = np.zeros((len(prompts),), np.int64)
        empty = self.empty()
        for rows in self._batches([len(p) for p in prompts], 0):
            logprobs[rows], argmax[rows] = self._run_rows(empty, [prompts[i] for i in rows], labels, media,
                                                          run_options)
        return logprobs, argmax
