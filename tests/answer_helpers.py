"""Comparing two responses' answers, question by question."""

from __future__ import annotations

from typing import Any


def max_probability_diff(got: dict[str, Any], want: dict[str, Any]) -> float:
    """The largest |dp| over every option of every question of `want` (a response's `answers`), read in `got`."""
    assert got.keys() == want.keys()
    return max(abs(got[qid]["probabilities"][option] - p)
               for qid, answer in want.items() for option, p in answer["probabilities"].items())
