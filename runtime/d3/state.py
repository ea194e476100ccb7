"""The state a causal d3 text graph carries (export/d3/qwen3_5_text.py; runtime/text_state.py): per decoder layer, a
Gated DeltaNet layer's short-convolution window (its last K - 1 inputs) and its delta rule's recurrent state, a
full-attention layer's keys and values. The bidirectional mode carries none: there every question reads its whole
prompt (spec 4.3).

The artifact manifest records it as `state`: the layer kinds and the sizes below (`STATE_FIELDS`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..text_state import StateLayout, StateTensor

LINEAR = "linear_attention"
STATE_FIELDS = ("layer_types", "kv_heads", "head_dim", "conv_channels", "conv_window", "value_heads", "key_head_dim",
                "value_head_dim")


def layout_of(fields: Mapping[str, Any]) -> StateLayout | None:
    """The state of an artifact's text graph, from its manifest's model fields; None for one that carries none
    (bidirectional, or exported before prefix reuse)."""
    state = fields.get("state")
    return None if state is None else state_layout(state)


def state_layout(state: Mapping[str, Any]) -> StateLayout:
    """The layout the manifest's `state` record describes."""
    tensors = []
    for layer, kind in enumerate(state["layer_types"]):
        if kind == LINEAR:
            tensors += [StateTensor("conv", layer, (1, state["conv_channels"], state["conv_window"])),
                        StateTensor("recurrent", layer,
                                    (1, state["value_heads"], state["key_head_dim"], state["value_head_dim"]))]
        else:
            tensors += [StateTensor(kind, layer, (1, state["kv_heads"], 0, state["head_dim"]))
                        for kind in ("key", "value")]
    return StateLayout(tuple(tensors))
