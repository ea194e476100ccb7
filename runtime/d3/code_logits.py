"""Token-id prompts -> one right-padded batch for a text graph, and the d3 code-logit run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .session import GraphSession


def text_positions(length: int) -> np.ndarray:
    """3-D M-RoPE positions of a text-only prompt: (p, p, p) for p = 0..length-1 (spec 4.11)."""
    return np.broadcast_to(np.arange(length, dtype=np.int64), (3, length))


@dataclass(frozen=True)
class Media:
    """A request's media embeddings (vision graph rows) and the prompt positions they fill, shared by every
    question of the request (spec 4.8: the media prefix is the same for all)."""

    embeds: np.ndarray  # [M, hidden] float32
    positions: np.ndarray  # [M] int64, positions within each prompt


def pad_batch(prompts: Sequence[Sequence[int]], positions: Sequence[np.ndarray], media: Media | None = None,
              hidden: int = 0, pad_id: int = 0) -> dict[str, np.ndarray]:
    """Right-pad prompts (and their [3, n] positions) to one [B, L] batch with its attention mask and media."""
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
    if media is None:
        embeds = np.zeros((0, hidden), dtype=np.float32)
        index = np.zeros((0,), dtype=np.int64)
    else:
        embeds = np.tile(media.embeds.astype(np.float32), (batch, 1))
        index = (np.arange(batch, dtype=np.int64)[:, None] * width + media.positions[None, :]).reshape(-1)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "media_embeds": embeds,
            "media_index": index}


def attention_bytes(batch: int, length: int, heads: int) -> int:
    """Memory of one full-attention layer's scores and probabilities (float32): the graph materialises them."""
    return 2 * 4 * heads * batch * length * length


class CodeLogitsRunner:
    """Runs d3 prompts through the text graph in padded sub-batches, each within a padded-token budget and an
    attention-memory budget (so a request's memory is bounded whatever its questions)."""

    def __init__(self, session: GraphSession, max_batch_tokens: int = 32768, heads: int = 1,
                 attention_budget: int = 4 << 30, hidden: int = 0):
        self.session = session
        self.hidden = hidden
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

    def run(self, prompts: Sequence[Sequence[int]], run_options=None, positions: Sequence[np.ndarray] | None = None,
            media: Media | None = None) -> np.ndarray:
        """Code logits [len(prompts), n_codes] float32, in prompt order. Positions default to text positions."""
        if positions is None:
            positions = [text_positions(len(p)) for p in prompts]
        out: list[np.ndarray | None] = [None] * len(prompts)
        for group in self.batches([len(p) for p in prompts]):
            feeds = pad_batch([prompts[i] for i in group], [positions[i] for i in group], media, self.hidden)
            (logits,) = self.session.run(feeds, run_options)
            for row, index in enumerate(group):
                out[index] = logits[row]
        return np.stack(out)
