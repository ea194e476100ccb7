"""d3 answer parity: the runtime's answers against the torch model (`D3ExportConfig.reference_logits_with_media`:
transformers' whole `Qwen3_5Model`, its own vision tower included) on each question's own prompt, over requests of
every question type, states of every JSON kind, 1 to 29 choice options and 2 to 10 score levels, and, where asked,
images and short videos. Used by the half-precision forms' answer gate, the tests (CPU) and `scripts/parity.py`
(CPU or CUDA)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...models.family import Family, Readout
from ...models.questions import Question
from ...models.questions import first_argmax
from ...runtime.engine import Prepared
from ...runtime.service import DecisionService
from ..answer_gate import QuestionPair
from ..sample_media import image_url, jpeg_video_url

STATES = [None, "The parcel arrived crushed and the customer wants a refund.", {"error": "Disk at 98%", "host": "db1"},
          "नमस्ते — एक छोटा संदेश", ["a", 1, {"b": None}], "x" * 300, "Short.", {"tickets": list(range(40))}]
# Image sizes (w, h) of the media requests; as the runtime sizes them for d3 (spec 4.9): 300 image tokens; 64, the
# floor; 72 from a 2:1 image upscaled past the floor; 256 from a 4:1 strip.
IMAGE_SIZES = ((640, 480), (256, 256), (200, 100), (1024, 256))
VIDEO = (128, 96, 4)  # w, h, frames: two temporal groups of 3 x 4 merged patches, 24 video tokens
MediaInput = tuple[np.ndarray, list[tuple[int, int, int]]]  # pixel rows and their (t, h, w) grids


def question_set(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    n_choice = int(rng.integers(1, 30))
    levels = int(rng.integers(2, 11))
    return {
        f"noul-{seed}": {"type": "noul", "instructions": f"Is case {seed} urgent?",
                         "criteria": {"true": "yes, today"} if seed % 2 else None},
        f"choice-{seed}": {"type": "choice", "instructions": "Which option fits?",
                           "criteria": {f"option {i}": (f"about {i}" if i % 2 else None) for i in range(n_choice)}},
        f"score-{seed}": {"type": "score", "criteria": [f"level {i}" for i in range(levels)]},
    }


def media(k: int, seed: int) -> dict[str, list[str]]:
    """The `k`-th media request's images or video: every fifth a 4-frame JPEG video; the others one image of
    `IMAGE_SIZES` in turn, the second size with a second image beside it."""
    if k % 5 == 4:
        return {"videos": [jpeg_video_url(*VIDEO, seed=seed)]}
    size = IMAGE_SIZES[k % len(IMAGE_SIZES)]
    images = [image_url(*size, seed=seed)]
    if size == IMAGE_SIZES[1]:
        images.append(image_url(*IMAGE_SIZES[0], seed=seed + 1))
    return {"images": images}


def parity_requests(count: int = 70, media_every: int = 0) -> list[dict]:
    """`count` requests of three questions each; with `media_every`, every `media_every`-th carries images or a
    video (`media`)."""
    requests = []
    for i in range(count):
        body = {"state": STATES[i % len(STATES)], "questions": question_set(i)}
        if media_every and i % media_every == 0:
            body.update(media(i // media_every, seed=i))
        requests.append(body)
    return requests


def torch_media(prepared: Prepared) -> tuple[MediaInput | None, MediaInput | None]:
    """A prepared request's images and videos as `reference_logits_with_media` takes them: each kind's pixel rows
    in prompt order with their (t, h, w) grids, or None. The pixels are the runtime's own decoding and
    preprocessing (the same in every form), so both models read the same pixels and only the graphs differ."""
    items = prepared.media.loaded.in_order() if prepared.media is not None else []

    def of_kind(kind: str) -> MediaInput | None:
        chosen = [item for item in items if item.kind == kind]
        return (np.concatenate([item.pixels for item in chosen]), [item.grid for item in chosen]) if chosen else None

    return of_kind("image"), of_kind("video")


@dataclass(frozen=True)
class AskedQuestion:
    """One question of a prepared request as both models read it: its prompt and media (the runtime's own decoding
    and preprocessing, the same in every form, so both read the same pixels and only the graphs differ) and the
    runtime's probabilities."""

    question: Question
    token_ids: list[int]
    positions: np.ndarray
    images: MediaInput | None
    videos: MediaInput | None
    got: list[float]


def runtime_answers(service: DecisionService, requests: list[dict]) -> tuple[Family, list[AskedQuestion]]:
    """Every question of `requests` through the whole runtime (the vision graph once per media, then one padded
    batch), with what the torch model needs to read it: nothing of the runtime's sessions is kept."""
    asked = []
    for body in requests:
        prepared = service.prepare(body)
        got = onnx_probabilities(service, prepared)
        images, videos = torch_media(prepared)
        asked += [AskedQuestion(prompt.question, list(prompt.token_ids), prompt.positions, images, videos,
                                got[prompt.question.id]) for prompt in prepared.prompts]
    return service.family, asked


def reference_pairs(answers: tuple[Family, list[AskedQuestion]], reference: Any) -> list[QuestionPair]:
    """Each asked question's runtime probabilities beside the torch model's on its own prompt and media, read as
    spec 4.13 reads (`reference.reference_logits_many`: all prompts at once, so a reference too large for the
    device can run them a layer group at a time)."""
    family, asked = answers
    logits = reference.reference_logits_many([(q.token_ids, q.positions, q.images, q.videos) for q in asked])
    pairs = []
    for question, row in zip(asked, logits):
        labels = family.labels(question.question, None)
        read = family.read(question.question, labels, Readout(dict(enumerate(row.tolist()))))
        pairs.append(QuestionPair(question.question.id, question.got, list(read.probs),
                                  media=question.images is not None or question.videos is not None))
    return pairs


def onnx_probabilities(service: DecisionService, prepared: Prepared) -> dict[str, list[float]]:
    """The artifact's answers through the whole runtime (the vision graph once per media, then one padded batch)."""
    return {qid: list(a["probabilities"].values()) for qid, a in service.answer(prepared)["answers"].items()}


def question_pairs(service: DecisionService, reference: Any, requests: list[dict]) -> list[QuestionPair]:
    """Each question of `requests`: the runtime's probabilities and the torch model's, on the same prompt and
    media."""
    return reference_pairs(runtime_answers(service, requests), reference)


def compare(service: DecisionService, reference: Any, requests: list[dict]) -> dict:
    """ONNX vs torch over `requests`: question count, differing picks, max |dp|, median top probability."""
    pairs = question_pairs(service, reference, requests)
    return {"questions": len(pairs),
            "picks_differing": [p.question for p in pairs if first_argmax(p.got) != first_argmax(p.want)],
            "max_abs_dp": max(float(np.abs(np.array(p.got) - np.array(p.want)).max()) for p in pairs),
            "median_top_probability": float(np.median([max(p.want) for p in pairs]))}




def sixteen_questions() -> dict:
    questions = {}
    for seed in range(6):
        questions.update(question_set(seed))
    return {"state": {"ticket": "Charged twice for order 1234", "tier": "gold"},
            "questions": dict(list(questions.items())[:16])}
