"""What a family's export config declares, as optimum's export configs do: the reference model, the graphs (their
module, example inputs, input/output names and dynamic axes), the runtime files, the manifest fields the engine
reads, and the parity gates an exported artifact must pass before it is written. The pipeline does the rest."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .half_precision import FLOAT16, FLOAT16_MATMULS, FLOAT16_MIXED, FLOAT32_FP16_WEIGHTS, Precision
from .skeleton import Skeleton
from .weights import Recipe

if TYPE_CHECKING:
    from .workload import Workload


class ParityError(RuntimeError):
    pass


@dataclass(frozen=True)
class AnswerTolerance:
    """How far a half-precision form's answers may be from the torch fp32 model's (export/answer_gate.py)."""

    max_dp: float = 0.02
    median_dp: float = 0.003
    pick_margin: float = 0.02  # picks must agree wherever the reference's top two are further apart than this
    min_questions: int = 200


@dataclass(frozen=True)
class Layer:
    """One layer of a stack: the block it stamps, its own module (whose tensors are the layer's weights, by the
    names the block's are traced under), and which block inputs and outputs are the graph's (its state)."""

    block: str
    module: Callable[[], Any]
    inputs: Mapping[str, str] = field(default_factory=dict)  # block input -> graph input
    outputs: Mapping[str, str] = field(default_factory=dict)  # block output -> graph output


@dataclass(frozen=True)
class Stack:
    """front -> layers (each a stamped block) -> head. A block's outputs that are not the graph's are carried to
    the next layer, and the last layer's to the head, under their names; the front's outputs are read by every
    block and the head."""

    front: GraphSpec
    blocks: Mapping[str, GraphSpec]
    layers: list[Layer]
    head: GraphSpec
    carry: Mapping[str, str] = field(default_factory=dict)  # a block's output -> the name the next block reads


@dataclass(frozen=True)
class GraphSpec:
    """One graph to export: `axes` names the role of each dynamic input axis (checked symbolic after export);
    `dynamic_shapes` is torch.export's form of the same."""

    name: str
    inputs: list[str]
    outputs: list[str]
    axes: dict[str, dict[int, str]]
    dynamic_shapes: Any
    module: Callable[[], Any]  # built on the config's skeleton: parameters on the meta device
    example_inputs: Callable[[], tuple[Any, ...]]
    weights: Callable[[Any], Mapping[str, Recipe]]  # the module's tensors' recipes by name (Skeleton.weights)
    translations: dict[Any, Callable[..., Any]] | None = None  # custom torch ops -> the ONNX they become
    stack: Stack | None = None  # traced as pieces, the blocks stamped a layer each (export/stack.py)

    @property
    def file(self) -> str:
        return f"{self.name}.onnx"


@dataclass(frozen=True)
class Gate:
    """A parity check run on the staged artifact; `check(staging, files)` returns its report or raises
    `ParityError`. `graph` names the graph the report belongs to (its manifest entry records it); None for
    the artifact's own parity report."""

    title: str
    check: Callable[[Path, "RuntimeFiles"], dict[str, Any]]
    graph: str | None = None


def write_tokenizer(tokenizer: Any, out: Path) -> None:
    """`out`/tokenizer.json from a transformers tokenizer's backend, without indentation: the runtime reads, hashes
    and parses the whole file at every start, and the indentation more than doubles it
    (docs/decisions/tokenizer-load.md)."""
    tokenizer.backend_tokenizer.save(str(out / "tokenizer.json"), pretty=False)


@dataclass(frozen=True)
class RuntimeFiles:
    """The non-graph files an export writes (tokenizer, chat template, family files) and what the manifest
    records of them."""

    tokenizer_class: str
    special_tokens: dict[str, Any]
    model_fields: dict[str, Any]  # family fields the engine reads (shapes, vision settings)


@dataclass(frozen=True)
class HalfForm:
    """A half-precision form export writes beside the portable fp32 graphs (docs/decisions/cuda-form-ladder.md): the
    graphs it rewrites, each with the outputs that stay fp32 (the readout), and the questions its answer gate
    compares: `runtime_answers(service)` runs them through `service` (the runtime on this form) and keeps what the
    torch model needs of them (no session); `reference_pairs(answers)` then runs the torch model on the same prompts
    and pairs the two. The runtime is let go in between, so the two never share the device."""

    name: str
    providers: tuple[str, ...]
    graphs: dict[str, tuple[str, ...]]
    runtime_answers: Callable[[Any], Any]
    reference_pairs: Callable[[Any], list[Any]]
    precision: Precision = FLOAT16
    tolerance: AnswerTolerance = AnswerTolerance()
    # Graphs the form exports itself (with fused onnxruntime ops) rather than rewriting the portable export's.
    sources: dict[str, GraphSpec] = field(default_factory=dict)
    # Graphs rewritten at another precision than `precision`, whatever the rung (d3's vision graph: matrix products
    # only, its norms, softmax and residual sums in fp32 where an all-fp16 tower may overflow).
    graph_precisions: dict[str, Precision] = field(default_factory=dict)

    def precision_of(self, graph: str) -> Precision:
        return self.graph_precisions.get(graph, self.precision)


def cuda_forms(graphs: dict[str, tuple[str, ...]], runtime_answers: Callable[[Any], Any],
               reference_pairs: Callable[[Any], list[Any]], fused: dict[str, GraphSpec] | None = None,
               graph_precisions: dict[str, Precision] | None = None) -> list[HalfForm]:
    """The CUDA forms, fastest first: export writes the first whose answers pass the gate (export/forms.py).
    With `fused` (graphs written with onnxruntime's fused contrib ops: no control flow) the fused graphs come first,
    then the portable graph rewritten. Each at three precisions, fastest first (half_precision.py): every node in
    fp16 (the decay and recurrence aside); autocast's mixed precision; fp16 matrix products on an fp32 residual
    stream, norms and elementwise ops, which rounds least. `graph_precisions` holds a graph at one precision on
    every rung. Last, `cuda-fp32`: the portable graphs computing in fp32 from fp16 weights, every graph, the
    slowest and exact (for a model whose fp16 rounding the gate refuses: d3 (27B) on random weights)."""
    ladder = [("cuda-fused-fp16", FLOAT16, fused), ("cuda-fused-mixed", FLOAT16_MIXED, fused),
              ("cuda-fused", FLOAT16_MATMULS, fused)] if fused else []
    ladder += [("cuda-fp16", FLOAT16, None), ("cuda-mixed", FLOAT16_MIXED, None),
               ("cuda-fp16-matmuls", FLOAT16_MATMULS, None)]
    forms = [HalfForm(name, ("cuda",), graphs, runtime_answers, reference_pairs, precision, sources=sources or {},
                      graph_precisions=graph_precisions or {}) for name, precision, sources in ladder]
    return [*forms, HalfForm("cuda-fp32", ("cuda",), graphs, runtime_answers, reference_pairs, FLOAT32_FP16_WEIGHTS)]


class ExportConfig(ABC):
    """A family's export declaration for one checkpoint. Its graphs are traced on `skeleton` (no weights); the torch
    reference the gates compare against (`model`, fp32) is loaded only when a gate first reads it, on the gate's
    device (`reference_on`)."""

    family: str
    skeleton: Skeleton
    checkpoint: Path
    workload: type[Workload]  # what `systemone bench` runs through the runtime and torch (export/workload.py)

    @abstractmethod
    def __init__(self, checkpoint: Path):
        """Read the checkpoint's configs and build its skeleton."""

    @abstractmethod
    def load_reference(self) -> Any:
        """The checkpoint's torch model (fp32, eval), loaded as transformers loads it, on the CPU."""

    @property
    def model(self) -> Any:
        """The torch reference (fp32), loaded on first use."""
        if getattr(self, "_reference", None) is None:
            self._reference = self.load_reference()
        return self._reference

    def release_reference(self) -> None:
        """The torch reference let go (loaded again if read again): a gate that has the reference's answers runs the
        fp32 graphs without the fp32 model beside them, the two together most of export's memory."""
        import gc

        self._reference = None
        gc.collect()

    @property
    @abstractmethod
    def max_model_len(self) -> int:
        """The model's positions."""

    @abstractmethod
    def graphs(self, fused: bool = False) -> list[GraphSpec]:
        """The graphs to export, in order; `fused`: as the fused CUDA forms write them (onnxruntime's fused ops)."""

    @abstractmethod
    def write_runtime_files(self, staging: Path) -> RuntimeFiles:
        """Tokenizer, chat template and the family's other files, written into `staging`."""

    @abstractmethod
    def gates(self, atol: float, prob_atol: float, lengths: tuple[int, ...], seed: int) -> list[Gate]:
        """The parity gates, in the order they run; the text graph's (`graph` None) report is the artifact's."""

    def forms(self) -> list[HalfForm]:
        """The half-precision forms to write beside the portable graphs (none unless the family declares them)."""
        return []

    def random_token_bound(self) -> int:
        """Random token ids (the bench's batches) are drawn below this: ids every checkpoint of the family has."""
        return int(self.text_config.vocab_size)

    # Layer-streamed reference (`streams_reference`): the fp32 layers on the device at once, as a share of its free
    # memory; the whole model is streamed when its fp32 weights are over `WHOLE_REFERENCE_SHARE` of that memory.
    STREAM_GROUP_SHARE = 0.25
    WHOLE_REFERENCE_SHARE = 0.8
    streams_reference = False  # whether the family can run its reference layer group by layer group
    stream_bytes: int | None = None  # set while the reference is streamed: the layers' bytes on the device at once

    @contextmanager
    def reference_on(self, device: str) -> Iterator[None]:
        """The torch reference on `device` (cpu, cuda), in fp32 without TF32 (its 10-bit mantissa is not a
        reference) while the block runs; torch's TF32 settings are restored after it. On CUDA a reference not yet
        loaded goes from the checkpoint's files to the device tensor by tensor, never whole in host memory; where
        its fp32 weights do not fit the device and the family `streams_reference`, it is not loaded whole at all:
        `stream_bytes` says how many bytes of its layers the family's reference loads at once."""
        import torch

        saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        self.reference_device = device
        try:
            if device == "cuda" and getattr(self, "_reference", None) is None and self.stream_bytes is None:
                free = torch.cuda.mem_get_info()[0]
                if self.streams_reference and 4 * self.skeleton.parameter_count() > self.WHOLE_REFERENCE_SHARE * free:
                    self.stream_bytes = int(self.STREAM_GROUP_SHARE * free)
                else:
                    self._reference = self.skeleton.materialize("cuda")
            if self.stream_bytes is None:
                self.model.to("cuda" if device == "cuda" else "cpu")
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
