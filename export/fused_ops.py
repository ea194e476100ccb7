"""onnxruntime's fused contrib ops that more than one family's CUDA form writes (docs/gpu.md, "The fused form"), and
the way every family's fused ops are declared.

Each fused op is a torch custom op (`systemone::...`) whose eager body is the portable graph's computation, and a
translation maps it to its `com.microsoft` node when `torch.onnx.export` writes the graph. onnx has no schema for
onnxruntime's contrib ops, so each node carries the part of the op's schema the graph uses (`contrib_op`: the
exporter places inputs and attributes by it). The nodes here, and the sums they compute:

- `MultiHeadAttention` (no mask): out = softmax(scale q k^T) v per head over each row of a batch: a vision tower's
  attention over an image's patches (d1: one row a crop; d3: one a segment), which never materialises the n x n
  fp32 scores the portable graph writes.
- `FastGelu`: y = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), the tanh GELU of the vision towers' MLPs, one
  kernel in place of the eight elementwise nodes its export writes (each a pass over n x intermediate fp32 values).

`translations(half_io)` writes them for a form: with `half_io` (the CUDA form) the attention node reads fp16 query,
key and value and its result is cast back to fp32, since onnxruntime's CUDA flash and memory-efficient kernels run
only in half precision (accumulating in fp32); without it (the CPU's form) every node reads and writes fp32.
"""

import onnx
import onnxscript
import torch
import torch.nn.functional as F
from onnxscript import FLOAT, FLOAT16
from onnxscript import opset18 as op

_Param, _Option = onnx.defs.OpSchema.FormalParameter, onnx.defs.OpSchema.FormalParameterOption
_Attr, _AttrType = onnx.defs.OpSchema.Attribute, onnx.defs.OpSchema.AttrType
_MICROSOFT = onnxscript.values.Opset("com.microsoft", 1)
HALF_OR_FLOAT = ["tensor(float16)", "tensor(float)"]


def contrib_op(name: str, inputs: list, outputs: list, types: list, attributes: dict[str, _AttrType]
               ) -> onnxscript.values.Op:
    """onnxruntime's `com.microsoft` op `name` with the inputs, outputs, type constraints and attributes given."""
    schema = onnx.defs.OpSchema(name, "com.microsoft", 1, inputs=inputs, outputs=outputs, type_constraints=types,
                                attributes=[_Attr(attr, kind, "") for attr, kind in attributes.items()])
    return onnxscript.values.Op(_MICROSOFT, name, schema)


MULTI_HEAD_ATTENTION = contrib_op("MultiHeadAttention",
                                  [_Param("query", "T"), _Param("key", "T"), _Param("value", "T"),
                                   _Param("bias", "T", param_option=_Option.Optional),
                                   _Param("key_padding_mask", "M", param_option=_Option.Optional)],
                                  [_Param("output", "T")], [("T", HALF_OR_FLOAT, ""), ("M", ["tensor(int32)"], "")],
                                  {"num_heads": _AttrType.INT, "scale": _AttrType.FLOAT,
                                   "unidirectional": _AttrType.INT})
FAST_GELU = contrib_op("FastGelu", [_Param("X", "T")], [_Param("Y", "T")], [("T", HALF_OR_FLOAT, "")], {})


def attention_node(query: FLOAT, key: FLOAT, value: FLOAT, heads: int, scale: float, half_io: bool) -> FLOAT:
    """query, key, value [B, L, H * D] fp32 -> the unmasked attention of each row, [B, L, H * D] fp32, as one
    MultiHeadAttention node; where `half_io` it reads fp16 (the node is all the fp16 there is)."""
    if not half_io:
        return MULTI_HEAD_ATTENTION(query, key, value, num_heads=heads, scale=scale)
    q, k, v = (op.Cast(x, to=FLOAT16.dtype) for x in (query, key, value))
    return op.Cast(MULTI_HEAD_ATTENTION(q, k, v, num_heads=heads, scale=scale), to=FLOAT.dtype)


# -- attention over each row of a batch ------------------------------------------------------------------------------
@torch.library.custom_op("systemone::batch_attention", mutates_args=())
def batch_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, heads: int, scale: float
                    ) -> torch.Tensor:
    """query, key, value [B, L, H * D] fp32 (H = `heads`, an attribute of the node): each row attends to itself,
    no mask -> [B, L, H * D]."""
    batch, length, _ = query.shape
    q, k, v = (x.reshape(batch, length, heads, -1).transpose(1, 2) for x in (query, key, value))  # [B, H, L, D]
    probs = torch.softmax((q @ k.transpose(-1, -2)) * scale, dim=-1, dtype=torch.float32)
    return (probs @ v).transpose(1, 2).reshape(query.shape).contiguous()


@batch_attention.register_fake
def _(query, key, value, heads, scale):
    return query.new_empty(query.shape)


# -- the vision MLPs' activation ------------------------------------------------------------------------------------
@torch.library.custom_op("systemone::gelu_tanh", mutates_args=())
def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation (transformers' `gelu_pytorch_tanh`), elementwise."""
    return F.gelu(x, approximate="tanh")


@gelu_tanh.register_fake
def _(x):
    return x.new_empty(x.shape)


def _fast_gelu(x: FLOAT) -> FLOAT:
    return FAST_GELU(x)


def translations(half_io: bool) -> dict:
    """The shared ops' translations, the attention node reading fp16 where `half_io` (the CUDA form)."""
    def batch_attention_node(query: FLOAT, key: FLOAT, value: FLOAT, heads: int, scale: float) -> FLOAT:
        return attention_node(query, key, value, heads, scale, half_io)

    return {torch.ops.systemone.batch_attention.default: batch_attention_node,
            torch.ops.systemone.gelu_tanh.default: _fast_gelu}


TRANSLATIONS = translations(half_io=True)  # the CUDA form's
CPU_TRANSLATIONS = translations(half_io=False)  # the CPU form's: every node fp32
