"""The state a text graph carries from one call to the next, for every family: what a prompt's first tokens leave
for the tokens after them (a request's shared prefix read once, then its questions as suffixes on it; a long prompt
read in chunks).

Per decoder layer, in the graph's order, the tensors it carries (batch 1), each an input `past_{kind}_{layer}` and
an output `new_{kind}_{layer}`: an attention layer's keys and values, which grow along their third axis with the
tokens read (a call's outputs hold its own tokens' only); a short convolution's window and a recurrent state, which
keep their size (a call's outputs replace them). Each family says which its layers carry (runtime/d1/state.py,
runtime/d3/state.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

GROWING = ("key", "value")  # the kinds that grow with the tokens read


@dataclass(frozen=True)
class StateTensor:
    kind: str  # "key", "value", "conv" or "recurrent"
    layer: int
    shape: tuple[int, ...]  # before any token; keys and values hold 0 tokens on axis 2

    def name(self, prefix: str) -> str:
        return f"{prefix}_{self.kind}_{self.layer}"

    @property
    def grows(self) -> bool:
        return self.kind in GROWING


@dataclass(frozen=True)
class StateLayout:
    """The tensors a text graph's layers carry, in its inputs' order."""

    tensors: tuple[StateTensor, ...]

    def names(self, prefix: str) -> list[str]:
        """`{prefix}_{kind}_{layer}` of every tensor, in order ("past": the inputs, "new": the outputs)."""
        return [tensor.name(prefix) for tensor in self.tensors]

    def growing(self, prefix: str) -> list[str]:
        """The names of the tensors that grow with the tokens read (their axis 2)."""
        return [tensor.name(prefix) for tensor in self.tensors if tensor.grows]

    def shapes(self, past: int) -> list[tuple[int, ...]]:
        """Every tensor's shape after `past` tokens, in order."""
        return [(*t.shape[:2], past, *t.shape[3:]) if t.grows else t.shape for t in self.tensors]

    def empty(self, read_only: bool = False) -> dict[str, np.ndarray]:
        """The state of a prompt from its start, by input name: zero windows (the convolution's zero padding), zero
        recurrent states, no keys or values. `read_only` for one state fed to every captured replay: a captured
        run skips copying a read-only feed it was given before, and replays only on that array
        (runtime/cuda_graphs.py)."""
        states = {}
        for name, shape in zip(self.names("past"), self.shapes(0), strict=True):
            states[name] = np.zeros(shape, np.float32)
            states[name].flags.writeable = not read_only
        return states

    def after(self, past: Past, size: int, new: Sequence[Any]) -> Past:
        """The state after a call of `size` tokens on `past` that output `new` (in `names("new")` order, host
        arrays or device values): keys and values appended to the past's, the rest replaced. On the host."""
        states = {}
        for tensor, value in zip(self.tensors, new, strict=True):
            name = tensor.name("past")
            value = _host(value)
            states[name] = np.concatenate([_host(past.states[name]), value], axis=2) if tensor.grows else value
        return Past(past.length + size, states)


@dataclass(frozen=True)
class Past:
    """The state after `length` tokens of one prompt (batch 1), by input name: host arrays, or values already on
    the text graph's device (`GraphSession.device_values`, `held`) where several calls read it."""

    length: int
    states: dict[str, Any]

    def moved(self, move: Callable[[list[Any]], list[Any]]) -> Past:
        """The same state with its values through `move` (`GraphSession.device_values`: on the device once;
        `GraphSession.held`: out of a capturing session's memory)."""
        return Past(self.length, dict(zip(self.states, move(list(self.states.values())), strict=True)))


def _host(value: Any) -> np.ndarray:
    import onnxruntime as ort

    return value.numpy() if isinstance(value, ort.OrtValue) else value
