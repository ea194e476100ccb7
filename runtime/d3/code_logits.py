"""What d3's text graph takes and reads (runtime/text_runner.py): token ids at M-RoPE positions, each row's own
media rows, and the readout's code logits at each row's last token. A causal graph also takes the state of the
tokens before its own (runtime/d3/state.py)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ...models.family import Readout
from ..batch import MediaRows, TextRow, pad_right
from ..text_runner import TextReads


def text_positions(length: int) -> np.ndarray:
    """3-D M-RoPE positions of a text-only prompt: (p, p, p) for p = 0..length-1 (spec 4.11)."""
    return np.broadcast_to(np.arange(length, dtype=np.int64), (3, length))


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


class CodeLogits(TextReads):
    """The answer codes' logits at each row's last token."""

    fetch = ("code_logits",)

    def __init__(self, hidden: int):
        self.hidden = hidden

    def feeds(self, rows: Sequence[TextRow], width: int | None = None, captured: bool = False
              ) -> dict[str, np.ndarray]:
        return row_feeds(rows, self.hidden, width)

    def readouts(self, rows: Sequence[TextRow], outputs: Sequence[np.ndarray]) -> list[Readout]:
        (logits,) = outputs
        return [Readout(dict(enumerate(row.tolist()))) for row in logits[:len(rows)]]

    def probe_row(self, length: int) -> TextRow:
        return TextRow([0] * length, text_positions(length))


def code_logits(readouts: Sequence[Readout]) -> np.ndarray:
    """The code logits [len(readouts), n_codes] of `CodeLogits` readouts, as the graph gave them."""
    return np.array([list(readout.scores.values()) for readout in readouts], np.float32)
