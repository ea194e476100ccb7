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


class D1VisionFront(nn.Module):
    """The crops' patch embedding with the resized position table added."""

    def __init__(self, vision_tower: nn.Module):
        super().__init__()
        self.patch_embedding = vision_tower.embeddings.patch_embedding

    def forward(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.patch_embedding(patches) + positions[None]


class D1VisionBlock(nn.Module):
    """One encoder layer: transformers' own on the portable graph; on the fused one its attention and GELU as
    onnxruntime's nodes."""

    def __init__(self, layer: nn.Module, fused: bool, fast_gelu: bool):
        super().__init__()
        self.layer, self.fused, self.fast_gelu = layer, fused, fast_gelu

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        if not self.fused:
            out = layer(hidden, attention_mask=None)
            return out[0] if isinstance(out, tuple) else out
        attn = layer.self_attn
        normed = layer.layer_norm1(hidden)
        hidden = hidden + attn.out_proj(batch_attention(attn.q_proj(normed), attn.k_proj(normed),
                                                        attn.v_proj(normed), attn.num_heads, attn.scale))
        mlp, normed = layer.mlp, layer.layer_norm2(hidden)
        return hidden + (mlp.fc2(gelu_tanh(mlp.fc1(normed))) if self.fast_gelu else mlp(normed))


class D1VisionHead(nn.Module):
    """The post-norm, the pixel unshuffle (a reshape, in unshuffle order) and the projector."""

    def __init__(self, vision_tower: nn.Module, projector: nn.Module, factor: int):
        super().__init__()
        self.post_layernorm, self.projector, self.factor = vision_tower.post_layernorm, projector, factor

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.post_layernorm(hidden)
        crops, count, width = hidden.shape
        cells = hidden.reshape(crops * (count // self.factor**2), width * self.factor**2)
        projector = self.projector
        if projector.layer_norm is not None:
            cells = projector.layer_norm(cells)
        return projector.linear_2(projector.act(projector.linear_1(cells)))


class D1VisionGraph(nn.Module):
    """`fused`: each encoder layer's attention as onnxruntime's MultiHeadAttention node (one row a crop, read in
    fp16) and its MLP's tanh GELU as a FastGelu node (export/fused_ops.py), for the CUDA form; the portable graph
    writes them out op by op, the scores of each crop's N x N patches in fp32. A front, one block a layer and a
    head (export/stack.py)."""

    def __init__(self, vision_tower, projector, factor: int, fused: bool = False):
        super().__init__()
        fast_gelu = fused and vision_tower.config.hidden_act == "gelu_pytorch_tanh"  # FastGelu: tanh GELU only
        self.front = D1VisionFront(vision_tower)
        self.blocks = nn.ModuleList(D1VisionBlock(layer, fused, fast_gelu) for layer in vision_tower.encoder.layers)
        self.head = D1VisionHead(vision_tower, projector, factor)

    def forward(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.front(patches, positions)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)
