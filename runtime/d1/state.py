"""The state d1's text graph carries (runtime/text_state.py): the LFM2 state of everything before a call's tokens,
batch 1."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..text_state import StateLayout, StateTensor


def layout_of(fields: Mapping[str, Any]) -> StateLayout:
    """The decoder's state (runtime/text_state.py), from the artifact manifest's model fields: an attention
    layer's keys and values, a short-convolution layer's window."""
    tensors = []
    for layer, kind in enumerate(fields["layer_types"]):
        if kind == "full_attention":
            shape = (1, int(fields["num_key_value_heads"]), 0, int(fields["head_dim"]))
            tensors += [StateTensor("key", layer, shape), StateTensor("value", layer, shape)]
        else:
            tensors.append(StateTensor("conv", layer, (1, int(fields["hidden_size"]), int(fields["conv_window"]))))
    return StateLayout(tuple(tensors))
