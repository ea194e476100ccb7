"""What `systemone bench` asks of a family: how the runtime and the checkpoint's torch model each read a batch of
token ids into the numbers the family reads, and the whole requests it times. Each family's export config names
its own (`ExportConfig.workload`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..models.family import Readout
from ..runtime.engine import Prepared
from ..runtime.service import DecisionService


@dataclass
class Workload(ABC):
    """A family's batches and requests: how to run a token batch through the runtime and through torch."""

    service: DecisionService | None  # None once its form is measured
    reference: Any  # the family's ExportConfig (its readout, attention mode and model class)
    vocab: int
    constants: dict[tuple[str, str], Any] = field(default_factory=dict, repr=False)

    def on_device(self, name: str, make: Callable[[], Any], device: Any) -> Any:
        """A constant tensor on `device`, made once: a copy from the host inside a CUDA-graph capture would fail,
        and in eager it would be timed as the model's work."""
        if (name, str(device)) not in self.constants:
            self.constants[name, str(device)] = make().to(device)
        return self.constants[name, str(device)]

    @abstractmethod
    def runtime_batch(self, ids: np.ndarray) -> np.ndarray:
        """The runtime's numbers for a [B, L] batch of token ids (the graph run only)."""

    @abstractmethod
    def torch_inputs(self, model: Any, ids: np.ndarray) -> dict[str, Any]:
        """The torch model's inputs for a [B, L] batch of token ids, on its device."""

    @abstractmethod
    def torch_logits(self, model: Any, inputs: dict[str, Any]) -> Any:
        """The runtime's numbers from the torch model, a tensor on its device (`model`: the family's model class,
        in any dtype, on any device)."""

    def torch_batch(self, model: Any, ids: np.ndarray) -> np.ndarray:
        import torch

        with torch.no_grad():
            return self.torch_logits(model, self.torch_inputs(model, ids)).float().cpu().numpy()

    @staticmethod
    @abstractmethod
    def requests() -> dict[str, Callable[[int], dict[str, Any]]]:
        """Whole-request kinds: name -> the i-th request body."""

    @abstractmethod
    def torch_answers(self, model: Any, prepared: Prepared) -> list[Readout]:
        """A prepared request read by the torch model as a competent torch server reads it (the reference server,
        systemone/reference_server.py): its media through the vision tower once, then all of its prompts in one
        padded forward, each read at its last token."""

    @staticmethod
    def padded(model: Any, prepared: Prepared) -> tuple[Any, np.ndarray]:
        """The prompts' token ids right-padded into one [B, L] batch on the model's device, and their lengths: a
        prompt's tokens come before its padding, so no causal layer (Gated DeltaNet, the short convolutions,
        causal attention) sees it, and d3's bidirectional attention masks it."""
        import torch

        lengths = np.array([len(p.token_ids) for p in prepared.prompts])
        ids = np.zeros((len(lengths), int(lengths.max())), np.int64)
        for row, prompt in enumerate(prepared.prompts):
            ids[row, :lengths[row]] = prompt.token_ids
        return torch.from_numpy(ids).to(model.device), lengths
