"""The d1 vision graph: SigLIP2 NaFlex tower + LFM2-VL projector on crops of one size, written for ONNX export.

Inputs:  patches [C, N, 3*p*p] float32 (C crops of the same grid, N = h*w patches each) and positions [N, width]
         float32 (the position table resized to the grid, spec 3.8 step 5), both in *unshuffle order*: patch rows
         grouped so that each run of 4 consecutive rows is one projector cell (dh, dw) = (0,0), (0,1), (1,0), (1,1),
         cells row-major. The encoder has no positional bias (positions enter only as the added table), so it is
         equivariant to this reordering, and the pixel unshuffle becomes a reshape.
Output:  media_embeds [C * N/4, text hidden] float32, rows in cell order, crop by crop.
"""

from __future__ import annotations

import torch
from torch import nn

from ..fused_ops import batch_attention, gelu_tanh


class D1VisionGraph(nn.Module):
    """`fused`: each encoder layer's attention as onnxruntime's MultiHeadAttention node (one row a crop, read in
    fp16) and its MLP's tanh GELU as a FastGelu node (export/fused_ops.py), for the CUDA form; the portable graph
    writes them out op by op, the scores of each crop's N x N patches in fp32."""

    def __init__(self, vision_tower, projector, factor: int, fused: bool = False):
        super().__init__()
        self.tower = vision_tower
        self.projector = projector
        self.factor = factor
        self.fused = fused
        self.fast_gelu = fused and vision_tower.config.hidden_act == "gelu_pytorch_tanh"  # FastGelu: tanh GELU only

    def forward(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        tower = self.tower
        hidden = tower.embeddings.patch_embedding(patches) + positions[None]
        if self.fused:
            for layer in tower.encoder.layers:
                hidden = hidden + self._attention(layer.self_attn, layer.layer_norm1(hidden))
                hidden = hidden + self._mlp(layer.mlp, layer.layer_norm2(hidden))
        else:
            hidden = tower.encoder(inputs_embeds=hidden, attention_mask=None).last_hidden_state
        hidden = tower.post_layernorm(hidden)
        crops, count, width = hidden.shape
        cells = hidden.reshape(crops * (count // self.factor**2), width * self.factor**2)
        projector = self.projector
        if projector.layer_norm is not None:
            cells = projector.layer_norm(cells)
        return projector.linear_2(projector.act(projector.linear_1(cells)))

    @staticmethod
    def _attention(attn: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        out = batch_attention(attn.q_proj(hidden), attn.k_proj(hidden), attn.v_proj(hidden), attn.num_heads,
                              attn.scale)
        return attn.out_proj(out)

    def _mlp(self, mlp: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        if self.fast_gelu:
            return mlp.fc2(gelu_tanh(mlp.fc1(hidden)))
        return mlp(hidden)
