"""Token-id prompts -> one right-padded batch for a text graph, and the d3 code-logit run."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .session import GraphSession


def text_positions(length: int) -> np.ndarray:
    """3-D M-RoPE positions of a text-only prompt: (p, p, p) for p = 0..length-1 (spec 4.11)."""
    return np.broadcast_to(np.arange(length, dtype=np.int64), (3, length))


def pad_batch(prompts: Sequence[Sequence[int]], positions: Sequence[np.ndarray], pad_id: int = 0
              ) -> dict[str, np.ndarray]:
    """Right-pad prompts (and their [3, n] positions) to one [B, L] batch with its attention mask."""
    width = max(len(p) for p in prompts)
    batch = len(prompts)
    ids = np.full((batch, width), pad_id, dtype=np.int64)
    mask = np.zeros((batch, width), dtype=np.int64)
    pos = np.zeros((3, batch, width), dtype=np.int64)
    for row, (prompt, position) in enumerate(zip(prompts, positions)):
        n = len(prompt)
        ids[row, :n] = prompt
        mask[row, :n] = 1
        pos[:, row, :n] = position
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos}


def attention_bytes(batch: int, length: int, heads: int) -> int:
    """Memory of one full-attention layer's scores and probabilities (float32): the graph materialises them."""
    return 2 * 4 * heads * batch * length * length


class CodeLogitsRunner:
    """Runs d3 prompts through the text graph in padded sub-batches, each within a padded-token budget and an
    attention-memory budget (so a request's memory is bounded whatever its questions)."""

    def __init__(self, session: GraphSession, max_batch_tokens: int = 32768, heads: int = 1,
                 attention_budget: int = 4 << 30):
        self.session = session
        self.max_batch_tokens = max_batch_tokens
        self.heads = heads
        self.attention_budget = attention_budget

    def fits(self, batch: int, length: int) -> bool:
        return (batch * length <= self.max_batch_tokens
                and attention_bytes(batch, length, self.heads) <= self.attention_budget)

    def batches(self, lengths: Sequence[int]) -> list[list[int]]:
        """Group prompt indices (longest first) so that each padded batch stays within both budgets."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        groups: list[list[int]] = []
        for index in order:
            if groups and self.fits(len(groups[-1]) + 1, lengths[groups[-1][0]]):
                groups[-1].append(index)
            else:
                groups.append([index])
        return groups

    def run(self, prompts: Sequence[Sequence[int]], run_options=None) -> np.ndarray:
        """Code logits [len(prompts), n_codes] float32, in prompt order."""
        out: list[np.ndarray | None] = [None] * len(prompts)
        for group in self.batches([len(p) for p in prompts]):
            feeds = pad_batch([prompts[i] for i in group], [text_positions(len(prompts[i])) for i in group])
            (logits,) = self.session.run(feeds, run_options)
            for row, index in enumerate(group):
                out[index] = logits[row]
        return np.stack(out)
