"""checkpoint -> ONNX artifact: load, export, check the graph against the torch model, then write.

The artifact is assembled in a staging directory and moved into place only when the graph's inputs are symbolic
and its parity with the torch model holds at every sample length; otherwise nothing is written.
"""

from __future__ import annotations

import json
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from ..runtime.artifact import ARTIFACT_FORMAT, ARTIFACT_VERSION, MANIFEST
from .source import file_hashes, resolve_checkpoint

OPSET = 18
PARITY_LENGTHS = (1, 7, 77, 200, 1000)
DEFAULT_ATOL = 2e-3  # max |code logit difference| (fp32 graph vs fp32 eager torch)
DEFAULT_PROB_ATOL = 1e-4  # max |probability difference| over all codes, at the checkpoint's temperature


class ParityError(RuntimeError):
    pass


def _versions() -> dict[str, str]:
    names = ["systemone-onnx", "torch", "transformers", "onnx", "onnxscript", "onnxruntime", "tokenizers"]
    found = {"python": platform.python_version()}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


class Progress:
    def __init__(self, total: int, stream=sys.stderr):
        self.total, self.step, self.stream, self.start = total, 0, stream, time.monotonic()

    def __call__(self, message: str) -> None:
        self.step += 1
        print(f"[{self.step}/{self.total} {time.monotonic() - self.start:6.1f}s] {message}", file=self.stream,
              flush=True)


def symbolic_axes(model_path: Path, axes: dict[str, dict[int, str]]) -> dict[str, list[str | int]]:
    """Check that every declared batch/sequence axis of the graph's inputs is symbolic, consistently named."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    shapes = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.input}
    symbols: dict[str, str] = {}
    for name, wanted in axes.items():
        if name not in shapes:
            raise ParityError(f"exported graph lacks input {name!r}")
        for axis, role in wanted.items():
            dim = shapes[name][axis]
            if not isinstance(dim, str) or not dim:
                raise ParityError(f"exported graph pins {name}[{axis}] ({role}) to {dim}: the export specialised "
                                  "a dynamic axis to the trace shape")
            if symbols.setdefault(role, dim) != dim:
                raise ParityError(f"exported graph gives the {role} axis two names ({symbols[role]}, {dim})")
    return shapes


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def check_parity(run_graph: Callable[..., np.ndarray], reference: Callable[..., np.ndarray],
                 prompts: Sequence[tuple[str, list[int]]], temperature: float, atol: float, prob_atol: float,
                 media_samples: Sequence[tuple[str, list[int], Any]] = ()) -> dict[str, Any]:
    """Graph (all text prompts as one right-padded batch; each media sample alone) vs the torch model (each
    prompt alone). `run_graph(prompts, media=None)`, `reference(ids, media=None)`."""
    results = list(zip(prompts, run_graph([ids for _, ids in prompts])))
    results += [((label, ids), run_graph([ids], media=media)[0]) for label, ids, media in media_samples]
    media_of = {label: media for label, _, media in media_samples}
    rows = []
    for (label, ids), got in results:
        want = reference(ids, media_of.get(label))
        dlogit = float(np.abs(got - want).max())
        dprob = float(np.abs(_softmax(got / temperature) - _softmax(want / temperature)).max())
        rows.append({"sample": label, "tokens": len(ids), "max_abs_logit_diff": dlogit, "max_abs_prob_diff": dprob,
                     "same_argmax": bool(np.argmax(got) == np.argmax(want))})
    report = {"atol": atol, "prob_atol": prob_atol, "samples": rows,
              "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in rows),
              "max_abs_prob_diff": max(r["max_abs_prob_diff"] for r in rows)}
    bad = [r for r in rows if r["max_abs_logit_diff"] > atol or r["max_abs_prob_diff"] > prob_atol]
    if bad:
        worst = max(bad, key=lambda r: r["max_abs_logit_diff"])
        raise ParityError(f"exported graph disagrees with the torch model on {len(bad)} of {len(rows)} samples "
                          f"(worst: {worst['sample']}, {worst['tokens']} tokens, logit diff "
                          f"{worst['max_abs_logit_diff']:.3g} > {atol:g} or prob diff "
                          f"{worst['max_abs_prob_diff']:.3g} > {prob_atol:g}); no artifact written")
    return report


def check_vision_parity(session, config, atol: float, seed: int = 0) -> dict[str, Any]:
    """The vision graph vs transformers' vision tower on segments of several shapes (export refuses on a miss)."""
    from ..runtime.qwen_vision import vision_inputs
    from .d3 import VISION_PARITY_GRIDS

    rng = np.random.default_rng(seed)
    vision = config.vision_config
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    rows = []
    for h, w in VISION_PARITY_GRIDS:
        pixels = rng.standard_normal((h * w, width)).astype(np.float32)
        feeds = {"pixel_values": pixels, **vision_inputs(h, w, config.model.visual.num_grid_per_side,
                                                         vision.spatial_merge_size)}
        diff = float(np.abs(session.run(feeds)[0] - config.reference_vision(pixels, h, w)).max())
        rows.append({"grid": [h, w], "max_abs_diff": diff})
    worst = max(rows, key=lambda r: r["max_abs_diff"])
    if worst["max_abs_diff"] > atol:
        raise ParityError(f"exported vision graph disagrees with the torch vision tower on grid {worst['grid']} "
                          f"(max |diff| {worst['max_abs_diff']:.3g} > {atol:g}); no artifact written")
    return {"atol": atol, "samples": rows, "max_abs_diff": worst["max_abs_diff"]}


def _sample_prompts(staging: Path, lengths: Sequence[int], seed: int) -> list[tuple[str, list[int]]]:
    """Random token runs of the given lengths plus real d3 prompts rendered as the runtime renders them."""
    from ..models.d3 import D3Family, DecisionConfig
    from ..models.questions import parse_questions
    from ..models.request import parse_request
    from ..runtime.chat_template import ChatTemplate
    from ..runtime.prompt import render_texts
    from ..runtime.tokenizer import PromptTokenizer

    rng = np.random.default_rng(seed)
    prompts = [(f"random-{n}", rng.integers(0, 150_000, n).tolist()) for n in lengths]
    manifest_bits = json.loads((staging / "runtime_files.json").read_text())
    family = D3Family(DecisionConfig.load(staging / "decision_config.json"))
    template = ChatTemplate((staging / "chat_template.jinja").read_text(), manifest_bits["special_tokens"])
    tokenizer = PromptTokenizer(staging / "tokenizer.json")
    request = parse_request({"state": {"ticket": "Refund not received after 10 days", "tier": "gold"},
                             "questions": {
                                 "urgent": {"type": "noul", "instructions": "Is it urgent?"},
                                 "team": {"type": "choice", "criteria": {"billing": "money", "support": None}},
                                 "mood": {"type": "score", "criteria": ["calm", "annoyed", "furious"]}}})
    questions = parse_questions(request.questions, family.option_limit)
    for question, text in zip(questions, render_texts(template, family, request, questions)):
        prompts.append((f"prompt-{question.id}", tokenizer.encode(text)))
    return prompts


def export_checkpoint(source: str, out: str | Path, *, revision: str | None = None, atol: float = DEFAULT_ATOL,
                      prob_atol: float = DEFAULT_PROB_ATOL, lengths: Sequence[int] = PARITY_LENGTHS,
                      overwrite: bool = False, seed: int = 0) -> Path:
    """Export the checkpoint `source` (directory or hub id) to an artifact directory `out`."""
    import torch

    from .d1 import D1ExportConfig, is_d1_checkpoint
    from .d3 import D3ExportConfig, is_d3_checkpoint

    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty (pass --overwrite to replace it)")
    progress = Progress(6)
    progress(f"resolving checkpoint {source}")
    checkpoint = resolve_checkpoint(source, revision)
    if is_d1_checkpoint(checkpoint):
        from .d1_export import export_d1_graphs

        config_class, export_graphs = D1ExportConfig, export_d1_graphs
    elif is_d3_checkpoint(checkpoint):
        config_class, export_graphs = D3ExportConfig, _export_d3_graphs
    else:
        raise ValueError(f"{checkpoint} is not a d3 checkpoint (config.json architectures == ['Qwen3_5Model'] "
                         "and a decision_config.json, spec 4.1) nor a d1 one (architectures == "
                         "['Lfm2VlForConditionalGeneration'], spec 3)")
    progress("loading the torch reference model (fp32)")
    config = config_class(checkpoint)
    torch.manual_seed(seed)

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        bits = export_graphs(config, staging, progress, atol=atol, prob_atol=prob_atol, lengths=lengths, seed=seed)
        progress("writing the artifact")
        manifest = {
            "format": ARTIFACT_FORMAT,
            "format_version": ARTIFACT_VERSION,
            "family": config.family,
            "source": source,
            "checkpoint": str(checkpoint),
            "source_files": file_hashes(checkpoint),
            "max_model_len": config.max_model_len,
            "opset": OPSET,
            **bits,
            "versions": _versions(),
            "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, ensure_ascii=False))
        if out.exists():
            shutil.rmtree(out)
        staging.chmod(0o755)
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    parity = manifest["parity"]
    print(f"artifact written to {out} (parity: {parity['summary']})", file=sys.stderr)
    return out


def _export_d3_graphs(config, staging: Path, progress: Progress, *, atol: float, prob_atol: float,
                      lengths: Sequence[int], seed: int) -> dict[str, Any]:
    """d3: the text graph (backbone + readout) and the vision graph, each checked against the torch model."""
    import onnx
    import torch

    from ..runtime.session import GraphSession
    from ..runtime.text_batch import CodeLogitsRunner, Media, text_positions
    from .d3 import TEXT_AXES, TEXT_INPUTS, TEXT_OUTPUTS, VISION_AXES, VISION_INPUTS, VISION_OUTPUTS

    progress("exporting the text and vision graphs with torch.onnx (dynamo, opset 18); this is the long step")
    runtime_bits = config.write_runtime_files(staging)
    (staging / "runtime_files.json").write_text(json.dumps(runtime_bits))
    # One named dimension ties media_embeds and media_index together; batch and sequence stay DYNAMIC
    # (named dims would make export prove guards on the chunk arithmetic that it cannot).
    dims = {"batch": torch.export.Dim.DYNAMIC, "sequence": torch.export.Dim.DYNAMIC,
            "media": torch.export.Dim("media", max=1 << 24)}
    dynamic_shapes = {name: {axis: dims[role] for axis, role in axes.items()} for name, axes in TEXT_AXES.items()}
    graph_path = staging / "text.onnx"
    with torch.no_grad():
        torch.onnx.export(config.graph(), config.example_inputs(), str(graph_path), dynamo=True,
                          opset_version=OPSET, external_data=True, input_names=TEXT_INPUTS,
                          output_names=TEXT_OUTPUTS, dynamic_shapes=dynamic_shapes, verbose=False)
    onnx.checker.check_model(str(graph_path))
    vision_path = staging / "vision.onnx"
    with torch.no_grad():
        torch.onnx.export(config.vision_graph(), config.vision_example_inputs(), str(vision_path), dynamo=True,
                          opset_version=OPSET, external_data=True, input_names=VISION_INPUTS,
                          output_names=VISION_OUTPUTS, verbose=False,
                          dynamic_shapes={name: {0: torch.export.Dim.DYNAMIC} for name in VISION_INPUTS})
    onnx.checker.check_model(str(vision_path))
    progress("checking that batch, sequence and patch axes are symbolic")
    shapes = symbolic_axes(graph_path, TEXT_AXES)
    vision_shapes = symbolic_axes(vision_path, VISION_AXES)
    progress(f"checking parity with the torch model at lengths {list(lengths)} and on real prompts")
    runner = CodeLogitsRunner(GraphSession(graph_path, "cpu"), hidden=int(config.text_config.hidden_size))
    prompts = _sample_prompts(staging, lengths, seed)
    rng = np.random.default_rng(seed)
    media_ids = prompts[-1][1]
    media = Media(rng.standard_normal((6, config.text_config.hidden_size)).astype(np.float32),
                  np.arange(20, 26, dtype=np.int64))

    def reference(ids: list[int], media: Media | None = None) -> np.ndarray:
        if media is None:
            return config.reference_logits(ids, text_positions(len(ids)))
        return config.reference_logits(ids, text_positions(len(ids)), media.embeds, media.positions)

    parity = check_parity(lambda batch, media=None: runner.run(batch, media=media), reference, prompts,
                          config.decision_config.temperature, atol, prob_atol,
                          media_samples=[("media-embeds", media_ids, media)])
    parity["summary"] = (f"max |logit diff| {parity['max_abs_logit_diff']:.2e}, "
                         f"max |prob diff| {parity['max_abs_prob_diff']:.2e}")
    vision_parity = check_vision_parity(GraphSession(vision_path, "cpu"), config, atol)
    (staging / "runtime_files.json").unlink()
    return {
        "attention_mode": config.attention_mode,
        "num_attention_heads": int(config.text_config.num_attention_heads),
        "hidden_size": int(config.text_config.hidden_size),
        "graphs": {"text": {"file": graph_path.name, "inputs": shapes, "outputs": TEXT_OUTPUTS, "dtype": "float32"},
                   "vision": {"file": vision_path.name, "inputs": vision_shapes, "outputs": VISION_OUTPUTS,
                              "dtype": "float32", "parity": vision_parity}},
        "vision": {**runtime_bits.pop("image_processor"),
                   "patch_size": config.vision_config.patch_size,
                   "temporal_patch_size": config.vision_config.temporal_patch_size,
                   "merge_size": config.vision_config.spatial_merge_size,
                   "position_grid_side": int(config.model.visual.num_grid_per_side)},
        **runtime_bits,
        "parity": parity,
    }
