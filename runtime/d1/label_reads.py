"""What d1's text graph takes and reads (runtime/text_runner.py): token ids on the LFM2 state (runtime/d1/state.py),
each row's own image rows, the index of each row's last token and the label ids a call reads; the label tokens'
log-probabilities and the greedy token at that index (export/d1/lfm2_text.py)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ...models.family import Readout
from ..batch import UNMEASURED_COST, MediaRows, TextRow, pad_right
from ..text_runner import TextReads

# Label ids a captured call reads (its label input has one shape in every bucket): a call's labels are padded to
# this many; a call of more (many long option lists together) runs uncaptured.
LABEL_SLOTS = 128


def call_labels(rows: Sequence[TextRow]) -> list[int]:
    """The label ids one call reads: every row's (each row's read picks its own from them); one where no row has
    any (a prefix's chunk, whose reads nobody uses)."""
    return sorted({i for row in rows for i in row.label_ids}) or [0]


class LabelLogprobs(TextReads):
    """The label tokens' log-probabilities and the greedy token at each row's last token."""

    fetch = ("label_logprobs", "argmax")
    # Grouped by a call's cost before start-up measures it: the questions' suffixes differ a lot in length (a
    # 26-option choice against a yes/no), and a call's fixed part weighs against padding.
    unmeasured_cost = UNMEASURED_COST

    def __init__(self, hidden: int):
        self.hidden = hidden

    def feeds(self, rows: Sequence[TextRow], width: int | None = None, captured: bool = False
              ) -> dict[str, np.ndarray]:
        ids, _ = pad_right([row.token_ids for row in rows], width=width)
        labels = np.asarray(call_labels(rows), np.int64)
        if captured:  # padded with repeats of the first
            labels = np.concatenate([labels, np.full(LABEL_SLOTS - len(labels), labels[0], np.int64)])
        return {"input_ids": ids, **MediaRows.in_rows([row.media for row in rows], ids.shape[1], self.hidden).feeds(),
                "last_index": np.array([row.length - 1 for row in rows], np.int64), "label_ids": labels}

    def capturable(self, rows: Sequence[TextRow]) -> bool:
        return len(call_labels(rows)) <= LABEL_SLOTS

    def readouts(self, rows: Sequence[TextRow], outputs: Sequence[np.ndarray]) -> list[Readout]:
        labels = call_labels(rows)
        logprobs, argmax = outputs
        return [Readout(dict(zip(labels, row.tolist())), int(top))
                for row, top in zip(logprobs[:len(rows)], argmax[:len(rows)], strict=True)]

    def probe_row(self, length: int) -> TextRow:
        return TextRow([0] * length, label_ids=(0,))


def label_logprobs(readouts: Sequence[Readout], label_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """The log-probabilities [len(readouts), len(label_ids)] and greedy tokens of `LabelLogprobs` readouts."""
    return (np.array([[readout.scores[i] for i in label_ids] for readout in readouts], np.float32),
            np.array([readout.greedy for readout in readouts], np.int64))
