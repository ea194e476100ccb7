"""Export config of family d3: a bare `Qwen3_5Model` checkpoint + `readout.safetensors` + `decision_config.json`.

Like an optimum export config, it knows the architecture's reference model (transformers' `Qwen3_5Model` plus the
readout, spec 4.13/4.14), the exportable graph, its inputs and their dynamic axes, and the files the runtime needs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...models.d3 import D3Family, DecisionConfig
from ...runtime.batch import BatchBudget, MediaRows, TextRow
from ...runtime.d3.code_logits import CodeLogits, code_logits, text_positions
from ...runtime.d3.state import LINEAR, STATE_FIELDS, state_layout
from ...runtime.text_state import StateLayout
from ...runtime.d3.vision_inputs import vision_inputs
from ...runtime.session import GraphSession
from ...runtime.text_runner import TextRunner
from ..config import (ExportConfig, Gate, GraphSpec, HalfForm, Layer, RuntimeFiles, Stack, cuda_forms,
                      write_tokenizer)
from ..half_precision import FLOAT16_MATMULS
from ..skeleton import Skeleton
from ..stack import meta_outputs
from .workload import D3Workload
from ..parity import check_parity, sample_prompts, worst_vision_sample
from .fused_ops import TRANSLATIONS
from .qwen3_5_text import D3TextGraph, GatedDeltaNetLayer
from .qwen3_5_vision import D3VisionBlock, D3VisionFront, D3VisionGraph
from .streamed_reference import Prompt, streamed_logits

TEXT_INPUTS = ["input_ids", "attention_mask", "position_ids", "media_embeds", "media_index"]
TEXT_OUTPUTS = ["code_logits"]
# Which axes of each input are batch (B) and sequence (L).
TEXT_AXES = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"},
             "position_ids": {1: "batch", 2: "sequence"}, "media_embeds": {0: "media"}, "media_index": {0: "media"}}


VISION_INPUTS = ["pixel_values", "interp_index", "interp_weight", "rotary_pos", "segments"]
VISION_OUTPUTS = ["media_embeds"]
VISION_AXES = {**{name: {0: "patches"} for name in VISION_INPUTS[:-1]}, "segments": {0: "segments"}}
# Segment grids (h, w in patches) and segments a run the vision graph is checked on at export: square, wide, tall,
# odd blocks, one segment, and several of a grid in one run (a video's frame groups).
VISION_PARITY_GRIDS = ((2, 2, 1), (4, 6, 1), (16, 16, 1), (2, 40, 1), (30, 8, 1), (4, 6, 3), (8, 12, 5))


# The real d3 prompts the text gate checks, besides random token runs.
SAMPLE_REQUEST = {"state": {"ticket": "Refund not received after 10 days", "tier": "gold"},
                  "questions": {
                      "urgent": {"type": "noul", "instructions": "Is it urgent?"},
                      "team": {"type": "choice", "criteria": {"billing": "money", "support": None}},
                      "mood": {"type": "score", "criteria": ["calm", "annoyed", "furious"]}}}
RANDOM_TOKEN_IDS = 150_000  # random prompts draw from the ids every Qwen3.5 vocabulary has
GATE_REQUESTS = 70  # three questions each: the half-precision form is gated on 210 real prompts
# Every fifth of them carries images or a short video (42 questions), so the gate runs the form's vision graph; few
# enough that the gate stays a few seconds on the tiny test model.
GATE_MEDIA_EVERY = 5
READOUT_FILE = "readout.safetensors"


class D3ExportConfig(ExportConfig):
    workload = D3Workload
    family = "d3"

    def __init__(self, checkpoint: Path):
        from transformers import AutoConfig, Qwen3_5Model

        self.checkpoint = checkpoint
        self.decision_config = DecisionConfig.load(checkpoint / "decision_config.json")
        config = AutoConfig.from_pretrained(checkpoint)
        self.text_config = config.text_config
        # transformers' default attention, as the reference runs: the streamed reference runs these layers, and the
        # graphs do their own attention (docs/decisions/reference-attention.md).
        self.skeleton = Skeleton.build(Qwen3_5Model, config, checkpoint, attn_implementation="sdpa")
        readout = self.skeleton.tensors.files.get(READOUT_FILE, {})
        if "weight" not in readout:
            raise ValueError(f"{READOUT_FILE} must hold a tensor named 'weight'")
        expected = (len(self.decision_config.codes), self.text_config.hidden_size)
        if tuple(readout["weight"].shape) != expected:
            raise ValueError(f"readout weight has shape {tuple(readout['weight'].shape)}; "
                             f"decision_config.json and config.json need {expected}")
        self.readout_weight = self.skeleton.meta_tensor(READOUT_FILE, "weight")
        self.readout_bias = self.skeleton.meta_tensor(READOUT_FILE, "bias") if "bias" in readout else None

    def load_reference(self) -> Any:
        from transformers import Qwen3_5Model

        # transformers' default attention (docs/decisions/reference-attention.md)
        return Qwen3_5Model.from_pretrained(self.checkpoint, dtype=torch.float32, attn_implementation="sdpa").eval()

    def readout(self, name: str) -> torch.Tensor | None:
        """The readout's `weight` or `bias` values (fp32), for the reference."""
        if name not in self.skeleton.tensors.files[READOUT_FILE]:
            return None
        return torch.from_numpy(self.skeleton.tensors.read(READOUT_FILE, name).copy())

    @property
    def meta(self) -> Any:
        """The skeleton's `Qwen3_5Model` (parameters on meta): the graphs' structure."""
        return self.skeleton.model

    @property
    def max_model_len(self) -> int:
        return int(self.text_config.max_position_embeddings)

    @property
    def attention_mode(self) -> str:
        return self.decision_config.attention_mode

    @property
    def state_fields(self) -> dict[str, Any] | None:
        """The state the causal text graph carries between calls (prefix reuse), as the manifest records it
        (runtime/d3/state.py); None in the bidirectional mode."""
        if self.attention_mode != "causal":
            return None
        layers = self.meta.language_model.layers
        linear = next(layer.linear_attn for layer in layers if layer.block_type == LINEAR)
        attention = next(layer.self_attn for layer in layers if layer.block_type != LINEAR)
        values = ([layer.block_type for layer in layers], int(self.text_config.num_key_value_heads),
                  int(attention.head_dim), int(linear.conv_dim), int(linear.conv_kernel_size) - 1,
                  int(linear.num_v_heads), int(linear.head_k_dim), int(linear.head_v_dim))
        return dict(zip(STATE_FIELDS, values, strict=True))

    @property
    def state_layout(self) -> StateLayout | None:
        fields = self.state_fields
        return None if fields is None else state_layout(fields)

    def graph(self, fused: bool = False, reference: bool = False) -> D3TextGraph:
        """The text graph's module: on the skeleton (what export traces), or with `reference` on the torch model's
        weights (to run it in torch)."""
        if reference:
            return D3TextGraph(self.model, self.readout("weight"), self.readout("bias"), self.attention_mode,
                               fused).eval()
        return D3TextGraph(self.meta, self.readout_weight, self.readout_bias, self.attention_mode, fused).eval()

    @property
    def vision_config(self):
        return self.meta.config.vision_config

    def vision_graph(self, fused: bool = False, reference: bool = False) -> D3VisionGraph:
        return D3VisionGraph((self.model if reference else self.meta).visual, fused).eval()

    def vision_example_inputs(self) -> tuple[torch.Tensor, ...]:
        h, w, segments = 16, 20, 2  # two segments: an example of one would fix the count at 1
        grid = vision_inputs(h, w, self.meta.visual.num_grid_per_side, self.vision_config.spatial_merge_size,
                             segments)
        width = self.vision_config.in_channels * self.vision_config.temporal_patch_size * self.vision_config.patch_size**2
        return (torch.randn(segments * h * w, width), *(torch.from_numpy(grid[name]) for name in VISION_INPUTS[1:]))

    @torch.no_grad()
    def reference_vision(self, pixel_values: np.ndarray, h: int, w: int) -> np.ndarray:
        """transformers' vision tower on one segment of h x w patches: its merged rows (`pooler_output`)."""
        out = self.model.visual(torch.from_numpy(pixel_values).to(self.model.device),
                                grid_thw=torch.tensor([[1, h, w]], device=self.model.device))
        return out.pooler_output.float().cpu().numpy()

    def _read_last_token(self, length: int, positions: np.ndarray, **inputs: Any) -> np.ndarray:
        """Run `Qwen3_5Model` on one prompt of `length` tokens (bidirectional full attention when the checkpoint
        says so, spec 4.3) and apply the readout at its last token (spec 4.13)."""
        device = self.model.device
        if self.attention_mode == "noncausal_full_attention":
            inputs["attention_mask"] = {"full_attention": torch.zeros(1, 1, length, length, device=device,
                                                                      dtype=self.model.dtype),
                                        "linear_attention": None}
        position_ids = torch.from_numpy(np.ascontiguousarray(positions)).view(3, 1, -1).to(device)
        hidden = self.model(position_ids=position_ids, **inputs).last_hidden_state[0, -1].float()
        with torch.autocast(device.type, enabled=False):  # the readout in fp32, whatever precision the model ran at
            logits = hidden @ self.readout("weight").to(device).t()
            if self.readout_bias is not None:
                logits = logits + self.readout("bias").to(device)
        return logits.cpu().numpy()

    @torch.no_grad()
    def reference_logits_with_media(self, token_ids: list[int], positions: np.ndarray,
                                    images: tuple[np.ndarray, list[tuple[int, int, int]]] | None = None,
                                    videos: tuple[np.ndarray, list[tuple[int, int, int]]] | None = None
                                    ) -> np.ndarray:
        """The whole torch model on one prompt with media: transformers' `Qwen3_5Model` runs its own vision tower
        on the (pixel rows, grids) of the images and videos and scatters the rows into the pad tokens; readout at
        the last token."""
        device = self.model.device
        inputs: dict[str, Any] = {"input_ids": torch.tensor([token_ids], device=device)}
        for name, media in (("", images), ("_videos", videos)):
            if media is not None:
                inputs[f"pixel_values{name}"] = torch.from_numpy(media[0]).to(device, self.model.dtype)
                inputs["image_grid_thw" if not name else "video_grid_thw"] = torch.tensor(media[1], device=device)
        return self._read_last_token(len(token_ids), positions, **inputs)

    streams_reference = True

    def reference_logits_many(self, prompts: list[Prompt]) -> list[np.ndarray]:
        """`reference_logits_with_media` on each of `prompts`: prompt by prompt on the whole model, or, where the
        reference is streamed (`stream_bytes`), every prompt through one layer group at a time."""
        if self.stream_bytes is not None:
            return streamed_logits(self, prompts, getattr(self, "reference_device", "cpu"), self.stream_bytes)
        return [self.reference_logits_with_media(*prompt) for prompt in prompts]

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        # Three chunks of the delta rule and two distinct lengths, so no size is 0/1-specialised in the trace.
        batch, length = 2, 150
        ids = torch.randint(0, 1000, (batch, length))
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[1, 100:] = 0
        positions = torch.arange(length).view(1, 1, length).expand(3, batch, length).contiguous()
        media_index = torch.tensor([3, 4, 5, 6, length + 3, length + 4, length + 5, length + 6])
        media_embeds = torch.randn(len(media_index), self.text_config.hidden_size)
        layout = self.state_layout
        if layout is None:
            return ids, mask, positions, media_embeds, media_index
        past = 23  # neither 0 nor 1 nor a size above, so that the past's axis stays its own
        states = tuple(torch.randn(*shape) for shape in layout.shapes(past))
        return ids, mask, positions, media_embeds, media_index, states

    @torch.no_grad()
    def reference_logits(self, token_ids: list[int], positions: np.ndarray, media_embeds: np.ndarray | None = None,
                         media_positions: np.ndarray | None = None) -> np.ndarray:
        """The torch model on one unpadded prompt: readout logits at its last token (spec 4.13). Media embeddings,
        when given, replace the token embeddings at `media_positions` as `Qwen3_5Model` scatters them."""
        device = self.model.device
        embeds = self.model.get_input_embeddings()(torch.tensor([token_ids], device=device))
        if media_embeds is not None:
            embeds[0, torch.from_numpy(media_positions).to(device)] = torch.from_numpy(media_embeds).to(device)
        return self._read_last_token(len(token_ids), positions, inputs_embeds=embeds)

    # -- the declaration the pipeline reads -------------------------------------------------------------------
    def graphs(self, fused: bool = False) -> list[GraphSpec]:
        """The text and vision graphs; `fused`: as the CUDA forms write them, with onnxruntime's fused ops."""
        # One named dimension ties media_embeds and media_index together; batch and sequence stay DYNAMIC
        # (named dims would make export prove guards on the chunk arithmetic that it cannot).
        dims = {"batch": torch.export.Dim.DYNAMIC, "sequence": torch.export.Dim.DYNAMIC,
                "media": torch.export.Dim("media", max=1 << 24)}
        text_shapes = {name: {axis: dims[role] for axis, role in axes.items()} for name, axes in TEXT_AXES.items()}
        inputs, outputs, axes = TEXT_INPUTS, TEXT_OUTPUTS, TEXT_AXES
        layout = self.state_layout
        if layout is not None:
            past = torch.export.Dim("past", max=1 << 24)  # one length for every layer's keys and values
            names = layout.names("past")
            growing = layout.growing("past")  # [1, KV heads, P, D]
            text_shapes["states"] = tuple({2: past} if name in growing else None for name in names)
            inputs, outputs = inputs + names, outputs + layout.names("new")
            axes = {**axes, **{name: {2: "past"} for name in growing}}
        translations = TRANSLATIONS if fused else None
        text = GraphSpec("text", inputs, outputs, axes, text_shapes, lambda: self.graph(fused), self.example_inputs,
                         self.skeleton.weights, translations, stack=self._text_stack(fused, dims))
        vision_shapes = {name: {0: torch.export.Dim.DYNAMIC} for name in VISION_INPUTS}
        vision = GraphSpec("vision", VISION_INPUTS, VISION_OUTPUTS, VISION_AXES, vision_shapes,
                           lambda: self.vision_graph(fused), self.vision_example_inputs, self.skeleton.weights,
                           translations, stack=self._vision_stack(fused, vision_shapes))
        return [text, vision]

    def _vision_stack(self, fused: bool, shapes: dict[str, Any]) -> Stack:
        """The vision tower as its patch embedding, one block (stamped once a block) and the merger."""
        graph = self.vision_graph(fused)
        translations = TRANSLATIONS if fused else None
        example = self.vision_example_inputs()
        hidden, cos, sin = meta_outputs(graph.front, example)
        dynamic = torch.export.Dim.DYNAMIC
        front = GraphSpec("vision.front", VISION_INPUTS, D3VisionFront.outputs, VISION_AXES, shapes,
                          lambda: self.vision_graph(fused).front, lambda: example, self.skeleton.weights,
                          translations)
        block = GraphSpec("vision.block", D3VisionBlock.inputs, D3VisionBlock.outputs, {},
                          {"hidden": {0: dynamic}, "cos": {0: dynamic}, "sin": {0: dynamic}, "segments": {0: dynamic}},
                          lambda: self.vision_graph(fused).blocks[0], lambda: (hidden, cos, sin, example[4]),
                          self.skeleton.weights, translations)
        head = GraphSpec("vision.head", ["hidden"], VISION_OUTPUTS, {}, {"hidden": {0: dynamic}},
                         lambda: self.vision_graph(fused).head, lambda: (hidden,), self.skeleton.weights, translations)
        layers = [Layer("block", lambda i=index: self.vision_graph(fused).blocks[i])
                  for index in range(len(graph.blocks))]
        return Stack(front, {"block": block}, layers, head, {"next_hidden": "hidden"})

    def _text_stack(self, fused: bool, dims: dict[str, Any]) -> Stack:
        """The text graph as a front, a block for each kind of layer (Gated DeltaNet, full attention) stamped once a
        layer, and a head."""
        graph = self.graph(fused)
        translations = TRANSLATIONS if fused else None
        example = self.example_inputs()
        front_outputs = meta_outputs(graph.front, example[:5])
        made = dict(zip(graph.front.outputs, front_outputs))
        made["attention_mask"] = example[1]
        dynamic = torch.export.Dim.DYNAMIC
        axes = {"hidden": {0: dynamic, 1: dynamic}, "update": {0: dynamic, 1: dynamic},
                "attention_mask": {0: dynamic, 1: dynamic}, "cos": {0: dynamic, 2: dynamic},
                "sin": {0: dynamic, 2: dynamic}, "additive_mask": {0: dynamic, 3: dynamic}, "lengths": {0: dynamic}}
        front = GraphSpec("text.front", TEXT_INPUTS, graph.front.outputs, TEXT_AXES,
                          {name: {axis: dims[role] for axis, role in roles.items()} for name, roles in TEXT_AXES.items()},
                          lambda: self.graph(fused).front, lambda: example[:5], self.skeleton.weights, translations)
        layout = self.state_layout
        states = example[5] if layout is not None else ()
        past_names, new_names = (layout.names("past"), layout.names("new")) if layout is not None else ([], [])
        past = torch.export.Dim("past", max=1 << 24)
        blocks: dict[str, GraphSpec] = {}
        layers: list[Layer] = []
        for index, block in enumerate(graph.blocks):
            kind = "linear" if isinstance(block.mixer, GatedDeltaNetLayer) else "full"
            state = {}
            if layout is not None:
                state = {"past_a": states[2 * index], "past_b": states[2 * index + 1]}
            if kind not in blocks:
                values = {**made, **state}
                block_axes = {**axes, **({"past_a": {2: past}, "past_b": {2: past}} if kind == "full" else
                                         {"past_a": None, "past_b": None})}
                blocks[kind] = GraphSpec(
                    f"text.{kind}", block.inputs, block.outputs, {},  # forward(hidden, update, *rest)
                    (block_axes["hidden"], block_axes["update"], tuple(block_axes[n] for n in block.inputs[2:])),
                    lambda i=index: self.graph(fused).blocks[i], lambda v=values, b=block: tuple(v[n] for n in b.inputs),
                    self.skeleton.weights, translations)
            layers.append(Layer(kind, lambda i=index: self.graph(fused).blocks[i],
                                dict(zip(("past_a", "past_b"), past_names[2 * index:2 * index + 2])),
                                dict(zip(("new_a", "new_b"), new_names[2 * index:2 * index + 2]))))
        head = GraphSpec("text.head", ["hidden", "update", "attention_mask"], TEXT_OUTPUTS, {},
                         ({0: dynamic, 1: dynamic},) * 3, lambda: self.graph(fused).head,
                         lambda: (made["hidden"], made["update"], example[1]), self.skeleton.weights, translations)
        return Stack(front, blocks, layers, head, {"next_hidden": "hidden", "next_update": "update"})

    def gates(self, atol: float, prob_atol: float, lengths: tuple[int, ...], seed: int) -> list[Gate]:
        def text(staging: Path, files: RuntimeFiles) -> dict[str, Any]:
            hidden = int(self.text_config.hidden_size)
            family = D3Family.load(staging)
            prompts = sample_prompts(family, staging, files, SAMPLE_REQUEST, lengths, seed, RANDOM_TOKEN_IDS)
            rng = np.random.default_rng(seed)
            media = MediaRows(rng.standard_normal((6, hidden)).astype(np.float32), np.arange(20, 26, dtype=np.int64))

            references: dict[tuple, np.ndarray] = {}  # each prompt's torch run, read whole and as a suffix

            def reference(ids: list[int], media: MediaRows | None = None) -> np.ndarray:
                key = (tuple(ids), media is None)
                if key not in references:
                    rows = (None, None) if media is None else (media.embeds, media.positions)
                    references[key] = self.reference_logits(ids, text_positions(len(ids)), *rows)
                return references[key]

            def as_suffixes(batch: list[list[int]], media: MediaRows | None = None) -> np.ndarray:
                """Each prompt read as a suffix on its first half (past its media rows), prefilled alone."""
                out = []
                for ids in batch:
                    split = max(len(ids) // 2, 0 if media is None else int(media.positions[-1]) + 1)
                    positions = text_positions(len(ids))
                    row = TextRow(ids, positions, media)
                    prefix = runner.prefill(runner.start(), row.part(0, split))
                    out.append(code_logits(runner.read_suffixes(prefix, [row.part(split)]))[0])
                return np.stack(out)

            samples = [("media-embeds", prompts[-1][1], media)]
            # The torch model's logits first, then the model let go before the graph's session is made: the fp32
            # model and the fp32 graph in memory one after the other (the last gate: none after it reads it).
            for _, ids in prompts:
                reference(ids)
            reference(samples[0][1], media)
            self.release_reference()
            runner = TextRunner(GraphSession(staging / "text.onnx", "cpu"), BatchBudget(), CodeLogits(hidden),
                                self.state_layout)

            def whole(batch: list[list[int]], media: MediaRows | None = None) -> np.ndarray:
                """Each prompt read whole, `media` rows at the same positions in every one (spec 4.8)."""
                return code_logits(runner.run_rows([TextRow(ids, text_positions(len(ids)), media) for ids in batch]))

            args = (self.decision_config.temperature, atol, prob_atol)
            report = check_parity(whole, reference, prompts, *args, media_samples=samples)
            if runner.layout is not None:  # causal: the questions' reads on a prefix read once (prefix reuse)
                suffixes = check_parity(as_suffixes, reference, [p for p in prompts if len(p[1]) > 1], *args,
                                        media_samples=samples)
                report["suffix_reads"] = suffixes
                for figure in ("max_abs_logit_diff", "max_abs_prob_diff"):
                    report[figure] = max(report[figure], suffixes[figure])
            report["summary"] = (f"max |logit diff| {report['max_abs_logit_diff']:.2e}, "
                                 f"max |prob diff| {report['max_abs_prob_diff']:.2e}")
            return report

        def vision(staging: Path, files: RuntimeFiles) -> dict[str, Any]:
            session = GraphSession(staging / "vision.onnx", "cpu")
            rng = np.random.default_rng(0)
            config = self.vision_config
            width = config.in_channels * config.temporal_patch_size * config.patch_size**2
            rows = []
            for h, w, segments in VISION_PARITY_GRIDS:
                pixels = rng.standard_normal((segments * h * w, width)).astype(np.float32)
                feeds = {"pixel_values": pixels, **vision_inputs(h, w, self.meta.visual.num_grid_per_side,
                                                                 config.spatial_merge_size, segments)}
                reference = np.concatenate([self.reference_vision(part, h, w)
                                            for part in np.split(pixels, segments)])
                diff = float(np.abs(session.run(feeds)[0] - reference).max())
                rows.append({"grid": [h, w], "segments": segments, "max_abs_diff": diff})
            return worst_vision_sample(rows, atol, "the torch vision tower")

        suffixes = ", whole and as suffixes on a prefilled prefix" if self.state_layout is not None else ""
        # The vision gate first: the text gate lets the torch model go once it has its logits.
        return [Gate("checking the vision graph against the torch vision tower", vision, graph="vision"),
                Gate(f"checking parity with the torch model at lengths {list(lengths)} and on real prompts{suffixes}",
                     text)]

    def random_token_bound(self) -> int:
        return RANDOM_TOKEN_IDS

    def forms(self) -> list[HalfForm]:
        from .answer_parity import parity_requests, reference_pairs, runtime_answers

        # Both graphs in half precision, each with its output in fp32: the text graph at the rung's precision (the
        # fused text graph runs the delta rule as onnxruntime's GatedDeltaNet node); the vision graph with only its
        # matrix products in fp16 on every rung (autocast's split: its norms and residual sums keep fp32's range),
        # converted from the fused one on the fused rungs (each block's attention one MultiHeadAttention node read
        # in fp16) and from the portable one on the others. The gate's media requests run it.
        fused = dict(zip(("text", "vision"), self.graphs(fused=True)))
        requests = parity_requests(GATE_REQUESTS, GATE_MEDIA_EVERY)
        return cuda_forms({"text": tuple(TEXT_OUTPUTS), "vision": tuple(VISION_OUTPUTS)},
                          lambda service: runtime_answers(service, requests),
                          lambda answers: reference_pairs(answers, self),
                          fused=fused, graph_precisions={"vision": FLOAT16_MATMULS})

    def write_runtime_files(self, staging: Path) -> RuntimeFiles:
        bits = write_runtime_files(self.checkpoint, staging)
        vision = self.vision_config
        state = self.state_fields
        fields = {"attention_mode": self.attention_mode,
                  "num_attention_heads": int(self.text_config.num_attention_heads),
                  "hidden_size": int(self.text_config.hidden_size),
                  **({"state": state} if state is not None else {}),
                  "vision": {**bits["image_processor"], "patch_size": vision.patch_size,
                             "temporal_patch_size": vision.temporal_patch_size,
                             "merge_size": vision.spatial_merge_size,
                             "position_grid_side": int(self.meta.visual.num_grid_per_side)}}
        return RuntimeFiles(bits["tokenizer_class"], bits["special_tokens"], fields)

def write_runtime_files(checkpoint: Path, out: Path) -> dict[str, Any]:
    """Tokenizer (as transformers builds it: the Qwen3.5 rebuild, spec 4.7), the tokenizer's chat template (spec
    4.6: d3 renders with the tokenizer's own) and the decision config. Returns what the manifest records."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    write_tokenizer(tokenizer, out)
    template = tokenizer.chat_template
    if not isinstance(template, str) or not template:
        raise ValueError("the checkpoint's tokenizer has no chat template; d3 renders with the tokenizer's own")
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    (out / "decision_config.json").write_bytes((checkpoint / "decision_config.json").read_bytes())
    processor = checkpoint / "preprocessor_config.json"
    if not processor.is_file():
        raise ValueError("the checkpoint has no preprocessor_config.json; d3 images need its mean and std")
    image = json.loads(processor.read_text(encoding="utf-8"))
    return {"tokenizer_class": type(tokenizer).__name__, "special_tokens": dict(tokenizer.special_tokens_map),
            "image_processor": {"image_mean": [float(x) for x in image["image_mean"]],
                                "image_std": [float(x) for x in image["image_std"]]}}
