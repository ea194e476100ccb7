"""Export config of family d1: an `Lfm2VlForConditionalGeneration` checkpoint (LiquidAI/d1-3B, spec 3).

Like an optimum export config, it knows the architecture's reference model (transformers' LFM2-VL, read as the
full-vocabulary log-softmax at the last prompt token, spec 3.7), the exportable graphs, their inputs and dynamic
axes, and the files the runtime needs (tokenizer as transformers loads it, the processor's chat template and image
settings, the vision position table).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...models.d1 import D1Family
from ...runtime.batch import BatchBudget
from ...runtime.d1.cells import unshuffle_order
from ...runtime.d1.image_processor import Lfm2ImageConfig
from ...runtime.d1.label_reads import LabelLogprobs
from ...runtime.d1.state import layout_of
from ...runtime.text_state import StateLayout
from ...runtime.session import GraphSession
from ...runtime.text_runner import TextRunner
from ...runtime.tokenizer import PromptTokenizer
from ..config import (ExportConfig, Gate, GraphSpec, HalfForm, Layer, RuntimeFiles, Stack, cuda_forms,
                      write_tokenizer)
from ..half_precision import FLOAT16_MATMULS
from ..skeleton import Skeleton
from ..stack import meta_outputs
from .workload import D1Workload
from ..parity import sample_prompts
from ..fused_ops import TRANSLATIONS
from .gates import SAMPLE_REQUEST, check_text_parity, check_vision_parity, label_ids
from .lfm2_text import D1TextFront, D1TextGraph
from .lfm2_vision import D1VisionGraph

TEXT_INPUTS = ["input_ids", "media_embeds", "media_index", "last_index", "label_ids"]
TEXT_OUTPUTS = ["label_logprobs", "argmax"]
GATE_REQUESTS = 70  # three questions each, every third with images: the half-precision form's 210 questions
TEXT_AXES = {"input_ids": {0: "batch", 1: "sequence"}, "media_embeds": {0: "media"}, "media_index": {0: "media"},
             "last_index": {0: "batch"}, "label_ids": {0: "labels"}}
VISION_INPUTS = ["patches", "positions"]
VISION_OUTPUTS = ["media_embeds"]
VISION_AXES = {"patches": {0: "crops", 1: "patches"}, "positions": {0: "patches"}}


def processor_settings(checkpoint: Path) -> tuple[dict[str, Any], str | None]:
    """The image processor settings and chat template of the checkpoint's processor (spec 3.3, 3.8): from
    `processor_config.json` (transformers 5) or `preprocessor_config.json`."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        path = checkpoint / name
        if path.is_file():
            raw = json.loads(path.read_text(encoding="utf-8"))
            template = raw.get("chat_template")
            return raw.get("image_processor", raw), template if isinstance(template, str) else None
    raise ValueError(f"{checkpoint} has no processor_config.json or preprocessor_config.json; d1 images need the "
                     "LFM2-VL image processor settings")


class D1ExportConfig(ExportConfig):
    workload = D1Workload
    family = "d1"

    def __init__(self, checkpoint: Path):
        from transformers import AutoConfig, Lfm2VlForConditionalGeneration

        self.checkpoint = checkpoint
        self._kept_image_features: tuple[bytes, Any] | None = None  # see _image_features
        self.config = AutoConfig.from_pretrained(checkpoint)
        self.text_config = self.config.text_config
        # Eager attention: the portable vision graph is traced through transformers' own encoder layers, whose
        # attention follows this choice (eager's products; sdpa's traces to another graph).
        self.skeleton = Skeleton.build(Lfm2VlForConditionalGeneration, self.config, checkpoint,
                                       attn_implementation="eager")
        raw, _ = processor_settings(checkpoint)
        self.image_config = Lfm2ImageConfig.from_processor_config(raw)
        vision = self.config.vision_config
        if self.image_config.encoder_patch_size != vision.patch_size:
            raise ValueError(f"processor encoder_patch_size {self.image_config.encoder_patch_size} != vision tower "
                             f"patch_size {vision.patch_size}")
        if self.image_config.downsample_factor != self.config.downsample_factor:
            raise ValueError(f"processor downsample_factor {self.image_config.downsample_factor} != model "
                             f"downsample_factor {self.config.downsample_factor}")

    def load_reference(self) -> Any:
        from transformers import Lfm2VlForConditionalGeneration

        # transformers' default attention (docs/decisions/reference-attention.md)
        return Lfm2VlForConditionalGeneration.from_pretrained(self.checkpoint, dtype=torch.float32,
                                                              attn_implementation="sdpa").eval()

    @property
    def meta(self) -> Any:
        """The skeleton's `Lfm2VlForConditionalGeneration` (parameters on meta): the graphs' structure."""
        return self.skeleton.model

    @property
    def layer_types(self) -> list[str]:
        return list(self.text_config.layer_types)

    @property
    def max_model_len(self) -> int:
        return int(self.text_config.max_position_embeddings)

    @property
    def head_dim(self) -> int:
        return self.text_config.hidden_size // self.text_config.num_attention_heads

    # -- graphs ----------------------------------------------------------------------------------------------
    def graph(self, fused: bool = False, reference: bool = False) -> D1TextGraph:
        """The text graph's module: on the skeleton (what export traces), or with `reference` on the torch model's
        weights (to run it in torch)."""
        model = self.model if reference else self.meta
        return D1TextGraph(model.model.language_model, model.lm_head, fused).eval()

    def state_shapes(self, past: int) -> list[tuple[int, ...]]:
        """Shapes of the past state inputs (batch 1) after a prefix of `past` tokens, in input order."""
        t = self.text_config
        shapes: list[tuple[int, ...]] = []
        for kind in self.layer_types:
            if kind == "full_attention":
                shapes += [(1, t.num_key_value_heads, past, self.head_dim)] * 2
            else:
                shapes.append((1, t.hidden_size, t.conv_L_cache - 1))
        return shapes

    def example_inputs(self) -> tuple[Any, ...]:
        # Distinct batch, length, past, media and label sizes, none 0 or 1, so that no axis is specialised.
        batch, length, past = 2, 37, 23
        ids = torch.randint(0, 1000, (batch, length))
        media_index = torch.tensor([3, 4, 5, length + 3])
        media = torch.randn(len(media_index), self.text_config.hidden_size)
        last = torch.tensor([length - 1, 20])
        labels = torch.tensor([542, 835, 12184, 2744, 534])
        states = tuple(torch.randn(*shape) for shape in self.state_shapes(past))
        return ids, media, media_index, last, labels, states

    def dynamic_shapes(self) -> dict[str, Any]:
        dims = {"batch": torch.export.Dim.DYNAMIC, "sequence": torch.export.Dim.DYNAMIC,
                "media": torch.export.Dim("media", max=1 << 24), "labels": torch.export.Dim.DYNAMIC}
        shapes: dict[str, Any] = {name: {axis: dims[role] for axis, role in axes.items()}
                                  for name, axes in TEXT_AXES.items()}
        past = torch.export.Dim("past", max=1 << 24)  # one length for every layer's keys and values
        shapes["states"] = tuple({2: past} if kind == "full_attention" else None
                                 for kind in self.layer_types for _ in range(2 if kind == "full_attention" else 1))
        return shapes

    def vision_graph(self, fused: bool = False, reference: bool = False) -> D1VisionGraph:
        model = self.model if reference else self.meta
        return D1VisionGraph(model.model.vision_tower, model.model.multi_modal_projector,
                             self.config.downsample_factor, fused).eval()

    def vision_example_inputs(self) -> tuple[torch.Tensor, ...]:
        h, w = 6, 10
        return torch.randn(3, h * w, self.patch_width), torch.randn(h * w, self.config.vision_config.hidden_size)

    @property
    def patch_width(self) -> int:
        vision = self.config.vision_config
        return vision.num_channels * vision.patch_size**2

    @property
    def position_table(self) -> np.ndarray:
        """The vision tower's position embedding as its square [S, S, width] table."""
        stored = self.skeleton.recipes[id(self.meta.model.vision_tower.embeddings.position_embedding.weight)]
        weight = self.skeleton.tensors.read(stored.file, stored.key).astype(np.float32)
        side = int(round(weight.shape[0] ** 0.5))
        return weight.reshape(side, side, -1)

    # -- references (the torch model) ------------------------------------------------------------------------
    @torch.no_grad()
    def reference_logprobs(self, token_ids: list[int], media_embeds: np.ndarray | None = None,
                           media_positions: np.ndarray | None = None, pixels: dict[str, Any] | None = None
                           ) -> np.ndarray:
        """The whole torch model on one unpadded prompt: log_softmax (float32) of the logits at its last token over
        the full vocabulary (spec 3.7). Media rows, when given, replace the token embeddings at `media_positions`;
        `pixels` (pixel_values, spatial_shapes, pixel_attention_mask) runs LFM2-VL's own vision path instead."""
        device = self.model.device
        ids = torch.tensor([token_ids], device=device)
        if pixels is not None:
            features = self._image_features(pixels)
            out = self.model(input_ids=ids, logits_to_keep=1, mm_encoder_outputs={"image": features})
        else:
            embeds = self.model.get_input_embeddings()(ids)
            if media_embeds is not None:
                embeds[0, torch.from_numpy(media_positions).to(device)] = torch.from_numpy(media_embeds).to(device)
            out = self.model(inputs_embeds=embeds, logits_to_keep=1)
        return torch.log_softmax(out.logits[0, -1].float(), dim=-1).cpu().numpy()

    def _image_features(self, pixels: dict[str, Any]) -> Any:
        """LFM2-VL's own vision tower and projector on `pixels` (what its forward computes from them), kept for the
        last pixels asked: a request's questions share its images, and each question's whole prompt is read with
        them."""
        key = hashlib.sha256()
        for name in sorted(pixels):
            value = np.ascontiguousarray(pixels[name])
            key.update(repr((name, value.dtype.str, value.shape)).encode())
            key.update(value.tobytes())
        digest, kept = key.digest(), self._kept_image_features
        if kept is None or kept[0] != digest:
            device = self.model.device
            tensors = {k: torch.as_tensor(v).to(device) for k, v in pixels.items()}
            tensors["pixel_values"] = tensors["pixel_values"].to(self.model.dtype)
            kept = (digest, self.model.model.get_image_features(**tensors, return_dict=True))
            self._kept_image_features = kept
        return kept[1]

    def release_reference(self) -> None:
        self._kept_image_features = None
        super().release_reference()

    @torch.no_grad()
    def reference_vision(self, patches: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
        """LFM2-VL's image features of one crop (tower + unshuffle + projector), rows in cell order."""
        h, w = grid
        feats = self.model.model.get_image_features(
            pixel_values=torch.from_numpy(patches)[None], spatial_shapes=torch.tensor([[h, w]]),
            pixel_attention_mask=torch.ones(1, h * w, dtype=torch.int32))
        return feats.pooler_output[0].float().numpy()

    @torch.no_grad()
    def reference_positions(self, grid: tuple[int, int]) -> np.ndarray:
        """SigLIP2's own resize of the position table to `grid` ([h*w, width], row-major)."""
        table = torch.from_numpy(self.position_table)
        embeddings = self.model.model.vision_tower.embeddings
        out = embeddings.resize_positional_embeddings(table, torch.tensor([list(grid)]), max_length=grid[0] * grid[1])
        return out[0].numpy()

    def vision_feeds(self, patches: np.ndarray, grid: tuple[int, int]) -> dict[str, np.ndarray]:
        order = unshuffle_order(*grid, self.config.downsample_factor)
        return {"patches": patches[order][None], "positions": self.reference_positions(grid)[order]}

    # -- runtime files ---------------------------------------------------------------------------------------
    # -- the declaration the pipeline reads -------------------------------------------------------------------
    @property
    def layout(self) -> StateLayout:
        return layout_of(self.manifest_bits())

    def graphs(self, fused: bool = False) -> list[GraphSpec]:
        """The text and vision graphs; `fused`: as the CUDA forms write them, with onnxruntime's fused ops."""
        layout = self.layout
        past_axes = {name: {2: "past"} for name in layout.growing("past")}
        dynamic = torch.export.Dim.DYNAMIC
        translations = TRANSLATIONS if fused else None
        vision_shapes = {"patches": {0: dynamic, 1: dynamic}, "positions": {0: dynamic}}
        return [
            GraphSpec("text", TEXT_INPUTS + layout.names("past"), TEXT_OUTPUTS + layout.names("new"),
                      {**TEXT_AXES, **past_axes}, self.dynamic_shapes(), lambda: self.graph(fused),
                      self.example_inputs, self.skeleton.weights, translations, stack=self._text_stack(fused)),
            GraphSpec("vision", VISION_INPUTS, VISION_OUTPUTS, VISION_AXES, vision_shapes,
                      lambda: self.vision_graph(fused), self.vision_example_inputs, self.skeleton.weights,
                      translations, stack=self._vision_stack(fused, vision_shapes)),
        ]

    def _text_stack(self, fused: bool) -> Stack:
        """The decoder as a front, a block for each kind of layer (short convolution, attention) stamped once a
        layer, and a head."""
        graph = self.graph(fused)
        translations = TRANSLATIONS if fused else None
        ids, media, media_index, last, labels, states = self.example_inputs()
        layout = self.layout
        past_names, new_names = layout.names("past"), layout.names("new")
        first = next(i for i, kind in enumerate(self.layer_types) if kind == "full_attention")
        grouped, names_of, news_of, at = [], [], [], 0
        for block in graph.blocks:
            take = 2 if block.attention else 1
            grouped.append(states[at:at + take])
            names_of.append(past_names[at:at + take])
            news_of.append(new_names[at:at + take])
            at += take
        dynamic = torch.export.Dim.DYNAMIC
        past = torch.export.Dim("past", max=1 << 24)
        front_inputs = ["input_ids", "media_embeds", "media_index", names_of[first][0]]
        front_example = (ids, media, media_index, grouped[first][0])
        made = dict(zip(D1TextFront.outputs, meta_outputs(graph.front, front_example)))
        media_rows = torch.export.Dim("media", max=1 << 24)
        front = GraphSpec("text.front", front_inputs, D1TextFront.outputs, {},
                          ({0: dynamic, 1: dynamic}, {0: media_rows}, {0: media_rows}, {2: past}),
                          lambda: self.graph(fused).front, lambda: front_example, self.skeleton.weights, translations)
        axes = {"hidden": {0: dynamic, 1: dynamic}, "update": {0: dynamic, 1: dynamic}, "cos": {0: dynamic},
                "sin": {0: dynamic}, "causal": {0: dynamic, 1: dynamic}, "past_key": {2: past},
                "past_value": {2: past}, "past_conv": None}
        blocks: dict[str, GraphSpec] = {}
        layers: list[Layer] = []
        for index, block in enumerate(graph.blocks):
            kind = "attention" if block.attention else "conv"
            state_names = ["past_key", "past_value"] if block.attention else ["past_conv"]
            if kind not in blocks:
                values = {**made, **dict(zip(state_names, grouped[index]))}
                blocks[kind] = GraphSpec(
                    f"text.{kind}", block.inputs, block.outputs, {},
                    (axes["hidden"], axes["update"], tuple(axes[name] for name in block.inputs[2:])),
                    lambda i=index: self.graph(fused).blocks[i],
                    lambda v=values, b=block: tuple(v[name] for name in b.inputs), self.skeleton.weights,
                    translations)
            layers.append(Layer(kind, lambda i=index: self.graph(fused).blocks[i],
                                dict(zip(state_names, names_of[index])),
                                dict(zip(block.outputs[2:], news_of[index]))))
        head = GraphSpec("text.head", ["hidden", "update", "last_index", "label_ids"], TEXT_OUTPUTS, {},
                         ({0: dynamic, 1: dynamic}, {0: dynamic, 1: dynamic}, {0: dynamic}, {0: dynamic}),
                         lambda: self.graph(fused).head, lambda: (made["hidden"], made["update"], last, labels),
                         self.skeleton.weights, translations)
        return Stack(front, blocks, layers, head, {"next_hidden": "hidden", "next_update": "update"})

    def _vision_stack(self, fused: bool, shapes: dict[str, Any]) -> Stack:
        """The tower as its patch embedding, one encoder layer (stamped once a layer) and the post-norm with the
        projector."""
        graph = self.vision_graph(fused)
        translations = TRANSLATIONS if fused else None
        example = self.vision_example_inputs()
        (hidden,) = meta_outputs(graph.front, example)
        dynamic = torch.export.Dim.DYNAMIC
        rows = {"hidden": {0: dynamic, 1: dynamic}}
        front = GraphSpec("vision.front", VISION_INPUTS, ["hidden"], VISION_AXES, shapes,
                          lambda: self.vision_graph(fused).front, lambda: example, self.skeleton.weights,
                          translations)
        block = GraphSpec("vision.block", ["hidden"], ["next_hidden"], {}, rows,
                          lambda: self.vision_graph(fused).blocks[0], lambda: (hidden,), self.skeleton.weights,
                          translations)
        head = GraphSpec("vision.head", ["hidden"], VISION_OUTPUTS, {}, rows, lambda: self.vision_graph(fused).head,
                         lambda: (hidden,), self.skeleton.weights, translations)
        layers = [Layer("block", lambda i=index: self.vision_graph(fused).blocks[i])
                  for index in range(len(graph.blocks))]
        return Stack(front, {"block": block}, layers, head, {"next_hidden": "hidden"})

    def gates(self, atol: float, prob_atol: float, lengths: tuple[int, ...], seed: int) -> list[Gate]:
        def text(staging: Path, files: RuntimeFiles) -> dict[str, Any]:
            runner = TextRunner(GraphSession(staging / "text.onnx", "cpu"), BatchBudget(),
                                LabelLogprobs(int(self.text_config.hidden_size)), self.layout)
            labels = label_ids(PromptTokenizer(staging / "tokenizer.json").encode)
            prompts = sample_prompts(D1Family(), staging, files, SAMPLE_REQUEST, lengths, seed,
                                     int(self.text_config.vocab_size))
            return check_text_parity(runner, self, prompts, labels, atol, seed)

        def vision(staging: Path, files: RuntimeFiles) -> dict[str, Any]:
            return check_vision_parity(GraphSession(staging / "vision.onnx", "cpu"), self, atol, seed)

        return [Gate(f"checking parity with the torch model at lengths {list(lengths)} and on real prompts, whole "
                     "and as suffixes on a prefilled prefix", text),
                Gate("checking the vision graph against LFM2-VL's image features", vision, graph="vision")]

    def forms(self) -> list[HalfForm]:
        from .answer_parity import parity_requests, reference_pairs, runtime_answers

        # The text graph at the rung's precision (its state in and out kept fp32); the vision graph with only its
        # matrix products in fp16 on every rung, as d3's (its norms, softmax and residual sums keep fp32's range),
        # converted from the fused one on the fused rungs (each layer's attention one MultiHeadAttention node read
        # in fp16, its GELU one FastGelu node) and from the portable one on the others. Every third gate request
        # has images, so the gate runs both.
        fused = dict(zip(("text", "vision"), self.graphs(fused=True)))
        return cuda_forms({"text": tuple(TEXT_OUTPUTS), "vision": tuple(VISION_OUTPUTS)},
                          lambda service: runtime_answers(service, parity_requests(GATE_REQUESTS)),
                          lambda answers: reference_pairs(answers, self),
                          fused=fused, graph_precisions={"vision": FLOAT16_MATMULS})

    def write_runtime_files(self, out: Path) -> RuntimeFiles:
        """Tokenizer (as transformers loads it for lfm2_vl: tokenizer.json as is, spec 3.4), the processor's chat
        template (spec 3.3: the processor's, else the tokenizer's), the vision position table. Returns what the
        manifest records."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.checkpoint)
        write_tokenizer(tokenizer, out)
        _, template = processor_settings(self.checkpoint)
        template = template or tokenizer.chat_template
        if not isinstance(template, str) or not template:
            raise ValueError("the checkpoint has no chat template (processor or tokenizer); d1 renders with it")
        (out / "chat_template.jinja").write_text(template, encoding="utf-8")
        np.save(out / "vision_positions.npy", self.position_table)
        fields = {**self.manifest_bits(),
                  "vision": {**self.image_config.to_dict(), "positions_file": "vision_positions.npy"}}
        return RuntimeFiles(type(tokenizer).__name__, dict(tokenizer.special_tokens_map), fields)

    def manifest_bits(self) -> dict[str, Any]:
        t = self.text_config
        return {"layer_types": self.layer_types, "num_attention_heads": int(t.num_attention_heads),
                "num_key_value_heads": int(t.num_key_value_heads), "head_dim": self.head_dim,
                "hidden_size": int(t.hidden_size), "conv_window": int(t.conv_L_cache) - 1,
                "vocab_size": int(t.vocab_size), "image_token_id": int(self.config.image_token_id),
                "vision_width": int(self.config.vision_config.hidden_size),
                "downsample_factor": int(self.config.downsample_factor)}
