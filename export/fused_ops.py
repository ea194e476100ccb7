"""onnxruntime's fused contrib ops that more than one family's CUDA form writes (docs/decisions/fused-ops.md), and
the way every family's fused ops are declared.

Each fused op is a torch custom op (`systemone::...`) whose eager body is the portable graph's computation, and a
translation maps it to its `com.microsoft` node when `torch.onnx.export` writes the graph. onnx has no schema for
onnxruntime's contrib ops, so each node carries the part of the op's schema the graph uses (`contrib_op`: the
exporter places inputs and attributes by it). The nodes here, and the sums they compute:

- `MultiHeadAttention` (no mask): out = softmax(scale q k^T) v per head over each row of a batch, read in fp16 (on
  CUDA its flash and memory-efficient kernels run in half precision and accumulate in fp32) and returned in fp32:
  a vision tower's attention over an image's patches (d1: one row a crop; d3: one a segment), which never
  materialises the n x n scores the portable graph writes in fp32. d3's bidirectional text graph writes its own
  (export/d3/fused_ops.py).
- `MultiHeadAttention` with past keys and values, for the causal text graphs' attention layers (d1's LFM2, d3's
  Qwen3.5 in causal mode): each query of a call reads the past's keys (the prefix's state, batch 1, the same for
  every row of the call) and its own row's keys up to itself, causal aligned to the end: query t of a call after P
  past tokens sees keys 0 .. P + t, which is what the node's `unidirectional` does once the past is its `past_key`
  input (its CUDA kernels, flash attention among them, and its CPU kernel alike; given as a longer `key` instead,
  the CPU kernel aligns it to the start). The node has no grouped-query attention, so the key heads are repeated for
  the query heads that share them (d1-3B: 8 for 32). Read in fp16, returned in fp32. The portable graph writes the B
  x heads x T x (P + T) scores in fp32, then concatenates, slices and casts them: 0.6 GB a layer at the 2,169-token
  prefix of a request with a 1024x1024 image.
- `SkipSimplifiedLayerNormalization`: the residual sum s = x + u and the RMS norm s / sqrt(mean(s^2) + eps) * w of
  it, both returned, in fp32: one kernel for each layer's sum and the next norm, where onnxruntime ran an Add and a
  norm that read the sum again (its own fusion passes a sum that anything else reads).
- `FastGelu`: y = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), the tanh GELU of the vision towers' MLPs, one
  kernel in place of the eight elementwise nodes its export writes (each a pass over n x intermediate fp32 values).
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
SKIP_RMS_NORM = contrib_op("SkipSimplifiedLayerNormalization",
                           [_Param("input", "T"), _Param("skip", "T"), _Param("gamma", "T")],
                           [_Param("output", "T"), _Param("mean", "U", param_option=_Option.Optional),
                            _Param("inv_std_var", "U", param_option=_Option.Optional),
                            _Param("input_skip_bias_sum", "T", param_option=_Option.Optional)],
                           [("T", HALF_OR_FLOAT, ""), ("U", ["tensor(float)"], "")], {"epsilon": _AttrType.FLOAT})
FAST_GELU = contrib_op("FastGelu", [_Param("X", "T")], [_Param("Y", "T")], [("T", HALF_OR_FLOAT, "")], {})


def half_attention(query: FLOAT, key: FLOAT, value: FLOAT, heads: int, scale: float) -> FLOAT:
    """query, key, value [B, L, H * D] fp32 -> the unmasked attention of each row, [B, L, H * D] fp32, computed by
    a MultiHeadAttention node in fp16: the node is all the fp16 there is."""
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


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x over the root of its mean square along the last axis: the RMS norm before its scale, as the portable graph
    computes it and the norms' eager bodies below do."""
    # Divided by the root rather than times its reciprocal: the pattern onnxruntime fuses into one
    # SimplifiedLayerNormalization kernel (fp32 accumulation, one launch instead of six).
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


# -- the residual sum and the norm after it ------------------------------------------------------------------------
@torch.library.custom_op("systemone::skip_rms_norm", mutates_args=())
def skip_rms_norm(x: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x, update [..., C], weight [C], fp32 -> (the RMS norm of x + update, scaled by weight; x + update)."""
    total = x + update
    return rms(total, eps) * weight, total


@skip_rms_norm.register_fake
def _(x, update, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape)


def _skip_rms_norm(x: FLOAT, update: FLOAT, weight: FLOAT, eps: float) -> tuple[FLOAT, FLOAT]:
    normed, _, _, total = SKIP_RMS_NORM(x, update, weight, epsilon=eps)
    return normed, total


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


# -- attention over a past (the causal text graphs' prefix reuse) ------------------------------------------------
_optional = [_Param(name, kind, param_option=_Option.Optional)
             for name, kind in (("bias", "T"), ("key_padding_mask", "M"), ("attention_bias", "T"), ("past_key", "T"),
                                ("past_value", "T"))]
MULTI_HEAD_ATTENTION_WITH_PAST = contrib_op(
    "MultiHeadAttention", [_Param("query", "T"), _Param("key", "T"), _Param("value", "T"), *_optional],
    [_Param("output", "T"), _Param("present_key", "T"), _Param("present_value", "T")],
    [("T", HALF_OR_FLOAT, ""), ("M", ["tensor(int32)"], "")],
    {"num_heads": _AttrType.INT, "scale": _AttrType.FLOAT, "unidirectional": _AttrType.INT})


@torch.library.custom_op("systemone::past_attention", mutates_args=())
def past_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, past_key: torch.Tensor,
                   past_value: torch.Tensor, heads: int, scale: float) -> torch.Tensor:
    """query [B, H, T, D] (H = `heads`), this call's key and value [B, KV, T, D], the past's [1, KV, P, D], fp32;
    query head h reads key head h // (H / KV) -> [B, T, H * D]."""
    batch, _, length, dim = query.shape
    kv_heads, past = key.shape[1], past_key.shape[2]
    keys = torch.cat([past_key.expand(batch, -1, -1, -1), key], dim=2)
    values = torch.cat([past_value.expand(batch, -1, -1, -1), value], dim=2)
    steps = torch.arange(length, device=query.device)
    allowed = torch.arange(past + length, device=query.device)[None, :] <= steps[:, None] + past  # [T, P + T]
    scores = (query.reshape(batch, kv_heads, -1, dim) * scale) @ keys.transpose(2, 3)  # [B, KV, g * T, P + T]
    scores = scores.view(batch, kv_heads, -1, length, past + length).masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores.view(batch, kv_heads, -1, past + length), dim=-1)
    out = (probs @ values).view(batch, heads, length, dim)
    return out.transpose(1, 2).reshape(batch, length, heads * dim).contiguous()


@past_attention.register_fake
def _(query, key, value, past_key, past_value, heads, scale):
    batch, _, length, dim = query.shape
    return query.new_empty((batch, length, heads * dim))


def _past_attention(query: FLOAT, key: FLOAT, value: FLOAT, past_key: FLOAT, past_value: FLOAT, heads: int,
                    scale: float) -> FLOAT:
    batch, dim = op.Shape(query, start=0, end=1), op.Shape(query, start=3, end=4)
    kv = op.Shape(key, start=1, end=2)
    groups = op.Div(op.Constant(value_ints=[heads]), kv)

    def repeated(x: FLOAT) -> FLOAT:
        """[B or 1, KV, n, D] fp32 -> [B, H, n, D] fp16, key head j read by query heads j * g .. j * g + g - 1."""
        n = op.Shape(x, start=2, end=3)
        grouped = op.Expand(op.Unsqueeze(op.Cast(x, to=FLOAT16.dtype), op.Constant(value_ints=[2])),
                            op.Concat(batch, kv, groups, n, dim, axis=0))
        # allowzero: an empty past (a prefill from nothing) is n = 0, not "copy this axis".
        return op.Reshape(grouped, op.Concat(batch, op.Constant(value_ints=[heads]), n, dim, axis=0), allowzero=1)

    def rows_first(x: FLOAT) -> FLOAT:
        """[B, H, T, D] -> the node's [B, T, H * D]."""
        return op.Reshape(op.Transpose(x, perm=[0, 2, 1, 3]), op.Constant(value_ints=[0, 0, -1]))

    out, _, _ = MULTI_HEAD_ATTENTION_WITH_PAST(
        rows_first(op.Cast(query, to=FLOAT16.dtype)), rows_first(repeated(key)), rows_first(repeated(value)),
        None, None, None, repeated(past_key), repeated(past_value), num_heads=heads, scale=scale, unidirectional=1)
    return op.Cast(out, to=FLOAT.dtype)


TRANSLATIONS = {torch.ops.systemone.batch_attention.default: half_attention,
                torch.ops.systemone.skip_rms_norm.default: _skip_rms_norm,
                torch.ops.systemone.gelu_tanh.default: _fast_gelu,
                torch.ops.systemone.past_attention.default: _past_attention}
