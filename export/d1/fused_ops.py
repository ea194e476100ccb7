"""onnxruntime's fused ops for the CUDA form's d1 text graph (docs/gpu.md, "The fused form"), declared as
export/fused_ops.py says (a torch custom op whose eager body is the portable graph's computation, and its
translation to the `com.microsoft` node).

- `MultiHeadAttention` with past keys and values, for the LFM2 attention layers: each query of a call reads the
  past's keys (the prefix's state, batch 1, the same for every row of the call) and its own row's keys up to
  itself, causal aligned to the end: query t of a call after P past tokens sees keys 0 .. P + t, which is what the
  node's `unidirectional` does once the past is its `past_key` input (its CUDA kernels, flash attention among
  them, and its CPU kernel alike; given as a longer `key` instead, the CPU kernel aligns it to the start). The node
  has no grouped-query attention, so the key heads are repeated for the query heads that share them (d1-3B: 8 for
  32). Read in fp16, returned in fp32. The portable graph writes the B x heads x T x (P + T) scores in fp32, then
  concatenates, slices and casts them: 0.6 GB a layer at the 2,169-token prefix of a request with a 1024x1024
  image.
"""

import onnx
import torch
from onnxscript import FLOAT, FLOAT16
from onnxscript import opset18 as op

from ..fused_ops import HALF_OR_FLOAT, contrib_op
from ..fused_ops import TRANSLATIONS as SHARED_TRANSLATIONS

_Param, _Option = onnx.defs.OpSchema.FormalParameter, onnx.defs.OpSchema.FormalParameterOption
_AttrType = onnx.defs.OpSchema.AttrType
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


TRANSLATIONS = {**SHARED_TRANSLATIONS, torch.ops.systemone.past_attention.default: _past_attention}
