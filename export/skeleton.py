"""A checkpoint's model built with no weights: its parameters on torch's meta device, each mapped to the checkpoint
tensor that holds it. Graphs are traced on it (export/graph_export.py); the weights go from the checkpoint's files
into the graphs' data files when they are written (export/weights.py)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .weights import CheckpointTensors, Constant, Recipe, Stored, WeightError


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside the block get their parameters on the meta device (their buffers, made from the
    config, stay real). A parameter is created where its module puts it and moved at once: `torch.empty` pages that
    are never written take no memory, and an initialiser run on a meta tensor does nothing."""
    import torch
    from torch import nn

    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        with torch.device("cpu"):
            yield
    finally:
        nn.Module.register_parameter = original


class Skeleton:
    """`model` (parameters on meta) and the recipe of each of its tensors: checkpoint tensors by parameter name,
    plus those `add` registers (a readout stored in a file of its own)."""

    def __init__(self, model: Any, checkpoint: Path):
        self.model = model
        self.tensors = CheckpointTensors(checkpoint)
        self.recipes: dict[int, Recipe] = {}
        named = list(model.named_parameters(remove_duplicate=False))
        for name, param in named:  # a tied weight is found under whichever of its names the checkpoint stores
            if id(param) not in self.recipes:
                try:
                    self.recipes[id(param)] = Stored(self.tensors.find(name)[0], name)
                except WeightError:
                    pass
        missing = [name for name, param in named if id(param) not in self.recipes]
        if missing:
            raise WeightError(f"checkpoint {checkpoint} lacks {len(missing)} of the model's weights, e.g. "
                              f"{', '.join(missing[:3])}")

    @classmethod
    def build(cls, model_class: Any, config: Any, checkpoint: Path, **kwargs: Any) -> Skeleton:
        """`model_class` built from `config` in fp32 with its parameters on meta."""
        import torch

        with parameters_on_meta():
            model = model_class._from_config(config, dtype=torch.float32, **kwargs).eval()
        return cls(model, checkpoint)

    def materialize(self, device: str, module: Any = None) -> Any:
        """A copy of the model (or of `module`, one of its modules) with its weights, in fp32 on `device`, loaded
        from the checkpoint tensor by tensor."""
        import copy

        import torch

        module = self.model if module is None else module
        recipes = {name: self.recipes[id(param)] for name, param in module.named_parameters(remove_duplicate=False)}
        model = copy.deepcopy(module)
        buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
        model.to_empty(device=device)
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                buffer.copy_(buffers[name])
            for name, param in model.named_parameters(remove_duplicate=False):
                param.copy_(torch.from_numpy(self.tensors.read(recipes[name].file, recipes[name].key)))
        return model.eval()

    def parameter_count(self) -> int:
        return sum(param.numel() for param in self.model.parameters())

    def add(self, tensor: Any, recipe: Recipe) -> None:
        self.recipes[id(tensor)] = recipe

    def meta_tensor(self, file: str, key: str) -> Any:
        """A meta fp32 tensor of the shape of `key` in `file`, whose recipe is that stored tensor."""
        import torch

        stored = self.tensors.stored(file, key)
        tensor = torch.empty(stored.shape, dtype=torch.float32, device="meta")
        self.add(tensor, Stored(file, key))
        return tensor

    def weights(self, module: Any) -> Mapping[str, Recipe]:
        """The recipe of every parameter and buffer of `module` (a graph built on this skeleton's model), by the
        name the exporter gives its initializer: a stored tensor, or the value of a buffer made at construction."""
        out: dict[str, Recipe] = {}
        named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
        for name, tensor in named:
            if tensor is None:
                continue
            recipe = self.recipes.get(id(tensor))
            if recipe is None:
                if tensor.is_meta:
                    raise WeightError(f"the graph's tensor {name!r} is on meta and comes from no checkpoint tensor")
                recipe = Constant(tensor.detach().cpu().numpy().copy())
            out[name] = recipe
        return out
