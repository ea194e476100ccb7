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


class D1VisionGraph(nn.Module):
    def __init__(self, vision_tower, projector, factor: int):
        super().__init__()
        self.tower = vision_tower
        self.projector = projector
        self.factor = factor

    def forward(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        tower = self.tower
        hidden = tower.embeddings.patch_embedding(patches) + positions[None]
        hidden = tower.encoder(inputs_embeds=hidden, attention_mask=None).last_hidden_state
        hidden = tower.post_layernorm(hidden)
        crops, count, width = hidden.shape
        cells = hidden.reshape(crops * (count // self.factor**2), width * self.factor**2)
        projector = self.projector
        if projector.layer_norm is not None:
            cells = projector.layer_norm(cells)
        return projector.linear_2(projector.act(projector.linear_1(cells)))
