"""One graph spec -> one weightless ONNX graph and the recipes of its weights (export/weights.py), through torch.onnx's
dynamo exporter on a module whose parameters are on the meta device; `GraphExports` runs several at once.

The exporter's optimizer would fold each weight's transposes and slices into a new weight, which needs the values.
Here those nodes are folded into recipes instead (`fold_weight_nodes`: the values are made when the graph is
written), and the optimizer runs after, with nothing of the weights left to fold."""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .config import ExportConfig, GraphSpec
from .weights import (VIRTUAL, CheckpointTensors, Constant, Derived, Recipe, TracedGraph, WeightBook, WeightError,
                      virtual_tensor)

OPSET = 18

# The rewrite rules of onnxscript's optimizer that export leaves out. SlicesSplit (two Slices of one tensor -> one
# Split) is the only default rule whose pattern ends in two nodes; its matcher walks the whole graph once for every
# Slice it tries, so its cost grows with the square of the graph, and it rewrites none of this project's graphs
# (docs/decisions/export-optimizer-rules.md).
SKIPPED_RULES = frozenset({"SlicesSplit"})
# Nodes never folded into a weight recipe: control flow and anything random.
_NOT_FOLDED = frozenset({"Scan", "Loop", "If", "RandomNormal", "RandomUniform", "RandomNormalLike",
                         "RandomUniformLike", "Multinomial", "Bernoulli"})


@contextmanager
def _rewrite_rules_without(names: Collection[str]) -> Iterator[None]:
    """onnxscript's optimizer runs its default rewrite rules but those named, inside the block. The optimizer reads
    its rule list from its module when it runs, and offers no other way to choose them."""
    import onnxscript.rewriter as rewriter

    rules = getattr(rewriter, "_DEFAULT_REWRITE_RULES", None)
    if not names or rules is None:  # an onnxscript without that list: its optimizer as it is
        yield
        return
    rewriter._DEFAULT_REWRITE_RULES = tuple(rule for rule in rules if rule.name not in names)
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = rules


_TORCHLIB_REGISTRIES: dict[str, Any] = {}


@contextmanager
def _torchlib_registry_built_once() -> Iterator[None]:
    """Inside the block, torch.onnx.export's registry of torchlib functions is built once per opset and copied for
    each call: the exporter builds it anew in every call (every function's source parsed again, about 1.3 s on one
    core), and a d3 export makes 14 calls. A copy's lists are its own, so the translations one call registers stay
    out of the next. A torch without that classmethod: its exporter as it is."""
    try:
        from torch.onnx._internal.exporter import _registration
    except ImportError:
        yield
        return
    registry_class = _registration.ONNXRegistry
    built = registry_class.__dict__.get("from_torchlib")
    if not isinstance(built, classmethod):
        yield
        return

    def from_torchlib(cls, *args: Any, **named: Any) -> Any:
        key = repr((cls, args, sorted(named.items())))
        if key not in _TORCHLIB_REGISTRIES:
            _TORCHLIB_REGISTRIES[key] = built.__func__(cls, *args, **named)
        copy = object.__new__(cls)
        copy.__dict__.update(_TORCHLIB_REGISTRIES[key].__dict__)
        copy.functions = {target: list(metas) for target, metas in copy.functions.items()}
        return copy

    registry_class.from_torchlib = classmethod(from_torchlib)
    try:
        yield
    finally:
        registry_class.from_torchlib = built


# A virtual weight this small may be read while the graph is traced (the optimizer reads small constants, and its
# rewrite rules a bias vector: d3-nano's vision attention reads its 3,072); a larger one read there is a fault of
# the tracer, which would hold the model after all.
READABLE_WHILE_TRACED = 1 << 16


def _virtual_class():
    import onnx_ir as ir

    class VirtualWeight(ir.ExternalTensor):
        """A weight with a recipe, whose values are made only when a small one is read."""

        def __init__(self, recipe: str, dtype: Any, shape: Any, name: str, make: Any):
            super().__init__(VIRTUAL, 0, 0, dtype, shape=shape, name=name)
            self.recipe, self._make = recipe, make

        def numpy(self):
            if self.size > READABLE_WHILE_TRACED:
                raise WeightError(f"the weight {self.name!r} ({self.size} values) was read while the graph was traced")
            return self._make(self.recipe).astype(self.dtype.numpy())

        def tobytes(self) -> bytes:
            return self.numpy().tobytes()

    return VirtualWeight


def _is_virtual(value) -> bool:
    return value is not None and getattr(value.const_value, "recipe", None) is not None


def _constant_value(value):
    """The numpy value of a constant input (initializer or Constant node output), or None if it is not one."""
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and producer.domain in ("", "ai.onnx"):
        attribute = producer.attributes.get("value")
        return None if attribute is None else attribute.value
    return None


def _infer_outputs(node, inputs: list, constants: list) -> bool:
    """Give `node`'s outputs the static shapes and dtypes onnx's shape inference finds from its inputs' (the
    exporter leaves a weight's transpose untyped); whether every output has them now."""
    import onnx
    import onnx_ir as ir

    names = [f"in{i}" for i in range(len(inputs))]
    proto = ir.serde.serialize_node(node)
    proto.input[:] = [name if value is not None else "" for name, value in zip(names, inputs)]
    types, data = {}, {}
    for name, value, constant in zip(names, inputs, constants):
        if value is None or constant is None:
            continue
        dims = [int(d) for d in constant.shape.numpy()]
        types[name] = onnx.helper.make_tensor_type_proto(constant.dtype.value, dims)
        if constant.size <= READABLE_WHILE_TRACED and not _is_virtual(value):
            data[name] = ir.serde.serialize_tensor(constant)
            data[name].name = name
    try:
        schema = onnx.defs.get_schema(node.op_type, OPSET, node.domain)
        found = onnx.shape_inference.infer_node_outputs(schema, proto, types, data)
    except Exception:  # noqa: BLE001 - an op inference cannot type is left to run as it is
        return False
    for out, name in zip(node.outputs, proto.output):
        tensor = found.get(name)
        if tensor is None or not tensor.tensor_type.HasField("shape") or \
                any(not d.HasField("dim_value") for d in tensor.tensor_type.shape.dim):
            return False
        out.shape = ir.Shape([d.dim_value for d in tensor.tensor_type.shape.dim])
        out.dtype = ir.DataType(tensor.tensor_type.elem_type)
    return True


def fold_weight_nodes(model, book: WeightBook, make: Any) -> int:
    """Each node that reads only constants, a virtual weight among them, becomes virtual weights of its own (a
    `Derived` recipe a output), in graph order so that a chain folds whole. Returns how many nodes were folded."""
    import onnx_ir as ir

    virtual = _virtual_class()
    graph = model.graph
    folded = 0
    for node in list(graph):
        if node.op_type in _NOT_FOLDED or node.domain not in ("", "ai.onnx"):
            continue
        inputs = list(node.inputs)
        if not any(_is_virtual(value) for value in inputs):
            continue
        constants = [_constant_value(value) for value in inputs]
        if any(value is not None and constant is None for value, constant in zip(inputs, constants)):
            continue
        if not all(out.shape is not None and out.shape.is_static() and out.dtype is not None for out in node.outputs):
            if not _infer_outputs(node, inputs, constants):
                continue
        names = []
        for index, (value, constant) in enumerate(zip(inputs, constants)):
            if value is None:
                names.append("")
            elif _is_virtual(value):
                names.append(value.const_value.recipe)
            else:
                name = f"{node.name or node.op_type}/input{index}"
                book.add(name, Constant(constant.numpy()))
                names.append(name)
        node_bytes = ir.serde.serialize_node(node).SerializeToString()
        for index, out in enumerate(node.outputs):
            recipe = f"{out.name}"
            book.add(recipe, Derived(node_bytes, tuple(names), index))
            weight = ir.Value(name=out.name, shape=ir.Shape(out.shape.numpy()), type=ir.TensorType(out.dtype),
                              const_value=virtual(recipe, out.dtype, ir.Shape(out.shape.numpy()), out.name, make))
            out.name = f"{out.name}__folded"
            graph.register_initializer(weight)
            ir.convenience.replace_all_uses_with(out, weight)
        graph.remove(node, safe=True)
        folded += 1
    return folded


def trace_graph(spec: GraphSpec, tensors: CheckpointTensors,
                skipped_rules: Collection[str] = SKIPPED_RULES) -> TracedGraph:
    """`spec` exported on the meta device: the graph with virtual weights and their recipes (`tensors`: the
    checkpoint's, for the few small weights tracing reads). `skipped_rules`: the optimizer's rewrite rules left out
    (the full set with none)."""
    import onnx_ir as ir
    import onnxscript.optimizer
    import torch

    if spec.stack is not None:
        return _trace_stack(spec, tensors, skipped_rules)
    import copy

    built = spec.module()
    recipes: Mapping[str, Recipe] = spec.weights(built)
    # Traced on a copy with every tensor on meta: the buffers made at construction (rotary frequencies) have their
    # recipes now, and the skeleton the module shares stays as it is for the next graph.
    module = copy.deepcopy(built).to("meta")
    inputs = torch.utils._pytree.tree_map(
        lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, spec.example_inputs())
    with torch.no_grad(), _torchlib_registry_built_once():
        program = torch.onnx.export(module, inputs, dynamo=True, optimize=False, opset_version=OPSET,
                                    input_names=spec.inputs, output_names=spec.outputs,
                                    dynamic_shapes=spec.dynamic_shapes, custom_translation_table=spec.translations,
                                    verbose=False)
    model = program.model
    book = WeightBook()
    virtual = _virtual_class()

    def make(recipe: str):
        return book.values(recipe, tensors)

    for name, value in list(model.graph.initializers.items()):
        recipe = recipes.get(name)
        if recipe is None:
            raise WeightError(f"graph {spec.name}: the weight {name!r} has no recipe (not a parameter or buffer of "
                              "the traced module)")
        if isinstance(recipe, Constant):  # made at trace time: real values in the graph
            value.const_value = ir.tensor(recipe.value.astype(value.dtype.numpy()), name=name)
            continue
        book.add(name, recipe)
        value.const_value = virtual(name, value.dtype, value.shape, name, make)
    # Folded, optimized, folded again where the optimizer made a weight's other inputs constants (a slice's
    # bounds computed from static shapes), until nothing of the weights is left to fold.
    fold_weight_nodes(model, book, make)
    while True:
        with _rewrite_rules_without(skipped_rules):
            onnxscript.optimizer.optimize_ir(
                model, should_fold=lambda node: False if any(_is_virtual(v) for v in node.inputs) else None)
        if not fold_weight_nodes(model, book, make):
            break
    recipes_by_name = {}
    for name, value in model.graph.initializers.items():
        if _is_virtual(value):
            recipes_by_name[name] = value.const_value.recipe
    proto = ir.serde.serialize_model(model)
    for index, tensor in enumerate(proto.graph.initializer):
        if tensor.name in recipes_by_name:
            proto.graph.initializer[index].CopyFrom(virtual_tensor(tensor.name, tensor.data_type, tuple(tensor.dims),
                                                                   recipes_by_name[tensor.name]))
    used = WeightBook()
    for recipe in recipes_by_name.values():
        _copy_recipe(book, used, recipe)
    return TracedGraph(proto.SerializeToString(), used)


def _trace_stack(spec: GraphSpec, tensors: CheckpointTensors, skipped_rules: Collection[str]) -> TracedGraph:
    """`spec.stack`'s pieces traced once each (a block per kind of layer), then composed a layer at a time."""
    from .stack import compose

    stack = spec.stack
    front, head = (trace_graph(piece, tensors, skipped_rules) for piece in (stack.front, stack.head))
    blocks = {kind: trace_graph(piece, tensors, skipped_rules) for kind, piece in stack.blocks.items()}
    layers = [stack.blocks[layer.block].weights(layer.module()) for layer in stack.layers]
    model, book = compose(spec, front, blocks, head, layers)
    return TracedGraph(model.SerializeToString(), book)


def _copy_recipe(source: WeightBook, target: WeightBook, name: str) -> None:
    """`name`'s recipe and those it reads, from `source` into `target`."""
    stack = [name]
    while stack:
        current = stack.pop()
        if current in target.recipes:
            continue
        recipe = source.recipes[current]
        target.add(current, recipe)
        if isinstance(recipe, Derived):
            stack.extend(name for name in recipe.inputs if name)


# Which graph of a checkpoint's export config a spec is, by name, so that a worker process can build it again:
# ("portable", graph), or ("fused", graph) for the graph the fused forms write with onnxruntime's fused ops.
SpecKey = tuple[str, ...]


def spec_of(config: ExportConfig, key: SpecKey) -> GraphSpec:
    """The spec `key` names in `config`."""
    return next(spec for spec in config.graphs(fused=key[0] == "fused") if spec.name == key[1])


def _trace_in_worker(config_class: type, checkpoint: str, key: SpecKey, seed: int) -> TracedGraph:
    import torch

    torch.manual_seed(seed)
    config = config_class(Path(checkpoint))
    return trace_graph(spec_of(config, key), config.skeleton.tensors)


class GraphExports:
    """A checkpoint's graph traces: one after another in this process, when each is waited for (`jobs` = 1); or,
    with `jobs` > 1, all those started at once in that many worker processes, each of which builds the checkpoint's
    export config again (a spec holds torch modules, which do not travel between processes). A trace is one core of
    Python for a minute or more, and holds no weights, so on a host with cores to spare the graphs take about the
    time of the longest."""

    def __init__(self, config_class: type, checkpoint: Path, jobs: int = 1, seed: int = 0):
        self.config_class, self.checkpoint, self.seed = config_class, checkpoint, seed
        self.tensors = CheckpointTensors(checkpoint)
        self.pool = None
        if jobs > 1:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            # Spawned, not forked: this process's torch and OpenMP threads do not survive a fork.
            self.pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))
        self.started: dict[SpecKey, Any] = {}
        self.done: dict[SpecKey, TracedGraph] = {}

    def start(self, key: SpecKey) -> None:
        """Begin tracing `key` now, where workers run; otherwise `wait` traces it."""
        if self.pool is not None and key not in self.started and key not in self.done:
            self.started[key] = self.pool.submit(_trace_in_worker, self.config_class, str(self.checkpoint), key,
                                                 self.seed)

    def wait(self, key: SpecKey, spec: GraphSpec) -> TracedGraph:
        """`spec` (named `key`) traced: by the worker `start` gave it, or here and now; once however often asked."""
        if key not in self.done:
            started = self.started.pop(key, None)
            self.done[key] = trace_graph(spec, self.tensors) if started is None else started.result()
        return self.done[key]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> GraphExports:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
