"""d1 graphs -> ONNX, checked against the torch model before anything is written (spec 3.7, 3.8).

The text graph is checked the way the runtime uses it: every sample read both from an empty state in one padded
batch and as a suffix on a prefilled prefix snapshot, against transformers' LFM2-VL on the whole prompt (its
full-vocabulary log-softmax at the last token, compared at every label id the family can ask for, and its greedy
token). The vision graph is checked against LFM2-VL's own image features on crops of several grids.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .d1 import (TEXT_AXES, TEXT_INPUTS, TEXT_OUTPUTS, VISION_AXES, VISION_INPUTS, VISION_OUTPUTS,
                 VISION_PARITY_GRIDS, D1ExportConfig, state_names)
from .pipeline import OPSET, ParityError, Progress, symbolic_axes

SAMPLE_REQUEST = {
    "state": {"ticket": "Refund not received after 10 days", "tier": "gold"},
    "instructions": "Be strict.",
    "questions": {
        "urgent": {"type": "noul", "instructions": "Is it urgent?", "criteria": {"true": "yes, today"}},
        "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "money", "support": None}},
        "mood": {"type": "score", "instructions": "How upset?", "criteria": ["calm", "annoyed", "furious"]}},
}


def _label_ids(encode) -> list[int]:
    """Every id a d1 read can ask for: choice codes A..Z and " A".." Z", the yes/no forms, the digits."""
    from ..models.d1 import NOUL_FORMS
    from ..models.questions import LABELS

    forms = [*LABELS["choice"], *(" " + c for c in LABELS["choice"]), *(f for g in NOUL_FORMS for f in g),
             *LABELS["score"]]
    return sorted({ids[0] for ids in map(encode, forms) if len(ids) == 1})


def _sample_prompts(staging: Path, lengths: Sequence[int], seed: int, vocab: int) -> list[tuple[str, list[int]]]:
    from ..models.d1 import D1Family
    from ..models.questions import parse_questions
    from ..models.request import parse_request
    from ..runtime.chat_template import ChatTemplate
    from ..runtime.prompt import render_texts
    from ..runtime.tokenizer import PromptTokenizer

    rng = np.random.default_rng(seed)
    prompts = [(f"random-{n}", rng.integers(0, vocab, n).tolist()) for n in lengths]
    bits = json.loads((staging / "runtime_files.json").read_text())
    family = D1Family()
    template = ChatTemplate((staging / "chat_template.jinja").read_text(encoding="utf-8"), bits["special_tokens"])
    tokenizer = PromptTokenizer(staging / "tokenizer.json")
    request = parse_request(SAMPLE_REQUEST)
    questions = parse_questions(request.questions, family.option_limit)
    for question, text in zip(questions, render_texts(template, family, request, questions)):
        prompts.append((f"prompt-{question.id}", tokenizer.encode(text)))
    return prompts


def check_text_parity(runner, config: D1ExportConfig, prompts: list[tuple[str, list[int]]], labels: list[int],
                      atol: float, seed: int) -> dict[str, Any]:
    """Graph vs torch on every sample, from an empty state (batched) and as a suffix on a prefix snapshot."""
    from ..runtime.d1_text import MediaRows

    rng = np.random.default_rng(seed)
    hidden = config.text_config.hidden_size
    media = MediaRows(rng.standard_normal((6, hidden)).astype(np.float32), np.arange(3, 9, dtype=np.int64))
    media_ids = prompts[-1][1]
    full, full_top = runner.read_full([ids for _, ids in prompts], labels)
    media_full, media_top = runner.read_full([media_ids], labels, media)
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
            snapshot = runner.extend(runner.empty(), ids[:split])
            (got_suffix,), (top_suffix,) = runner.read(snapshot, [ids[split:]], labels)
            compare(label, ids, got_suffix, top_suffix, f"suffix after {split}", ref)
    ref = config.reference_logprobs(media_ids, media.embeds, media.positions)
    compare("media-embeds", media_ids, media_full[0], media_top[0], "whole prompt", ref)
    snapshot = runner.extend(runner.empty(), media_ids[:20], media)
    (got_suffix,), (top_suffix,) = runner.read(snapshot, [media_ids[20:]], labels)
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


def check_vision_parity(session, config: D1ExportConfig, atol: float, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    rows = []
    for grid in VISION_PARITY_GRIDS:
        patches = rng.standard_normal((grid[0] * grid[1], config.patch_width)).astype(np.float32)
        got = session.run(config.vision_feeds(patches, grid))[0]
        rows.append({"grid": list(grid), "max_abs_diff": float(np.abs(got - config.reference_vision(patches, grid)).max())})
    worst = max(rows, key=lambda r: r["max_abs_diff"])
    if worst["max_abs_diff"] > atol:
        raise ParityError(f"exported vision graph disagrees with LFM2-VL's image features on grid {worst['grid']} "
                          f"(max |diff| {worst['max_abs_diff']:.3g} > {atol:g}); no artifact written")
    return {"atol": atol, "samples": rows, "max_abs_diff": worst["max_abs_diff"]}


def export_d1_graphs(config: D1ExportConfig, staging: Path, progress: Progress, *, atol: float, prob_atol: float,
                     lengths: Sequence[int], seed: int) -> dict[str, Any]:
    """d1: the text graph (LFM2 with state in/out + LM-head log-softmax) and the vision graph (SigLIP2 +
    projector), each checked against the torch model. Returns the manifest's family part."""
    import onnx
    import torch

    from ..runtime.d1_text import D1TextRunner, StateLayout
    from ..runtime.session import GraphSession
    from ..runtime.tokenizer import PromptTokenizer

    progress("exporting the text and vision graphs with torch.onnx (dynamo, opset 18); this is the long step")
    runtime_bits = config.write_runtime_files(staging)
    (staging / "runtime_files.json").write_text(json.dumps(runtime_bits))
    inputs = TEXT_INPUTS + state_names(config.layer_types, "past")
    outputs = TEXT_OUTPUTS + state_names(config.layer_types, "new")
    graph_path = staging / "text.onnx"
    with torch.no_grad():
        torch.onnx.export(config.graph(), config.example_inputs(), str(graph_path), dynamo=True, opset_version=OPSET,
                          external_data=True, input_names=inputs, output_names=outputs,
                          dynamic_shapes=config.dynamic_shapes(), verbose=False)
    onnx.checker.check_model(str(graph_path))
    vision_path = staging / "vision.onnx"
    dynamic = torch.export.Dim.DYNAMIC
    with torch.no_grad():
        torch.onnx.export(config.vision_graph(), config.vision_example_inputs(), str(vision_path), dynamo=True,
                          opset_version=OPSET, external_data=True, input_names=VISION_INPUTS,
                          output_names=VISION_OUTPUTS, verbose=False,
                          dynamic_shapes={"patches": {0: dynamic, 1: dynamic}, "positions": {0: dynamic}})
    onnx.checker.check_model(str(vision_path))
    progress("checking that batch, sequence, past, label and patch axes are symbolic")
    past_axes = {name: {2: "past"} for name in state_names(config.layer_types, "past") if "_conv_" not in name}
    shapes = symbolic_axes(graph_path, {**TEXT_AXES, **past_axes})
    vision_shapes = symbolic_axes(vision_path, VISION_AXES)
    progress(f"checking parity with the torch model at lengths {list(lengths)} and on real prompts, whole and "
             "as suffixes on a prefilled prefix")
    bits = config.manifest_bits()
    layout = StateLayout(tuple(bits["layer_types"]), bits["num_key_value_heads"], bits["head_dim"],
                         bits["num_attention_heads"], bits["hidden_size"], bits["conv_window"])
    runner = D1TextRunner(GraphSession(graph_path, "cpu"), layout)
    labels = _label_ids(PromptTokenizer(staging / "tokenizer.json").encode)
    prompts = _sample_prompts(staging, lengths, seed, bits["vocab_size"])
    parity = check_text_parity(runner, config, prompts, labels, atol, seed)
    vision_parity = check_vision_parity(GraphSession(vision_path, "cpu"), config, atol, seed)
    (staging / "runtime_files.json").unlink()
    return {
        **bits,
        "graphs": {"text": {"file": graph_path.name, "inputs": shapes, "outputs": outputs, "dtype": "float32"},
                   "vision": {"file": vision_path.name, "inputs": vision_shapes, "outputs": VISION_OUTPUTS,
                              "dtype": "float32", "parity": vision_parity}},
        "vision": {**runtime_bits.pop("image_processor"), "positions_file": "vision_positions.npy"},
        **runtime_bits,
        "parity": parity,
    }
