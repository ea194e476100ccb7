"""The state a causal d3 text graph carries from one call to the next (export/d3/qwen3_5_text.py): what a request's
shared prefix leaves for its questions' suffixes to read (prefix reuse).

Per decoder layer, in the graph's order: a Gated DeltaNet layer's short-convolution window (its last K - 1 inputs)
and its delta rule's recurrent state; a full-attention layer's keys and values. The bidirectional mode carries none:
there every question reads its whole prompt (spec 4.3).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

LINEAR = "linear_attention"


@dataclass(frozen=True)
class D3StateLayout:
    """The layer kinds and state shapes, as the artifact manifest records them (`state`)."""

    layer_types: tuple[str, ...]
    kv_heads: int
    head_dim: int
    conv_channels: int
    conv_window: int  # K - 1
    value_heads: int
    key_head_dim: int
    value_head_dim: int

    @classmethod
    def from_manifest(cls, fields: Mapping[str, Any]) -> D3StateLayout | None:
        """The layout of an artifact whose text graph carries state; None for one without (bidirectional, or
        exported before prefix reuse)."""
        state = fields.get("state")
        if state is None:
            return None
        return cls(**{**state, "layer_types": tuple(state["layer_types"])})

    def manifest_fields(self) -> dict[str, Any]:
        return {**asdict(self), "layer_types": list(self.layer_types)}

    def names(self, prefix: str) -> list[str]:
        """Per layer in order: `{prefix}_conv_i`, `{prefix}_recurrent_i` (Gated DeltaNet) or `{prefix}_key_i`,
        `{prefix}_value_i` (full attention)."""
        names = []
        for i, kind in enumerate(self.layer_types):
            names += ([f"{prefix}_conv_{i}", f"{prefix}_recurrent_{i}"] if kind == LINEAR
                      else [f"{prefix}_key_{i}", f"{prefix}_value_{i}"])
        return names

    def shapes(self, past: int) -> list[tuple[int, ...]]:
        """The past inputs' shapes (batch 1) after `past` tokens, in input order."""
        shapes: list[tuple[int, ...]] = []
        for kind in self.layer_types:
            if kind == LINEAR:
                shapes += [(1, self.conv_channels, self.conv_window),
                           (1, self.value_heads, self.key_head_dim, self.value_head_dim)]
            else:
                shapes += [(1, self.kv_heads, past, self.head_dim)] * 2
        return shapes

    def empty(self) -> dict[str, np.ndarray]:
        """The past of a prompt from its start: zero windows (the convolution's zero padding), zero recurrent
        states, no keys. Read-only: a captured run skips copying a feed it was given before (runtime/cuda_graphs.py)."""
        states = {}
        for name, shape in zip(self.names("past"), self.shapes(0), strict=True):
            states[name] = np.zeros(shape, np.float32)
            states[name].flags.writeable = False
        return states
