"""The d3 text graph's run: token-id prompts with their M-RoPE positions -> the readout's code logits at each
prompt's last token, in padded sub-batches within the batch budget."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..batch import BatchBudget, MediaRows, pad_right
from ..session import GraphSession


def text_positions(length: int) -> np.ndarray:
    """3-D M-RoPE positions of a text-only prompt: (p, p, p) for p = 0..length-1 (spec 4.11)."""
    return np.broadcast_to(np.arange(length, dtype=np.int64), (3, length))


def code_logit_feeds(prompts: Sequence[Sequence[int]], positions: Sequence[np.ndarray], media: MediaRows | None,
                     hidden: int) -> dict[str, np.ndarray]:
    """One right-padded [B, L] batch with its mask, [3, B, L] positions and the media rows in every row."""
    ids, mask = pad_right(prompts)
    batch, width = ids.shape
    pos = np.zeros((3, batch, width), dtype=np.int64)
    for row, position in enumerate(positions):
        pos[:, row, :position.shape[1]] = position
    rows = MediaRows.none(hidden) if media is None else media.in_every_row(batch, width)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos, **rows.feeds()}


class CodeLogitsRunner:
    def __init__(self, session: GraphSession, budget: BatchBudget, hidden: int):
        self.session = session
        self.budget = budget
        self.hidden = hidden

    def run(self, prompts: Sequence[Sequence[int]], run_options=None, positions: Sequence[np.ndarray] | None = None,
            media: MediaRows | None = None) -> np.ndarray:
        """Code logits [len(prompts), n_codes] float32, in prompt order. Positions default to text positions;
        `media` rows sit at the same positions in every prompt (spec 4.8: the media prefix is shared)."""
        if positions is None:
            positions = [text_positions(len(p)) for p in prompts]
        out: list[np.ndarray | None] = [None] * len(prompts)
        for group in self.budget.plan([len(p) for p in prompts]):
            feeds = code_logit_feeds([prompts[i] for i in group], [positions[i] for i in group], media, self.hidden)
            (logits,) = self.session.run(feeds, run_options)
            for row, index in enumerate(group):
                out[index] = logits[row]
        return np.stack(out)
