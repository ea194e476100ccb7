"""d1 graphs -> ONNX, checked against the torch model before anything is written (spec 3.7, 3.8).

The text graph is checked the way the runtime uses it: every sample read both from an empty state in one padded
batch and as a suffix on a prefilled prefix, against transformers' LFM2-VL on the whole prompt (its
full-vocabulary log-softmax at the last token, compared at every label id the family can ask for, and its greedy
token). The vision graph is checked against LFM2-VL's own image features on crops of several grids.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from ...models.d1 import NOUL_FORMS
from ...models.questions import QUESTION_TYPES
from ...runtime.batch import MediaRows, TextRow
from ...runtime.d1.label_reads import label_logprobs
from ...runtime.session import GraphSession
from ...runtime.text_runner import TextRunner
from ..config import ParityError
from ..parity import worst_vision_sample


class D1Reference(Protocol):
    """What the gates ask of the torch side (D1ExportConfig)."""

    text_config: Any
    patch_width: int

    def reference_logprobs(self, token_ids: list[int], media_embeds: np.ndarray | None = None,
                           media_positions: np.ndarray | None = None) -> np.ndarray: ...

    def reference_vision(self, patches: np.ndarray, grid: tuple[int, int]) -> np.ndarray: ...

    def vision_feeds(self, patches: np.ndarray, grid: tuple[int, int]) -> dict[str, np.ndarray]: ...


# Crop grids (patches high, wide) the vision graph is checked on: a 512 tile, the smallest thumbnail, a thin strip,
# odd cells and a tall crop.
VISION_PARITY_GRIDS = ((32, 32), (16, 16), (4, 206), (26, 44), (48, 22))

SAMPLE_REQUEST = {
    "state": {"ticket": "Refund not received after 10 days", "tier": "gold"},
    "instructions": "Be strict.",
    "questions": {
        "urgent": {"type": "noul", "instructions": "Is it urgent?", "criteria": {"true": "yes, today"}},
        "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "money", "support": None}},
        "mood": {"type": "score", "instructions": "How upset?", "criteria": ["calm", "annoyed", "furious"]}},
}


def label_ids(encode: Callable[[str], list[int]]) -> list[int]:
    """Every id a d1 read can ask for: choice codes A..Z and " A".." Z", the yes/no forms, the digits."""
    letters = QUESTION_TYPES["choice"].labels
    forms = [*letters, *(" " + c for c in letters), *(f for g in NOUL_FORMS for f in g),
             *QUESTION_TYPES["score"].labels]
    return sorted({ids[0] for ids in map(encode, forms) if len(ids) == 1})


def check_text_parity(runner: TextRunner, config: D1Reference, prompts: list[tuple[str, list[int]]],
                      labels: list[int], atol: float, seed: int) -> dict[str, Any]:
    """Graph vs torch on every sample, from an empty state (batched) and as a suffix on a prefix."""
    rng = np.random.default_rng(seed)
    hidden = config.text_config.hidden_size
    media = MediaRows(rng.standard_normal((6, hidden)).astype(np.float32), np.arange(3, 9, dtype=np.int64))
    media_ids = prompts[-1][1]
    every = tuple(labels)

    def read(readouts: list) -> tuple[np.ndarray, np.ndarray]:
        return label_logprobs(readouts, labels)

    full, full_top = read(runner.run_rows([TextRow(ids, label_ids=every) for _, ids in prompts]))
    media_row = TextRow(media_ids, media=media, label_ids=every)
    media_full, media_top = read(runner.run_rows([media_row]))
    rows = []

    def compare(sample: str, ids: list[int], got: np.ndarray, top: int, mode: str, ref: np.ndarray) -> None:
        rows.append({"sample": sample, "mode": mode, "tokens": len(ids),
                     "max_abs_logprob_diff": float(np.abs(got - ref[labels]).max()),
                     "same_argmax": bool(top == int(np.argmax(ref)))})

    for (label, ids), got, top in zip(prompts, full, full_top):
        ref = config.reference_logprobs(ids)
        compare(label, ids, got, top, "whole prompt", ref)
        if len(ids) > 1:
            split = len(ids) // 2
            row = TextRow(ids, label_ids=every)
            past = runner.prefill(runner.start(), row.part(0, split))
            (got_suffix,), (top_suffix,) = read(runner.read_suffixes(past, [row.part(split)]))
            compare(label, ids, got_suffix, top_suffix, f"suffix after {split}", ref)
    ref = config.reference_logprobs(media_ids, media.embeds, media.positions)
    compare("media-embeds", media_ids, media_full[0], media_top[0], "whole prompt", ref)
    past = runner.prefill(runner.start(), media_row.part(0, 20))
    (got_suffix,), (top_suffix,) = read(runner.read_suffixes(past, [media_row.part(20)]))
    compare("media-embeds", media_ids, got_suffix, top_suffix, "suffix after 20", ref)
    worst = max(rows, key=lambda r: r["max_abs_logprob_diff"])
    bad = [r for r in rows if r["max_abs_logprob_diff"] > atol or not r["same_argmax"]]
    if bad:
        raise ParityError(f"exported text graph disagrees with the torch model on {len(bad)} of {len(rows)} reads "
                          f"(worst: {worst['sample']}, {worst['mode']}, {worst['tokens']} tokens, log-prob diff "
                          f"{worst['max_abs_logprob_diff']:.3g} > {atol:g} or another greedy token); "
                          "no artifact written")
    return {"atol": atol, "label_ids": len(labels), "samples": rows,
            "max_abs_logprob_diff": worst["max_abs_logprob_diff"],
            "summary": f"max |label log-prob diff| {worst['max_abs_logprob_diff']:.2e} over {len(rows)} reads"}


def check_vision_parity(session: GraphSession, config: D1Reference, atol: float, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    rows = []
    for grid in VISION_PARITY_GRIDS:
        patches = rng.standard_normal((grid[0] * grid[1], config.patch_width)).astype(np.float32)
        got = session.run(config.vision_feeds(patches, grid))[0]
        diff = float(np.abs(got - config.reference_vision(patches, grid)).max())
        rows.append({"grid": list(grid), "max_abs_diff": diff})
    return worst_vision_sample(rows, atol, "LFM2-VL's image features")
