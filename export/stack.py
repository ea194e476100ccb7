"""A graph built from pieces traced once each, as onnxruntime-genai's builder writes a model layer by layer: a front
(embeddings, positions, masks), one block per kind of layer, and a head; the block of each layer's kind is stamped
once per layer, its values renamed and its weights read from that layer's tensors.

Tracing is most of an export's time and grows with the graph it traces; a stack traces one layer of each kind
whatever the depth (docs/decisions/export-without-weights.md). Pieces meet by name: a block reads the front's
outputs and the previous layer's (the values it carries: the residual stream), and a layer's state inputs and
outputs are the graph's own."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .config import GraphSpec
from .weights import Derived, Recipe, Stored, TracedGraph, WeightBook, WeightError, recipe_of


def meta_outputs(module: Any, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """`module`'s outputs on meta tensors (shapes and dtypes, no values): a piece's outputs as the next piece's
    example inputs."""
    import copy

    import torch

    meta = torch.utils._pytree.tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, inputs)
    with torch.no_grad():
        out = copy.deepcopy(module).to("meta")(*meta)
    return out if isinstance(out, tuple) else (out,)


class _Renamer:
    """Copies a piece's nodes into the composed graph: its values renamed (`prefix` + name) but those bound to
    names outside it (its inputs, and outputs the graph takes), subgraphs' references to the piece included."""

    def __init__(self, prefix: str, bound: Mapping[str, str]):
        self.prefix, self.bound = prefix, dict(bound)

    def __call__(self, name: str) -> str:
        if not name:
            return name
        return self.bound.get(name, self.prefix + name)

    def graph(self, graph, local: set[str] | None = None) -> None:
        """Rename, in place, the values of `graph` (a piece's main graph, or a subgraph whose own values are
        `local` and are renamed too: its names are unique in the piece, so prefixing them keeps them unique)."""
        for node in graph.node:
            node.name = self.prefix + (node.name or node.op_type)
            node.input[:] = [self(name) for name in node.input]
            node.output[:] = [self(name) for name in node.output]
            for attribute in node.attribute:
                for body in [attribute.g] * attribute.HasField("g") + list(attribute.graphs):
                    self.graph(body)
                    for value in [*body.input, *body.output, *body.value_info]:
                        value.name = self(value.name)
                    for tensor in body.initializer:
                        tensor.name = self(tensor.name)


def _rekeyed(book: WeightBook, prefix: str, layer: Mapping[str, Recipe] | None) -> dict[str, Recipe]:
    """The piece's recipes under `prefix`; a block's stored tensors replaced by the layer's (`layer`: recipes by
    the names the block's tensors were traced under)."""
    out: dict[str, Recipe] = {}
    for name, recipe in book.recipes.items():
        if isinstance(recipe, Stored) and layer is not None:
            if name not in layer:
                raise WeightError(f"the layer has no tensor {name!r}, which its block reads")
            recipe = layer[name]
        elif isinstance(recipe, Derived):
            recipe = Derived(recipe.node, tuple(prefix + i if i else "" for i in recipe.inputs), recipe.output)
        out[prefix + name] = recipe
    return out


def _add_piece(graph, book: WeightBook, traced: TracedGraph, prefix: str, bound: Mapping[str, str],
               layer: Mapping[str, Recipe] | None) -> None:
    piece = traced.proto().graph
    rename = _Renamer(prefix, bound)
    rename.graph(piece)
    for tensor in piece.initializer:
        recipe = recipe_of(tensor)
        tensor.name = rename(tensor.name)
        if recipe is not None:
            for entry in tensor.external_data:
                if entry.key == "recipe":
                    entry.value = prefix + recipe
    # The values between pieces typed too (a piece's outputs), as the half-precision rewrite reads every float's type.
    for value in [*piece.value_info, *(out for out in piece.output if out.name not in bound)]:
        typed = graph.value_info.add()
        typed.CopyFrom(value)
        typed.name = rename(value.name)
        if typed.type.HasField("tensor_type"):
            typed.type.tensor_type.ClearField("shape")  # pieces name their symbolic dims apart; types are enough
    graph.node.extend(piece.node)
    graph.initializer.extend(piece.initializer)
    for name, recipe in _rekeyed(traced.book, prefix, layer).items():
        book.add(name, recipe)


def _dims(value, roles: Mapping[int, str]) -> None:
    """Name `value`'s symbolic dims by their roles; other symbolic dims stay as they are."""
    for axis, dim in enumerate(value.type.tensor_type.shape.dim):
        if axis in roles:
            dim.ClearField("dim_value")
            dim.dim_param = roles[axis]


def compose(spec: GraphSpec, front: TracedGraph, blocks: Mapping[str, TracedGraph], head: TracedGraph,
            layer_weights: list[Mapping[str, Recipe]]) -> tuple[Any, WeightBook]:
    """The graph of `spec.stack` from its traced pieces (`layer_weights[i]`: layer i's recipes by the names its
    block's tensors are traced under): a ModelProto with virtual weights, and their recipes."""
    import onnx

    stack = spec.stack
    graph = onnx.GraphProto(name=spec.name)
    book = WeightBook()
    carried = {name: name for name in spec.inputs}  # the graph's inputs, read by any piece under their names
    inputs: dict[str, Any] = {}  # each graph input's type, as a piece that reads it declares it
    outputs: dict[str, Any] = {}

    def add(traced: TracedGraph, prefix: str, fixed: Mapping[str, str], layer: Mapping[str, Recipe] | None,
            where: str) -> Any:
        piece = traced.proto().graph
        bound = {}
        for value in piece.input:
            name = fixed.get(value.name) or carried.get(value.name)
            if name is None:
                raise WeightError(f"{where} reads {value.name!r}, which nothing before it makes")
            bound[value.name] = name
            if name in spec.inputs:
                inputs.setdefault(name, value)
        bound.update({out.name: fixed[out.name] for out in piece.output if out.name in fixed})
        _add_piece(graph, book, traced, prefix, bound, layer)
        for out in piece.output:
            if out.name in fixed:
                outputs[fixed[out.name]] = out
            else:
                carried[stack.carry.get(out.name, out.name)] = prefix + out.name

    add(front, "front/", {}, None, "the front")
    for index, layer in enumerate(stack.layers):
        add(blocks[layer.block], f"layers.{index}/", {**layer.inputs, **layer.outputs}, layer_weights[index],
            f"layer {index}'s block")
    head_outputs = [out.name for out in head.proto().graph.output]
    add(head, "head/", {name: name for name in head_outputs}, None, "the head")

    for name in spec.inputs:
        if name not in inputs:
            raise WeightError(f"graph {spec.name}: no piece reads its input {name!r}")
        value = onnx.ValueInfoProto()
        value.CopyFrom(inputs[name])
        value.name = name
        _dims(value, spec.axes.get(name, {}))
        graph.input.append(value)
    for name in spec.outputs:
        value = onnx.ValueInfoProto()
        value.CopyFrom(outputs[name])
        value.name = name
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param:  # a piece's own symbol: unknown here, as dims named apart in two pieces may differ
                dim.ClearField("dim_param")
        graph.output.append(value)
    first = front.proto()
    model = onnx.helper.make_model(graph, opset_imports=list(first.opset_import), producer_name=first.producer_name)
    model.ir_version = first.ir_version
    return model, book

