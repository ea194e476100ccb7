"""The gated delta rule as one onnxruntime `com.microsoft::GatedDeltaNet` node, for the CUDA form (docs/gpu.md,
"The fused form").

The portable graph runs the rule's chunk loop as an ONNX `Scan`: its loop logic runs on the host, one launch per
op per chunk, and a graph with control flow cannot be captured as a CUDA graph. onnxruntime's contrib op does the
whole rule in one kernel; on CUDA its chunked tensor-core engine runs only with fp16 query/key/value (128-wide
heads), so the node reads them in fp16 while its decay, update rate and state stay fp32 (the op's contract).

In torch the rule is a custom op (`systemone::gated_delta_rule`) whose eager body is the portable chunked rule;
`TRANSLATIONS` maps it to the contrib node when `torch.onnx.export` writes the graph. The node's semantics (per
value head, state S [Dk, Dv]): S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T and
o_t = scale S_t^T q_t, with zero initial state: the rule the portable graph computes chunk by chunk.
"""

import onnx
import onnxscript
import torch
from onnxscript import FLOAT, FLOAT16
from onnxscript import opset18 as op

from .delta_rule import chunked_rule



def _schema() -> onnx.defs.OpSchema:
    """The part of onnxruntime's GatedDeltaNet schema this graph uses (onnx itself knows no contrib op, and the
    exporter needs a schema to place inputs and attributes): query, key, value, cu_seqlens (absent: uniform
    packing), decay, beta, initial_state; the output; `update_rule` and `scale`."""
    Param, Option = onnx.defs.OpSchema.FormalParameter, onnx.defs.OpSchema.FormalParameterOption
    inputs = [Param("query", "T"), Param("key", "T"), Param("value", "T"),
              Param("cu_seqlens", "TI", param_option=Option.Optional), Param("decay", "TS"), Param("beta", "TS"),
              Param("initial_state", "TS")]
    types = [("T", ["tensor(float16)", "tensor(float)"], ""), ("TI", ["tensor(int32)"], ""),
             ("TS", ["tensor(float)"], "")]
    attributes = [onnx.defs.OpSchema.Attribute("update_rule", onnx.defs.OpSchema.AttrType.STRING, ""),
                  onnx.defs.OpSchema.Attribute("scale", onnx.defs.OpSchema.AttrType.FLOAT, "")]
    return onnx.defs.OpSchema("GatedDeltaNet", "com.microsoft", 1, inputs=inputs, outputs=[Param("output", "T")],
                              type_constraints=types, attributes=attributes)


GATED_DELTA_NET = onnxscript.values.Op(onnxscript.values.Opset("com.microsoft", 1), "GatedDeltaNet", _schema())


@torch.library.custom_op("systemone::gated_delta_rule", mutates_args=())
def gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, scale: float) -> torch.Tensor:
    """query, key [B, L, H, Dk] (L2-normalised), value [B, L, H, Dv], g and beta [B, L, H], fp32 -> [B, L, H, Dv]."""
    return chunked_rule(query, key, value, g, beta, scale).contiguous()


@gated_delta_rule.register_fake
def _(query, key, value, g, beta, scale):
    return value.new_empty(value.shape)


def _gated_delta_net(query: FLOAT, key: FLOAT, value: FLOAT, g: FLOAT, beta: FLOAT, scale: float) -> FLOAT:
    # The state's shape [B, H, Dv, Dk] from the inputs' (the uniform, rank-4 packing takes its batch from it).
    state_shape = op.Concat(op.Shape(value, start=0, end=1), op.Shape(value, start=2, end=4),
                            op.Shape(key, start=3, end=4), axis=0)
    state = op.ConstantOfShape(state_shape)
    out = GATED_DELTA_NET(op.Cast(query, to=FLOAT16.dtype), op.Cast(key, to=FLOAT16.dtype),
                      op.Cast(value, to=FLOAT16.dtype), None, g, beta, state,
                      update_rule="gated_delta", scale=scale)
    return op.Cast(out, to=FLOAT.dtype)


TRANSLATIONS = {torch.ops.systemone.gated_delta_rule.default: _gated_delta_net}
