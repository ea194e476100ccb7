"""What a family's export config declares, as optimum's export configs do: the reference model, the graphs (their
module, example inputs, input/output names and dynamic axes), the runtime files, the manifest fields the engine
reads, and the parity gates an exported artifact must pass before it is written. The pipeline does the rest."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ParityError(RuntimeError):
    pass


@dataclass(frozen=True)
class GraphSpec:
    """One graph to export: `axes` names the role of each dynamic input axis (checked symbolic after export);
    `dynamic_shapes` is torch.export's form of the same."""

    name: str
    inputs: list[str]
    outputs: list[str]
    axes: dict[str, dict[int, str]]
    dynamic_shapes: Any
    module: Callable[[], Any]
    example_inputs: Callable[[], tuple[Any, ...]]

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


@dataclass(frozen=True)
class RuntimeFiles:
    """The non-graph files an export writes (tokenizer, chat template, family files) and what the manifest
    records of them."""

    tokenizer_class: str
    special_tokens: dict[str, Any]
    model_fields: dict[str, Any]  # family fields the engine reads (shapes, vision settings)


class ExportConfig(ABC):
    family: str

    @abstractmethod
    def __init__(self, checkpoint: Path):
        """Load the checkpoint's torch reference (fp32)."""

    @property
    @abstractmethod
    def max_model_len(self) -> int:
        """The model's positions."""

    @abstractmethod
    def graphs(self) -> list[GraphSpec]:
        """The graphs to export, in order."""

    @abstractmethod
    def write_runtime_files(self, staging: Path) -> RuntimeFiles:
        """Tokenizer, chat template and the family's other files, written into `staging`."""

    @abstractmethod
    def gates(self, atol: float, prob_atol: float, lengths: tuple[int, ...], seed: int) -> list[Gate]:
        """The parity gates, in order; the first is the text graph's, whose report is the artifact's."""
