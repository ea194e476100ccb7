"""d1 answer parity: the runtime (shared prefix prefilled once, questions as suffixes) against transformers'
LFM2-VL run on each question's whole prompt (its own vision tower on the same pixel crops), both read as spec 3.7
reads: every pick, every probability, label_mass and argmax_is_label. Used by the tests (CPU) and
`scripts/d1_parity.py` (CPU or CUDA)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...models.family import Readout
from ...models.questions import Read, first_argmax
from ...runtime.d1.image_processor import Lfm2Image, cap_pixels, lfm2_image
from ...runtime.engine import Prepared
from ...runtime.media_decode import decode_image
from ...runtime.media_fetch import fetch
from ...runtime.service import DecisionService
from ..answer_gate import QuestionPair
from ..sample_media import image_url

# Spec 3.8's example sizes: 640x480 (one crop), 200x100 (one upscaled crop), 1024x1024 (2x2 tiles), 2000x1000 and
# 1920x1080 (capped to 1448x724 and 1365x768, then 2x1 tiles).
IMAGE_SIZES = ((640, 480), (200, 100), (1024, 1024), (2000, 1000), (1920, 1080))
STATES = [None, "The parcel arrived crushed and the customer wants a refund.", {"error": "Disk at 98%", "host": "db1"},
          "नमस्ते — एक छोटा संदेश", ["a", 1, {"b": None}], "x" * 300, "", {"tickets": list(range(40))}]


def question_set(seed: int) -> dict[str, Any]:
    """Three questions, one per type: 1 to 26 choice options (single-letter names on some), 2 to 10 levels."""
    rng = np.random.default_rng(seed)
    n_choice = int(rng.integers(1, 27))
    names = ([chr(ord("a") + i) for i in range(n_choice)] if seed % 3 == 0
             else [f"option_{i}" for i in range(n_choice)])
    levels = int(rng.integers(2, 11))
    return {
        f"noul-{seed}": {"type": "noul", "instructions": f"Is case {seed} urgent?",
                         "criteria": {"true": "yes, today"} if seed % 2 else None},
        f"choice-{seed}": {"type": "choice", "instructions": "Which option fits?",
                           "criteria": {name: (f"about {i}" if i % 2 else None) for i, name in enumerate(names)}},
        f"score-{seed}": {"type": "score", "criteria": [f"level {i}" for i in range(levels)]},
    }


def parity_requests(count: int = 70, image_every: int = 3) -> list[dict[str, Any]]:
    """`count` requests of three questions; every `image_every`-th carries one of spec 3.8's image sizes (and
    some a second image), some carry a system turn."""
    requests = []
    for i in range(count):
        body: dict[str, Any] = {"state": STATES[i % len(STATES)], "questions": question_set(i)}
        if i % 4 == 1:
            body["instructions"] = "Answer for the support desk."
        if i % image_every == 0:
            k = (i // image_every) % len(IMAGE_SIZES)
            body["images"] = [image_url(*IMAGE_SIZES[k], seed=i)]
            if k == 1:
                body["images"].append(image_url(*IMAGE_SIZES[0], seed=i + 1))
        requests.append(body)
    return requests


def torch_pixels(service: DecisionService, body: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """The request's images as LFM2-VL's processor hands them to the model (crops padded to one patch count with
    a pixel attention mask, spatial shapes), built from the runtime's own numpy preprocessing."""

    media = service.engine.media
    images = []
    for i, url in enumerate(body.get("images") or ()):
        rgb = decode_image(fetch(url, f"images[{i}]", "image", media.policy), f"images[{i}]")
        images.append(lfm2_image(cap_pixels(rgb), media.config))
    return model_pixels(images)


def model_pixels(images: list[Lfm2Image]) -> dict[str, np.ndarray] | None:
    """Preprocessed images as LFM2-VL's forward takes them: every crop padded to one patch count, with the pixel
    attention mask and each crop's spatial shape."""
    crops = [crop for image in images for crop in image.crops]
    if not crops:
        return None
    width = max(len(c.patches) for c in crops)
    pixels = np.zeros((len(crops), width, crops[0].patches.shape[1]), np.float32)
    mask = np.zeros((len(crops), width), np.int32)
    for k, crop in enumerate(crops):
        pixels[k, :len(crop.patches)] = crop.row_major()
        mask[k, :len(crop.patches)] = 1
    return {"pixel_values": pixels, "pixel_attention_mask": mask,
            "spatial_shapes": np.array([c.grid for c in crops], np.int64)}


def torch_inputs(service: DecisionService, body: dict[str, Any]) -> tuple[list[Any], dict[str, np.ndarray] | None]:
    """The request's prompts (each question's whole prompt) and images as the torch model reads them."""
    return service.render(body), torch_pixels(service, body)


def torch_reads(family: Any, encode: Any, reference: Any, prompts: list[Any],
                pixels: dict[str, np.ndarray] | None) -> dict[str, Any]:
    """The torch model on each question's whole prompt, read as spec 3.7 reads."""
    reads = {}
    for prompt in prompts:
        logprobs = reference.reference_logprobs(prompt.token_ids, pixels=pixels)
        labels = family.labels(prompt.question, encode)
        readout = Readout({i: float(logprobs[i]) for i in labels.ids}, int(np.argmax(logprobs)))
        reads[prompt.question.id] = family.read(prompt.question, labels, readout)
    return reads


def onnx_reads(service: DecisionService, prepared: Prepared) -> list[Read]:
    """The runtime's read of each question of a prepared request (`service.prepare(body)`), in question order."""
    return family_reads(service, prepared, service.engine.run(prepared))


def whole_prompt_reads(service: DecisionService, prepared: Prepared) -> list[Read]:
    """`onnx_reads` with each question's whole prompt a row, no prefix read once: the baseline prefix reuse is
    measured against."""
    engine = service.engine
    return family_reads(service, prepared, engine.runner.run_rows(engine.rows(prepared, engine.encode_media(prepared))))


def family_reads(service: DecisionService, prepared: Prepared, readouts: list[Readout]) -> list[Read]:
    return [service.family.read(q, labels, readout)
            for q, labels, readout in zip(prepared.questions, prepared.labels, readouts, strict=True)]


def runtime_answers(service: DecisionService, requests: list[dict[str, Any]]) -> tuple[Any, Any, list[tuple]]:
    """Each request's runtime reads (prefix reuse) with what the torch model needs to read it: nothing of the
    runtime's sessions is kept."""
    asked = []
    for body in requests:
        prompts, pixels = torch_inputs(service, body)
        prepared = service.prepare(body)
        asked.append((prompts, pixels, [(q.id, read.probs) for q, read in zip(prepared.questions,
                                                                                onnx_reads(service, prepared))],
                      bool(body.get("images"))))
    return service.family, service.artifact.tokenizer.encode, asked


def reference_pairs(answers: tuple[Any, Any, list[tuple]], reference: Any) -> list[QuestionPair]:
    """Each question's runtime probabilities beside the torch model's on its whole prompt."""
    family, encode, asked = answers
    pairs = []
    for prompts, pixels, got, images in asked:
        want = torch_reads(family, encode, reference, prompts, pixels)
        pairs += [QuestionPair(qid, probs, want[qid].probs, media=images) for qid, probs in got]
    return pairs


def question_pairs(service: DecisionService, reference: Any, requests: list[dict[str, Any]]) -> list[QuestionPair]:
    """Each question of `requests`: the runtime's probabilities (prefix reuse) and the torch model's."""
    return reference_pairs(runtime_answers(service, requests), reference)


def compare(service: DecisionService, reference: Any, requests: list[dict[str, Any]]) -> dict[str, Any]:
    """ONNX (prefix reuse) vs torch (whole prompts): picks, max |dp|, max |d label_mass|, argmax_is_label."""

    count, with_images, worst_p, worst_mass, differing, argmax_differing, tops = 0, 0, 0.0, 0.0, [], [], []
    family, encode = service.family, service.artifact.tokenizer.encode
    for body in requests:
        want = torch_reads(family, encode, reference, *torch_inputs(service, body))
        prepared = service.prepare(body)
        got = onnx_reads(service, prepared)
        for question, read in zip(prepared.questions, got):
            ref = want[question.id]
            if first_argmax(read.probs) != first_argmax(ref.probs):
                differing.append(question.id)
            if read.argmax_is_label != ref.argmax_is_label:
                argmax_differing.append(question.id)
            worst_p = max(worst_p, float(np.abs(np.array(read.probs) - np.array(ref.probs)).max()))
            worst_mass = max(worst_mass, abs(read.label_mass - ref.label_mass))
            tops.append(max(ref.probs))
            count += 1
            with_images += bool(body.get("images"))
    return {"questions": count, "questions_with_images": with_images, "picks_differing": differing,
            "argmax_is_label_differing": argmax_differing, "max_abs_dp": worst_p,
            "max_abs_d_label_mass": worst_mass, "median_top_probability": float(np.median(tops))}


def sixteen_questions(with_image: bool = True) -> dict[str, Any]:
    """One request of 16 questions over a long JSON state (and a 1024x1024 image): the shape prefix reuse is for."""
    questions: dict[str, Any] = {}
    for seed in range(6):
        questions.update(question_set(seed))
    state = {"ticket": "Charged twice for order 1234", "tier": "gold",
             "history": [{"at": f"2026-11-{d:02d}", "note": f"customer wrote about invoice {d * 37}"} for d in range(1, 29)]}
    body: dict[str, Any] = {"state": state, "questions": dict(list(questions.items())[:16])}
    if with_image:
        body["images"] = [image_url(1024, 1024, seed=7)]
    return body


