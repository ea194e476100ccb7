"""The answer-level gate a half-precision form must pass against the torch fp32 model
(docs/decisions/cuda-form-ladder.md): every question's probabilities through the runtime on that form, against the
torch model read the same way.

A form passes when, over at least `min_questions` questions, the largest |dp| is at most `max_dp`, the median of
each question's largest |dp| is at most `median_dp`, and the pick is the reference's wherever the reference's top
two probabilities are more than `pick_margin` apart (closer than that, fp16 rounding may honestly swap them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..models.questions import first_argmax
from .config import AnswerTolerance, ParityError


@dataclass(frozen=True)
class QuestionPair:
    """One question's probabilities: the runtime's (`got`) and the torch reference's (`want`); `media` when its
    prompt carries images or videos (the vision graph ran for it)."""

    question: str
    got: Sequence[float]
    want: Sequence[float]
    media: bool = False


def gate_answers(pairs: Sequence[QuestionPair], tolerance: AnswerTolerance = AnswerTolerance()) -> dict[str, Any]:
    """The gate's figures; `ParityError` naming every bound that fails."""
    if len(pairs) < tolerance.min_questions:
        raise ParityError(f"the answer gate needs at least {tolerance.min_questions} questions; it got {len(pairs)}")
    report = answer_figures(pairs, tolerance)
    if report["problems"]:
        raise ParityError(f"answers disagree with the torch fp32 model over {len(pairs)} questions: "
                          + "; ".join(report["problems"]))
    del report["problems"]
    report["summary"] = (f"{len(pairs)} questions ({report['media_questions']} with media): max |dp| "
                         f"{report['max_abs_dp']:.2e}, median |dp| {report['median_abs_dp']:.2e}, "
                         f"{report['questions_with_clear_pick']} clear picks all equal")
    return report


def answer_figures(pairs: Sequence[QuestionPair], tolerance: AnswerTolerance = AnswerTolerance()) -> dict[str, Any]:
    """The gate's figures over `pairs`, with the bounds they break (`problems`, empty when none)."""
    worst, decided, flips = [], 0, []
    for pair in pairs:
        got, want = np.asarray(pair.got, np.float64), np.asarray(pair.want, np.float64)
        worst.append(float(np.abs(got - want).max()))
        top_two = np.sort(want)[-2:] if len(want) > 1 else np.array([0.0, 1.0])
        if top_two[1] - top_two[0] > tolerance.pick_margin:
            decided += 1
            if first_argmax(list(got)) != first_argmax(list(want)):
                flips.append(pair.question)
    report = {"questions": len(pairs), "media_questions": sum(pair.media for pair in pairs),
              "max_abs_dp": float(np.max(worst)), "median_abs_dp": float(np.median(worst)),
              "questions_with_clear_pick": decided, "clear_picks_differing": flips, "tolerance": asdict(tolerance)}
    problems = []
    # "not within" rather than "over": a NaN probability (np.max and np.median keep it) fails the gate.
    if not report["max_abs_dp"] <= tolerance.max_dp:
        problems.append(f"max |dp| {report['max_abs_dp']:.4f} > {tolerance.max_dp}")
    if not report["median_abs_dp"] <= tolerance.median_dp:
        problems.append(f"median |dp| {report['median_abs_dp']:.4f} > {tolerance.median_dp}")
    if flips:
        problems.append(f"{len(flips)} clear picks differ (first: {flips[0]})")
    return {**report, "problems": problems}
