"""An exported fp32 graph rewritten in half precision (fp16) for the CUDA provider, keeping in fp32 what fp16
would spoil (docs/gpu.md, "The CUDA form"):

- the graph's inputs and outputs (the runtime and the state it carries stay fp32);
- the Gated DeltaNet decay (Softplus, Exp, CumSum) and its recurrence (the Scan loop and the state it carries);
- the readout (d3's code logits, d1's LM head and log-softmax): every node from a declared output back to the
  first MatMul, so the logits the read compares are never rounded to 10 bits.

onnxruntime's own float16 converter does the rewrite (it inserts the casts at every fp32/fp16 border); this module
only says what to keep.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

# Kept fp32 wherever they appear: the decay's and the recurrence's ops, and what the converter itself keeps.
FP32_OPS = ("Scan", "Loop", "If", "Softplus", "Exp", "CumSum", "Range", "Trilu")


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


def convert_to_half(source: Path, target: Path, fp32_outputs: Sequence[str]) -> None:
    """Write `source` (an fp32 ONNX graph) as an fp16 graph at `target`, its weights beside it in
    `target.name + '.data'`."""
    import onnx
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    model = onnx.load(str(source))
    for node_index, node in enumerate(model.graph.node):
        if not node.name:  # the block lists go by node name
            node.name = f"{node.op_type}_{node_index}"
    keep = readout_tail(model.graph, fp32_outputs)
    blocked_ops = {*DEFAULT_OP_BLOCK_LIST, *FP32_OPS}
    kept = keep | {node.name for node in model.graph.node if node.op_type in blocked_ops}
    weights = {t.name: t for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    fp32_weights = {}  # the readout's weights, as they were: the converter would store them in fp16
    for node in model.graph.node:
        for name in node.input if node.name in keep else ():
            if name in weights and name not in fp32_weights:
                fp32_weights[name] = onnx.TensorProto()
                fp32_weights[name].CopyFrom(weights[name])
                fp32_weights[name].name = f"{name}_fp32"
    half = convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=True,
                                    op_block_list=sorted(blocked_ops), node_block_list=sorted(keep))
    join_fp32_islands(half.graph, kept, fp32_weights)
    used = {name for node in half.graph.node for name in node.input}
    unused = [t for t in half.graph.initializer if t.name not in used]  # fp16 copies of restored weights
    for tensor in unused:
        half.graph.initializer.remove(tensor)
    onnx.save(half, str(target), save_as_external_data=True, all_tensors_to_one_file=True,
              location=target.name + ".data")
