"""Parity gates every family's export uses: code-logit parity of a text graph against the torch model, the worst
sample of a vision graph, and the sample prompts (random token runs and real prompts rendered as the runtime
renders them)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..models.family import Family
from ..models.questions import parse_questions
from ..models.request import parse_request
from ..runtime.chat_template import ChatTemplate
from ..runtime.prompt import render_texts
from ..runtime.tokenizer import PromptTokenizer
from .config import ParityError, RuntimeFiles

PARITY_LENGTHS = (1, 7, 77, 200, 1000)
DEFAULT_ATOL = 2e-3  # max |code logit difference| (fp32 graph vs fp32 eager torch)
DEFAULT_PROB_ATOL = 1e-4  # max |probability difference| over all codes, at the checkpoint's temperature


def sample_prompts(family: Family, staging: Path, files: RuntimeFiles, request: dict[str, Any],
                   lengths: Sequence[int], seed: int, vocab: int) -> list[tuple[str, list[int]]]:
    """Random token runs of the given lengths, a run of one repeated token, then each question of `request`
    rendered and tokenized with the staged template and tokenizer, as the runtime will."""
    rng = np.random.default_rng(seed)
    prompts = [(f"random-{n}", rng.integers(0, vocab, n).tolist()) for n in lengths]
    # Identical keys make the delta rule's chunk solve ill-conditioned for a careless inverse: at d3-nano's size an
    # inverse by repeated squaring was 0.08 off on this row, which random and real prompts never showed.
    prompts.append(("repeated-200", [0] * 200))
    template = ChatTemplate((staging / "chat_template.jinja").read_text(encoding="utf-8"), files.special_tokens)
    tokenizer = PromptTokenizer(staging / "tokenizer.json")
    parsed = parse_request(request)
    questions = parse_questions(parsed.questions, family.option_limit)
    for question, text in zip(questions, render_texts(template, family, parsed, questions)):
        prompts.append((f"prompt-{question.id}", tokenizer.encode(text)))
    return prompts


def worst_vision_sample(rows: list[dict[str, Any]], atol: float, reference: str) -> dict[str, Any]:
    """A vision gate's report over its grids; `ParityError` when the worst grid is past `atol`."""
    worst = max(rows, key=lambda r: r["max_abs_diff"])
    if worst["max_abs_diff"] > atol:
        raise ParityError(f"exported vision graph disagrees with {reference} on grid {worst['grid']} "
                          f"(max |diff| {worst['max_abs_diff']:.3g} > {atol:g}); no artifact written")
    return {"atol": atol, "samples": rows, "max_abs_diff": worst["max_abs_diff"]}


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def padded_groups(lengths: Sequence[int], most_padding: float = 2.0) -> list[list[int]]:
    """Indices of `lengths` in right-padded batches, shortest first: a row joins the batch before it while the
    batch's padded tokens stay within `most_padding` times its own. Rows of different lengths still share batches
    (padding is checked), but a 1,000-token row does not pad eight short ones to its length
    (docs/decisions/parity-batches.md)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for i in order:
        group = groups[-1] if groups else None
        if group and lengths[i] * (len(group) + 1) <= most_padding * (sum(lengths[j] for j in group) + lengths[i]):
            group.append(i)
        else:
            groups.append([i])
    return groups


def check_parity(run_graph: Callable[..., np.ndarray], reference: Callable[..., np.ndarray],
                 prompts: Sequence[tuple[str, list[int]]], temperature: float, atol: float, prob_atol: float,
                 media_samples: Sequence[tuple[str, list[int], Any]] = ()) -> dict[str, Any]:
    """Graph (the text prompts in right-padded batches, `padded_groups`; each media sample alone) vs the torch
    model (each prompt alone). `run_graph(prompts, media=None)`, `reference(ids, media=None)`."""
    got_of: dict[int, np.ndarray] = {}
    for group in padded_groups([len(ids) for _, ids in prompts]):
        got_of.update(zip(group, run_graph([prompts[i][1] for i in group]), strict=True))
    results = [(prompt, got_of[i]) for i, prompt in enumerate(prompts)]
    results += [((label, ids), run_graph([ids], media=media)[0]) for label, ids, media in media_samples]
    media_of = {label: media for label, _, media in media_samples}
    rows = []
    for (label, ids), got in results:
        want = reference(ids, media_of.get(label))
        dlogit = float(np.abs(got - want).max())
        dprob = float(np.abs(_softmax(got / temperature) - _softmax(want / temperature)).max())
        rows.append({"sample": label, "tokens": len(ids), "max_abs_logit_diff": dlogit, "max_abs_prob_diff": dprob,
                     "same_argmax": bool(np.argmax(got) == np.argmax(want))})
    # np.max, not max(): a NaN anywhere is the report's figure, never passed over.
    report = {"atol": atol, "prob_atol": prob_atol, "samples": rows,
              "max_abs_logit_diff": float(np.max([r["max_abs_logit_diff"] for r in rows])),
              "max_abs_prob_diff": float(np.max([r["max_abs_prob_diff"] for r in rows]))}
    # Written as "not within", so that a NaN difference (a non-finite logit on either side) fails.
    bad = [r for r in rows if not (r["max_abs_logit_diff"] <= atol and r["max_abs_prob_diff"] <= prob_atol)]
    if bad:
        worst = max(bad, key=lambda r: np.nan_to_num(r["max_abs_logit_diff"], nan=np.inf))  # a NaN is the worst
        raise ParityError(f"exported graph disagrees with the torch model on {len(bad)} of {len(rows)} samples "
                          f"(worst: {worst['sample']}, {worst['tokens']} tokens, logit diff "
                          f"{worst['max_abs_logit_diff']:.3g} > {atol:g} or prob diff "
                          f"{worst['max_abs_prob_diff']:.3g} > {prob_atol:g}); no artifact written")
    return report


