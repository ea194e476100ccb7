"""An exported fp32 graph rewritten in half precision (fp16) for the CUDA provider, at one of two precisions
(docs/decisions/cuda-form-ladder.md):

- `FLOAT16`: every node in fp16 except what fp16 would spoil: the Gated DeltaNet decay (Softplus, Exp, CumSum) and
  its recurrence (the Scan loop and the state it carries).
- `FLOAT16_MIXED`: torch's autocast, node by node: the matrix products (and the embedding lookup and short
  convolution) in fp16, and the elementwise and layout ops that follow them in fp16 while every float they read is
  fp16 (autocast's type promotion): an MLP's gate and product stay fp16, while the residual stream, the norms and
  their weights, softmax and whatever reads an fp32 value stay fp32.
- `FLOAT16_MATMULS`: only the matrix products (and the embedding table's lookup) in fp16; norms, softmax, the
  residual stream and every other elementwise op stay fp32.
- `FLOAT32_FP16_WEIGHTS`: every node in fp32; only the products' weights (and the embedding table) are stored in
  fp16, each cast to fp32 as a run reaches it (`cast_weights_per_run`): half the memory of fp32 weights, and exact
  for a bf16 checkpoint (fp16 holds every bf16 value in its normal range).

At every precision the graph's inputs and outputs stay fp32 (the runtime and the state it carries), and so do the
readout (d3's code logits, d1's LM head and log-softmax: every node from a declared output back to the first
MatMul, so the logits the read compares are never rounded to 10 bits) and the rotary angles (position times
frequency: fp16 keeps 11 bits, half a radian at position 1000, before its cosine and sine).

onnxruntime's own float16 converter does the rewrite (it inserts the casts at every fp32/fp16 border); this module
says what to keep and removes the round trips the converter leaves between kept nodes.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from ..runtime.artifact import WEIGHTS_CAST_PER_RUN

# Kept fp32 wherever they appear: the decay's and the recurrence's ops, and what the converter itself keeps.
# GatedDeltaNet (the fused form's delta rule) is written with its own casts: fp16 query/key/value, fp32 decay, beta
# and state.
FP32_OPS = ("Scan", "Loop", "If", "Softplus", "Exp", "CumSum", "Range", "Trilu", "GatedDeltaNet")


@dataclass(frozen=True)
class Precision:
    """Which nodes a half-precision form runs in fp16: every node but `FP32_OPS` (and the converter's own list),
    or, with `half_ops`, nodes of those types (a Gather only when it reads a weight: the embedding table) and nodes
    of `follow_ops` whose float inputs are all fp16 (a scalar constant aside)."""

    name: str
    half_ops: frozenset[str] | None = None
    follow_ops: frozenset[str] = frozenset()
    weights_only: bool = False  # fp32 nodes, fp16 weights at rest (`cast_weights_per_run`)

    def half_nodes(self, graph, blocked_ops: Collection[str]) -> set[str]:
        """Names of the nodes of `graph` (topologically ordered, as ONNX requires) this precision runs in fp16."""
        import onnx

        float32, float16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
        weights = {t.name: t for t in graph.initializer if t.data_type == float32}
        if self.half_ops is None:
            return {node.name for node in graph.node if node.op_type not in blocked_ops}
        values = [*graph.input, *graph.value_info, *graph.output]
        floats = {v.name for v in values if v.type.tensor_type.elem_type == float32}
        typed = {v.name for v in values}
        scalars = {name for name, t in weights.items() if int(np.prod(t.dims)) <= 1}
        floats |= set(weights) - scalars
        half: set[str] = set()
        # fp16 already in the exported graph: the fused ops' fp16 operands and results.
        half_values = {v.name for v in values if v.type.tensor_type.elem_type == float16}
        for node in graph.node:
            if node.op_type == "Gather":
                halved = "Gather" in self.half_ops and node.input[0] in weights
            elif node.op_type == "Cast":
                # A cast of an fp16 value to fp16 (a fused op's input) runs as fp16 -> fp16, and so, where casts
                # follow (autocast), does one back to fp32 after a fused op: no round trip where fp16 is next.
                halved = node.input[0] in half_values and (_is_cast(node, float16) or "Cast" in self.follow_ops)
            elif node.op_type in self.half_ops:
                halved = True
            elif node.op_type in self.follow_ops:
                read = [name for name in node.input if name in floats or name in half_values]
                halved = bool(read) and all(name in half_values for name in read)
            else:
                halved = False
            if halved:
                half.add(node.name)
                # A fused op's second output may be untyped in the export (CausalConvWithState's present state):
                # it is the op's T, so fp16 too, and what reads it follows.
                half_values.update(name for name in node.output if name in floats or (name and name not in typed))
            if _is_cast(node, float16) or (node.op_type in _RESULT_TYPED_BY_QUERY and node.input[0] in half_values):
                half_values.add(node.output[0])  # fp16 whatever the converter does (the export may not type it)
        return half


# Kept-fp32 ops whose result has their first input's type (GatedDeltaNet: its output is T, the query's).
_RESULT_TYPED_BY_QUERY = frozenset({"GatedDeltaNet"})
FLOAT16 = Precision("float16")
# Elementwise and layout ops autocast leaves in the dtype of their inputs (its fp32 list: pow, the reductions,
# softmax, exp and the like, is not here).
_FOLLOWERS = frozenset({"Add", "Sub", "Mul", "Div", "Neg", "Sigmoid", "Tanh", "Relu", "Where", "Identity", "Reshape",
                        "Transpose", "Split", "Slice", "Concat", "Squeeze", "Unsqueeze", "Expand", "Flatten", "Cast"})
# The fused ops with fp16 kernels that compute in fp32 inside (their input and output rounding is the products'):
# the short convolution, and the gated norm between the delta rule's fp16 output and the out projection.
FLOAT16_MIXED = Precision("float16-mixed", frozenset({"MatMul", "Gemm", "Gather", "CausalConvWithState",
                                                      "GatedRMSNorm"}), _FOLLOWERS)
FLOAT16_MATMULS = Precision("float16-matmuls", frozenset({"MatMul", "Gemm", "Gather"}))
FLOAT32_FP16_WEIGHTS = Precision(WEIGHTS_CAST_PER_RUN, weights_only=True)


def rotary_angles(graph) -> set[str]:
    """Names of the graph's Cos and Sin nodes and of the nodes that compute their arguments (the rotary angles),
    back to the graph's inputs."""
    producer = {out: node for node in graph.node for out in node.output}
    trig = [node for node in graph.node if node.op_type in ("Cos", "Sin")]
    stack = [name for node in trig for name in node.input]
    found = {node.name for node in trig}
    while stack:
        node = producer.get(stack.pop())
        if node is not None and node.name not in found:
            found.add(node.name)
            stack.extend(name for name in node.input if name)
    return found


def recurrent_state_paths(graph) -> set[str]:
    """Names of the nodes that carry a GatedDeltaNet node's state between the graph's inputs and outputs (a causal
    d3 graph's past_recurrent_i in, broadcast to the rows, and new_recurrent_i out): the state is fp32 by the op's
    contract, and an fp16 round trip on its way in or out would round what the prefix left for its suffixes."""
    producer = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    found: set[str] = set()
    rules = [node for node in graph.node if node.op_type == "GatedDeltaNet"]
    stack = [node.input[6] for node in rules if len(node.input) > 6]  # initial_state, back to the inputs
    while stack:
        node = producer.get(stack.pop())
        if node is not None and node.name not in found:
            found.add(node.name)
            if node.op_type not in ("Shape", "ConstantOfShape"):  # a shape's source is not the state's
                stack.append(node.input[0])  # the data; an Expand's or Reshape's second input is a shape
    stack = [node.output[1] for node in rules if len(node.output) > 1 and node.output[1]]  # final_state, onwards
    while stack:
        for node in consumers.get(stack.pop(), []):
            if node.name not in found:
                found.add(node.name)
                stack.extend(node.output)
    return found


def readout_tail(graph, outputs: Iterable[str]) -> set[str]:
    """Names of the nodes between each of `outputs` and the MatMul/Gemm that produces it (that MatMul included)."""
    producer = {out: node for node in graph.node for out in node.output}
    keep: set[str] = set()
    for output in outputs:
        stack, seen = [output], set()
        while stack:
            node = producer.get(stack.pop())
            if node is None or node.name in seen:
                continue
            seen.add(node.name)
            keep.add(node.name)
            if node.op_type not in ("MatMul", "Gemm"):
                stack.extend(name for name in node.input if name)
    return keep


def _is_cast(node, to: int) -> bool:
    return node.op_type == "Cast" and any(a.name == "to" and a.i == to for a in node.attribute)


def join_fp32_islands(graph, kept: set[str], fp32_weights: dict[str, object]) -> None:
    """The converter rounds every value that enters or leaves a kept node to fp16, even between two kept nodes and
    on kept weights. Undo that where the value was fp32: a Cast fp32->fp16->fp32 pair between kept nodes (or a
    kept node and a graph output) becomes an Identity of the fp32 value, and a kept weight is read in fp32."""
    import onnx

    float32, float16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
    producer = {out: node for node in graph.node for out in node.output}
    float_inputs = {v.name for v in graph.input if v.type.tensor_type.elem_type == float32}
    restored: set[str] = set()
    for index, node in enumerate(graph.node):
        if not _is_cast(node, float32):
            continue
        source = node.input[0]
        if source in fp32_weights:
            weight = fp32_weights[source]
            if source not in restored:  # once, however many casts read it
                graph.initializer.append(weight)
                restored.add(source)
            graph.node[index].CopyFrom(onnx.helper.make_node("Identity", [weight.name], list(node.output), node.name))
            continue
        first = producer.get(source)
        if first is None or not _is_cast(first, float16):
            continue
        origin = producer.get(first.input[0])
        if first.input[0] in float_inputs or (origin is not None and origin.name in kept):
            graph.node[index].CopyFrom(onnx.helper.make_node("Identity", [first.input[0]], list(node.output),
                                                             node.name))


def drop_dead_nodes(graph) -> None:
    """Remove nodes nothing reads (the fp16 halves of the round trips `join_fp32_islands` replaced), until none is
    left: onnxruntime would run them."""
    outputs = {v.name for v in graph.output}
    while True:
        read = outputs | {name for node in graph.node for name in node.input}
        dead = [node for node in graph.node if node.op_type == "Cast" and not any(o in read for o in node.output)]
        if not dead:
            return
        for node in dead:
            graph.node.remove(node)


def drop_twin_casts(graph) -> None:
    """The converter adds one cast per value_info entry, and an exported graph may list a value twice: the same
    Cast of the same value to the same name, twice, which onnxruntime refuses. Keep the first."""
    made: dict[str, tuple] = {}
    for node in list(graph.node):
        key = (node.op_type, tuple(node.input), tuple(a.SerializeToString() for a in node.attribute))
        if node.op_type == "Cast" and node.output[0] in made:
            if made[node.output[0]] != key:
                raise ValueError(f"two different casts write {node.output[0]!r}")
            graph.node.remove(node)
            continue
        for output in node.output:
            made[output] = key


def drop_unread_norm_statistics(graph) -> None:
    """A fused norm's mean and inverse deviation (optional outputs 1 and 2) lose their names where nothing reads
    them: the exporter names every output, and onnxruntime's CUDA kernel never writes these two."""
    read = {v.name for v in graph.output} | {name for node in graph.node for name in node.input}
    for node in graph.node:
        if node.op_type == "SkipSimplifiedLayerNormalization":
            for index in (1, 2):
                if index < len(node.output) and node.output[index] not in read:
                    node.output[index] = ""


@contextmanager
def _shapes_from_dims():
    """onnxruntime's converter reads an initializer's shape from its values (`numpy_helper.to_array`); a virtual
    weight has none yet, and its dims say the same."""
    import onnx
    from onnxruntime.transformers import float16

    original = float16.make_value_info_from_tensor
    float16.make_value_info_from_tensor = lambda tensor: onnx.helper.make_tensor_value_info(
        tensor.name, tensor.data_type, list(tensor.dims))
    try:
        yield
    finally:
        float16.make_value_info_from_tensor = original


def convert_to_half(model, fp32_outputs: Sequence[str], precision: Precision = FLOAT16):
    """`model` (an fp32 ModelProto, its weights virtual: export/weights.py) rewritten at `precision`: a new
    ModelProto whose virtual weights declare the dtype each is written in."""
    import onnx
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    model = onnx.ModelProto.FromString(model.SerializeToString())
    seen: set[str] = set()
    for node_index, node in enumerate(model.graph.node):
        # The block lists go by node name, and the converter names its casts and their values after the node.
        if not node.name or node.name in seen:
            node.name = f"{node.name or node.op_type}_{node_index}"
        seen.add(node.name)
    keep = readout_tail(model.graph, fp32_outputs)
    if precision.weights_only:
        cast_weights_per_run(model.graph, keep)
        return model
    blocked_ops = {*DEFAULT_OP_BLOCK_LIST, *FP32_OPS}
    weights = {t.name: t for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    halved = precision.half_nodes(model.graph, blocked_ops) - rotary_angles(model.graph)
    kept = (keep | recurrent_state_paths(model.graph)
            | {node.name for node in model.graph.node if node.name not in halved})
    fp32_weights = {}  # the readout's weights, as they were: the converter would store them in fp16
    for node in model.graph.node:
        for name in node.input if node.name in keep else ():
            if name in weights and name not in fp32_weights:
                fp32_weights[name] = onnx.TensorProto()
                fp32_weights[name].CopyFrom(weights[name])
                fp32_weights[name].name = f"{name}_fp32"
    with _shapes_from_dims():
        half = convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=True,
                                        op_block_list=sorted(blocked_ops), node_block_list=sorted(kept))
    drop_twin_casts(half.graph)
    join_fp32_islands(half.graph, kept, fp32_weights)
    drop_dead_nodes(half.graph)
    drop_unread_norm_statistics(half.graph)

    used = {name for node in half.graph.node for name in node.input}
    unused = [t for t in half.graph.initializer if t.name not in used]  # fp16 copies of restored weights
    for tensor in unused:
        half.graph.initializer.remove(tensor)
    return half


# The ops whose weight operand is stored in fp16 at `FLOAT32_FP16_WEIGHTS`: a product's, or the embedding table's.
_WEIGHT_READERS = {"MatMul": 1, "Gemm": 1, "Gather": 0}


def cast_weights_per_run(graph, kept: Collection[str]) -> None:
    """Store each product's weight (and the embedding table) in fp16 and cast it back to fp32 where it is read: a
    product's weight just before the product, a table after the rows are gathered (a whole table in fp32 would be
    gigabytes a run). Nodes in `kept` (the readout) keep their fp32 weights. Each weight halved is also declared a
    graph input (an overridable initializer, which onnxruntime never folds): folded, the casts would make every
    fp32 weight when the session opens, twice the memory. The graph stays topologically ordered."""
    import onnx
    import onnx.numpy_helper

    float32, float16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
    weights = {t.name: t for t in graph.initializer if t.data_type == float32 and int(np.prod(t.dims)) > 1}
    readers: dict[str, list[tuple[object, int | None]]] = {}  # weight -> (node, the input slot it is read at)
    for node in graph.node:
        slot = _WEIGHT_READERS.get(node.op_type)
        for index, name in enumerate(node.input):
            if name in weights:
                readers.setdefault(name, []).append((node, index if index == slot else None))
    in_subgraphs = {name for node in graph.node for sub in _subgraphs(node) for name in _names_read(sub)}
    # Halved where only products (or lookups) read it, at their weight slot, none of them kept fp32 (nor a loop body).
    halved = {name for name, read in readers.items() if name not in in_subgraphs
              and all(slot is not None and node.name not in kept for node, slot in read)}
    nodes = list(graph.node)
    del graph.node[:]
    cast_made: set[str] = set()
    for node in nodes:
        slot = _WEIGHT_READERS.get(node.op_type)
        name = node.input[slot] if slot is not None and len(node.input) > slot else ""
        if name not in halved:
            graph.node.append(node)
        elif node.op_type == "Gather":  # the rows in fp16, then cast
            rows = f"{node.output[0]}_fp16"
            gather = onnx.helper.make_node("Gather", [name, *node.input[1:]], [rows], f"{node.name}_fp16")
            gather.attribute.extend(node.attribute)
            graph.node.append(gather)
            graph.node.append(onnx.helper.make_node("Cast", [rows], list(node.output), node.name, to=float32))
        else:
            cast = f"{name}_fp32"
            if cast not in cast_made:
                graph.node.append(onnx.helper.make_node("Cast", [name], [cast], f"{name}_cast", to=float32))
                cast_made.add(cast)
            inputs = list(node.input)
            inputs[slot] = cast
            del node.input[:]
            node.input.extend(inputs)
            graph.node.append(node)
    for name in sorted(halved):
        tensor = weights[name]
        if tensor.data_location == onnx.TensorProto.EXTERNAL:  # virtual (export/weights.py): written in fp16
            tensor.data_type = float16
        else:
            half = onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(tensor).astype(np.float16), name)
            tensor.CopyFrom(half)
        graph.input.append(onnx.helper.make_tensor_value_info(name, float16, list(weights[name].dims)))


def _subgraphs(node) -> list:
    """The graphs `node` holds as attributes (a Scan's or Loop's body, an If's branches)."""
    import onnx

    return [sub for attribute in node.attribute
            for sub in ([attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else attribute.graphs)]


def _names_read(graph) -> set[str]:
    """Every value name the nodes of `graph` and of its subgraphs read."""
    names = set()
    for node in graph.node:
        names.update(node.input)
        for sub in _subgraphs(node):
            names |= _names_read(sub)
    return names
