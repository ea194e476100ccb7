"""onnxruntime's fused contrib ops for the CUDA form's d3 graphs (docs/decisions/fused-ops.md): in the text graph,
each Gated DeltaNet layer's short convolution, delta rule and gated norm as one node each, in place of the portable
graph's dozens (and its `Scan`, which runs its loop logic on the host and cannot be captured as a CUDA graph); in
the vision graph, each block's attention as one node, which never materialises the n x n scores.

Declared as export/fused_ops.py says (a torch custom op whose eager body is the portable graph's computation, and
its translation to the `com.microsoft` node); `TRANSLATIONS` holds d3's and the shared ones (the vision blocks'
`FastGelu`, the `MultiHeadAttention` node read in fp16, and each residual sum inside the next norm as a
`SkipSimplifiedLayerNormalization` node). The nodes particular to d3, and the sums they compute:

- `CausalConvWithState` (channels last, SiLU, no carried state): out[t] = silu(sum_k w[:, k] x[t - K + 1 + k]),
  zeros before the first token.
- `GatedDeltaNet` (gated delta rule, Qwen gate, sigmoid update rate, L2-normalised query and key), per value head
  with state S [Dk, Dv] from zero: S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T and
  o_t = scale S_t^T q_t, where g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b). On CUDA its chunked
  tensor-core engine runs only with fp16 query/key/value (128-wide heads): the node reads them in fp16; decay,
  update rate and state stay fp32 (the op's contract).
- `GatedRMSNorm` (SiLU gate): y = x / sqrt(mean(x^2) + eps) * w * silu(z), over each head's values.
- `RotaryEmbedding` (not interleaved; one cos/sin row a patch, position i reading row i): the vision blocks' 2-D
  rotary, x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), one kernel for query and one for key in place of
  eleven nodes, in fp32.
- `MultiHeadAttention` over the vision graph's segments, each its own row of the node's batch (the portable vision
  graph's fp32 scores for a 1280 x 960 photo, 4,800 patches, are 4,800^2 per head and block).
- `MultiHeadAttention` again for the text graph's full-attention layers, over right-padded rows, fp16 in and fp32
  out: causal as `unidirectional` with no mask (a real token never sees the padding to its right; onnxruntime's
  CUDA kernel is flash attention), bidirectional with the keys bounded by each row's length, written as the mask
  layout of 3B + 2 int32 (key lengths, then the rows' query and key starts, b x L), the one onnxruntime's CUDA
  memory-efficient kernel takes. The portable graph's fp32 scores (B x heads x L x L, and their copies) were what
  grew a serving process's GPU memory with the long media rows (docs/decisions/fused-ops.md).
"""

import onnx
import torch
import torch.nn.functional as F
from onnxscript import FLOAT, FLOAT16, INT32, INT64
from onnxscript import opset18 as op

from ..fused_ops import HALF_OR_FLOAT, MULTI_HEAD_ATTENTION, contrib_op, half_attention, rms
from ..fused_ops import TRANSLATIONS as SHARED_TRANSLATIONS
from ..short_conv import shifted_conv
from .delta_rule import chunked_rule, l2norm

_Param, _Option = onnx.defs.OpSchema.FormalParameter, onnx.defs.OpSchema.FormalParameterOption
_AttrType = onnx.defs.OpSchema.AttrType
CAUSAL_CONV = contrib_op("CausalConvWithState",
                         [_Param("input", "T"), _Param("weight", "T"),
                          *(_Param(name, "T", param_option=_Option.Optional) for name in ("bias", "past_state"))],
                         [_Param("output", "T"), _Param("present_state", "T")], [("T", HALF_OR_FLOAT, "")],
                         {"channels_last": _AttrType.INT, "activation": _AttrType.STRING})
_GATED_DELTA_NET_INPUTS = [
    _Param("query", "T"), _Param("key", "T"), _Param("value", "T"),
    _Param("cu_seqlens", "TI", param_option=_Option.Optional),
    *(_Param(name, "TS") for name in ("decay", "beta", "initial_state", "a_log", "dt_bias"))]
_GATED_DELTA_NET_TYPES = [("T", HALF_OR_FLOAT, ""), ("TI", ["tensor(int32)"], ""), ("TS", ["tensor(float)"], "")]
_GATED_DELTA_NET_ATTRIBUTES = {"update_rule": _AttrType.STRING, "gate_activation": _AttrType.STRING,
                               "beta_activation": _AttrType.STRING, "qk_l2_norm": _AttrType.INT,
                               "scale": _AttrType.FLOAT}
# Without its final state where nothing reads it (a whole prompt), with it where a prefix's state is kept.
GATED_DELTA_NET = contrib_op("GatedDeltaNet", _GATED_DELTA_NET_INPUTS, [_Param("output", "T")], _GATED_DELTA_NET_TYPES,
                             _GATED_DELTA_NET_ATTRIBUTES)
GATED_DELTA_NET_WITH_STATE = contrib_op("GatedDeltaNet", _GATED_DELTA_NET_INPUTS,
                                        [_Param("output", "T"), _Param("final_state", "TS")], _GATED_DELTA_NET_TYPES,
                                        _GATED_DELTA_NET_ATTRIBUTES)
ROTARY_EMBEDDING = contrib_op("RotaryEmbedding", [_Param("input", "T"), _Param("position_ids", "M"),
                                                  _Param("cos_cache", "T"), _Param("sin_cache", "T")],
                              [_Param("output", "T")], [("T", HALF_OR_FLOAT, ""), ("M", ["tensor(int64)"], "")],
                              {"num_heads": _AttrType.INT, "interleaved": _AttrType.INT})
GATED_RMS_NORM = contrib_op("GatedRMSNorm", [_Param("X", "T"), _Param("scale", "T"), _Param("gate", "T")],
                            [_Param("Y", "T")], [("T", HALF_OR_FLOAT, "")],
                            {"epsilon": _AttrType.FLOAT, "activation": _AttrType.STRING})


# -- the short convolution ---------------------------------------------------------------------------------------
@torch.library.custom_op("systemone::causal_conv_silu", mutates_args=())
def causal_conv_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [B, L, C] (channels last), weight [C, 1, K] -> silu(causal depthwise conv) [B, L, C]."""
    length, taps = x.shape[1], weight.shape[-1]
    window = F.pad(x.transpose(1, 2), (taps - 1, 0))
    return F.silu(shifted_conv(window, weight[:, 0, :], length)).transpose(1, 2).contiguous()


@causal_conv_silu.register_fake
def _(x, weight):
    return x.new_empty(x.shape)


def _causal_conv(x: FLOAT, weight: FLOAT) -> FLOAT:
    out, _ = CAUSAL_CONV(x, weight, channels_last=1, activation="silu")
    return out


@torch.library.custom_op("systemone::causal_conv_silu_past", mutates_args=())
def causal_conv_silu_past(x: torch.Tensor, weight: torch.Tensor, past: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, L, C] (channels last), weight [C, 1, K], past [1, C, K - 1] (the inputs before x, the same for every
    row) -> (silu(causal depthwise conv) [B, L, C], each row's last K - 1 inputs [B, C, K - 1])."""
    length, taps = x.shape[1], weight.shape[-1]
    window = torch.cat([past.expand(x.shape[0], -1, -1), x.transpose(1, 2)], dim=2)
    out = F.silu(shifted_conv(window, weight[:, 0, :], length)).transpose(1, 2).contiguous()
    return out, window[:, :, window.shape[2] - (taps - 1):].contiguous()


@causal_conv_silu_past.register_fake
def _(x, weight, past):
    return x.new_empty(x.shape), x.new_empty((x.shape[0], x.shape[2], weight.shape[-1] - 1))


def _causal_conv_past(x: FLOAT, weight: FLOAT, past: FLOAT) -> tuple[FLOAT, FLOAT]:
    # Channels last, the node's state is [B, K - 1, C] too; the graph's, as transformers keeps it, [1, C, K - 1].
    rows = op.Concat(op.Shape(x, start=0, end=1), op.Constant(value_ints=[1, 1]), axis=0)
    out, present = CAUSAL_CONV(x, weight, None, op.Expand(op.Transpose(past, perm=[0, 2, 1]), rows),
                               channels_last=1, activation="silu")
    return out, op.Transpose(present, perm=[0, 2, 1])


# -- the delta rule ----------------------------------------------------------------------------------------------
@torch.library.custom_op("systemone::gated_delta_rule", mutates_args=())
def gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     a_log: torch.Tensor, dt_bias: torch.Tensor, scale: float) -> torch.Tensor:
    """query, key [B, L, H, Dk], value [B, L, H, Dv], the decay and update-rate projections a, b [B, L, H] and the
    per-head A_log, dt_bias [H], fp32 -> [B, L, H, Dv]."""
    g = -a_log.exp() * F.softplus(a + dt_bias)
    return chunked_rule(l2norm(query), l2norm(key), value, g, b.sigmoid(), scale).contiguous()


@gated_delta_rule.register_fake
def _(query, key, value, a, b, a_log, dt_bias, scale):
    return value.new_empty(value.shape)


def _gated_delta_net(query: FLOAT, key: FLOAT, value: FLOAT, a: FLOAT, b: FLOAT, a_log: FLOAT, dt_bias: FLOAT,
                     scale: float) -> FLOAT:
    # The state's shape [B, H, Dv, Dk] from the inputs' (the uniform, rank-4 packing takes its batch from it).
    state_shape = op.Concat(op.Shape(value, start=0, end=1), op.Shape(value, start=2, end=4),
                            op.Shape(key, start=3, end=4), axis=0)
    state = op.ConstantOfShape(state_shape)
    # 'qwen' names the softplus gate in onnxruntime 1.31 (1.32 calls it 'softplus' and keeps 'qwen' as an alias).
    out = GATED_DELTA_NET(op.Cast(query, to=FLOAT16.dtype), op.Cast(key, to=FLOAT16.dtype),
                          op.Cast(value, to=FLOAT16.dtype), None, a, b, state, a_log, dt_bias,
                          update_rule="gated_delta", gate_activation="qwen", beta_activation="sigmoid",
                          qk_l2_norm=1, scale=scale)
    return op.Cast(out, to=FLOAT.dtype)


@torch.library.custom_op("systemone::gated_delta_rule_past", mutates_args=())
def gated_delta_rule_past(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, a: torch.Tensor,
                          b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, scale: float,
                          state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_delta_rule` from `state` [1, H, Dk, Dv] (the tokens before, the same for every row) -> (output
    [B, L, H, Dv], each row's state after its last token [B, H, Dk, Dv])."""
    g = -a_log.exp() * F.softplus(a + dt_bias)
    out, final = chunked_rule(l2norm(query), l2norm(key), value, g, b.sigmoid(), scale, state)
    return out.contiguous(), final.contiguous()


@gated_delta_rule_past.register_fake
def _(query, key, value, a, b, a_log, dt_bias, scale, state):
    return value.new_empty(value.shape), state.new_empty((value.shape[0], *state.shape[1:]))


def _gated_delta_net_past(query: FLOAT, key: FLOAT, value: FLOAT, a: FLOAT, b: FLOAT, a_log: FLOAT, dt_bias: FLOAT,
                          scale: float, state: FLOAT) -> tuple[FLOAT, FLOAT]:
    # The node's state is value-major [B, H, Dv, Dk]; the graph's, as transformers keeps it, [1, H, Dk, Dv].
    rows = op.Concat(op.Shape(value, start=0, end=1), op.Constant(value_ints=[1, 1, 1]), axis=0)
    initial = op.Expand(op.Transpose(state, perm=[0, 1, 3, 2]), rows)
    out, final = GATED_DELTA_NET_WITH_STATE(
        op.Cast(query, to=FLOAT16.dtype), op.Cast(key, to=FLOAT16.dtype), op.Cast(value, to=FLOAT16.dtype), None, a,
        b, initial, a_log, dt_bias, update_rule="gated_delta", gate_activation="qwen", beta_activation="sigmoid",
        qk_l2_norm=1, scale=scale)
    return op.Cast(out, to=FLOAT.dtype), op.Transpose(final, perm=[0, 1, 3, 2])


# -- the gated norm ----------------------------------------------------------------------------------------------
@torch.library.custom_op("systemone::gated_rms_norm", mutates_args=())
def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """x, gate [..., H * C], weight [C], fp32: each head's C values normalised, scaled, gated by silu(gate)."""
    heads = x.reshape(*x.shape[:-1], -1, weight.shape[0])
    normed = rms(heads, eps) * weight
    return (normed.reshape(x.shape) * F.silu(gate)).contiguous()


@gated_rms_norm.register_fake
def _(x, weight, gate, eps):
    return x.new_empty(x.shape)


def _gated_rms_norm(x: FLOAT, weight: FLOAT, gate: FLOAT, eps: float) -> FLOAT:
    return GATED_RMS_NORM(x, weight, gate, epsilon=eps, activation="silu")


# -- the vision tower's attention ---------------------------------------------------------------------------------
@torch.library.custom_op("systemone::segment_attention", mutates_args=())
def segment_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: torch.Tensor,
                      heads: int, scale: float) -> torch.Tensor:
    """query, key, value [n, H, D] fp32 (H = `heads`, an attribute of the node): S = len(segments) attention
    segments of n / S patches one after the other, each attending to itself, no mask -> [n, H * D]."""
    count = segments.shape[0]
    q, k, v = (x.reshape(count, -1, *x.shape[1:]).transpose(1, 2) for x in (query, key, value))  # [S, H, n/S, D]
    probs = torch.softmax((q @ k.transpose(-1, -2)) * scale, dim=-1, dtype=torch.float32)
    return (probs @ v).transpose(1, 2).reshape(query.shape[0], -1).contiguous()


@segment_attention.register_fake
def _(query, key, value, segments, heads, scale):
    return query.new_empty((query.shape[0], query.shape[1] * query.shape[2]))


def _segment_attention(query: FLOAT, key: FLOAT, value: FLOAT, segments: INT64, heads: int, scale: float) -> FLOAT:
    # [n, H, D] -> [n, H * D] -> [S, n / S, H * D], the op's layout with the segments as its batch.
    rows = op.Reshape(query, op.Constant(value_ints=[0, -1]))
    batched = op.Concat(op.Shape(segments), op.Constant(value_ints=[-1]), op.Shape(rows, start=1), axis=0)
    q, k, v = (op.Reshape(op.Reshape(x, op.Constant(value_ints=[0, -1])), batched) for x in (query, key, value))
    return op.Reshape(half_attention(q, k, v, heads, scale), op.Shape(rows))


# -- the text graph's full attention ---------------------------------------------------------------------------
@torch.library.custom_op("systemone::padded_attention", mutates_args=())
def padded_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: torch.Tensor,
                     heads: int, causal: bool, scale: float) -> torch.Tensor:
    """query, key, value [B, H, L, D] fp32 (H = `heads`) over right-padded rows of `lengths` [B] real tokens: each
    query attends to its row's real keys (only those up to itself where `causal`) -> [B, L, H * D]."""
    length = query.shape[2]
    allowed = (torch.arange(length, device=query.device)[None, :] < lengths[:, None])[:, None, None, :]
    if causal:
        allowed = allowed & torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
    scores = ((query * scale) @ key.transpose(-1, -2)).masked_fill(~allowed, torch.finfo(query.dtype).min)
    out = torch.softmax(scores, dim=-1) @ value
    return out.transpose(1, 2).reshape(query.shape[0], length, -1).contiguous()


@padded_attention.register_fake
def _(query, key, value, lengths, heads, causal, scale):
    return query.new_empty((query.shape[0], query.shape[2], query.shape[1] * query.shape[3]))


def _padded_attention(query: FLOAT, key: FLOAT, value: FLOAT, lengths: INT64, heads: int, causal: bool,
                      scale: float) -> FLOAT:
    # [B, H, L, D] -> [B, L, H * D] in fp16, the op's layout.
    q, k, v = (op.Cast(op.Reshape(op.Transpose(x, perm=[0, 2, 1, 3]), op.Constant(value_ints=[0, 0, -1])),
                       to=FLOAT16.dtype) for x in (query, key, value))
    if causal:
        out = MULTI_HEAD_ATTENTION(q, k, v, num_heads=heads, scale=scale, unidirectional=1)
    else:
        # Key lengths [B], then the rows' query starts and key starts [B + 1] each: b x L, as the rows lie.
        shape = op.Shape(query)
        batch, length = op.Gather(shape, op.Constant(value_int=0)), op.Gather(shape, op.Constant(value_int=2))
        starts = op.Range(op.Constant(value_int=0), op.Mul(op.Add(batch, op.Constant(value_int=1)), length), length)
        mask = op.Cast(op.Concat(lengths, starts, starts, axis=0), to=INT32.dtype)
        out = MULTI_HEAD_ATTENTION(q, k, v, None, mask, num_heads=heads, scale=scale, unidirectional=0)
    return op.Cast(out, to=FLOAT.dtype)


# -- the vision tower's rotary ----------------------------------------------------------------------------------
@torch.library.custom_op("systemone::patch_rotary", mutates_args=())
def patch_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """x [n, H, D] fp32 (H = `heads`), cos, sin [n, D / 2]: patch i's halves rotated by its own angles -> [n, H, D]."""
    half = x.shape[-1] // 2
    cos, sin = (torch.cat([t, t], dim=-1)[:, None, :] for t in (cos, sin))
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@patch_rotary.register_fake
def _(x, cos, sin, heads):
    return x.new_empty(x.shape)


def _patch_rotary(x: FLOAT, cos: FLOAT, sin: FLOAT, heads: int) -> FLOAT:
    # [n, H, D] -> [1, n, H * D], the op's layout; a position_ids of [0] reads cache rows 0 .. n - 1, one a patch.
    rows = op.Unsqueeze(op.Reshape(x, op.Constant(value_ints=[0, -1])), op.Constant(value_ints=[0]))
    out = ROTARY_EMBEDDING(rows, op.Constant(value_ints=[0]), cos, sin, num_heads=heads, interleaved=0)
    return op.Reshape(out, op.Shape(x))


TRANSLATIONS = {**SHARED_TRANSLATIONS,
                torch.ops.systemone.causal_conv_silu.default: _causal_conv,
                torch.ops.systemone.gated_delta_rule.default: _gated_delta_net,
                torch.ops.systemone.causal_conv_silu_past.default: _causal_conv_past,
                torch.ops.systemone.gated_delta_rule_past.default: _gated_delta_net_past,
                torch.ops.systemone.gated_rms_norm.default: _gated_rms_norm,
                torch.ops.systemone.segment_attention.default: _segment_attention,
                torch.ops.systemone.padded_attention.default: _padded_attention,
                torch.ops.systemone.patch_rotary.default: _patch_rotary}
