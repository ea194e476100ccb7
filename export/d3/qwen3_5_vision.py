"""The d3 vision graph: the Qwen3.5 vision tower (patch embedding, blocks, merger) for attention segments of one
size.

transformers' `Qwen3_5VisionModel` derives, from `grid_thw` and with Python loops, the learned position
embedding's bilinear taps, the 2-D rotary positions and the attention segments (one per image, one per video frame
group). Here those are graph inputs computed by the runtime (`runtime/d3/vision_inputs.py`). A run takes S segments
of one grid, one after the other (a video's frame groups, or the same-size images of several requests): each
attends only to its own patches, so the graph holds no data-dependent control flow and both counts stay dynamic.

Inputs (n patches, S segments of n / S, each in merge-block order): pixel_values [n, C*T*P*P] float32,
interp_index [n, 4] int64, interp_weight [n, 4] float32, rotary_pos [n, 2] int64 (row, column), segments [S]
int64 (only its length is read).
Output: media_embeds [n / merge^2, out_hidden] float32, one row per `<|image_pad|>` / `<|video_pad|>` token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..fused_ops import gelu_tanh
from .fused_ops import patch_rotary, segment_attention


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class D3VisionFront(nn.Module):
    """The patches' embedding with the learned positions added, and the rotary tables of the blocks."""

    outputs = ["hidden", "cos", "sin"]

    def __init__(self, visual: nn.Module, fused: bool):
        super().__init__()
        self.patch_embed, self.pos_embed, self.fused = visual.patch_embed, visual.pos_embed, fused
        self.register_buffer("inv_freq", visual.rotary_pos_emb.inv_freq.float().clone(), persistent=False)

    def forward(self, pixel_values, interp_index, interp_weight, rotary_pos, segments):
        proj = self.patch_embed.proj  # a 3-D convolution whose stride is its kernel: one product a patch
        hidden = pixel_values.float() @ proj.weight.reshape(proj.weight.shape[0], -1).t() + proj.bias
        pos = (self.pos_embed(interp_index).float() * interp_weight[:, :, None]).sum(1)
        hidden = hidden + pos
        freqs = rotary_pos[..., None].float() * self.inv_freq  # [n, 2, F]
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)  # [n, D / 2]
        if self.fused:  # the op's cache: one row of half-width angles a patch
            return hidden, freqs.cos(), freqs.sin()
        emb = torch.cat([freqs, freqs], dim=-1)
        return hidden, emb.cos()[:, None, :], emb.sin()[:, None, :]


class D3VisionBlock(nn.Module):
    """One block: attention within each segment, then the MLP, each added to the stream."""

    inputs = ["hidden", "cos", "sin", "segments"]
    outputs = ["next_hidden"]

    def __init__(self, block: nn.Module, fused: bool, fast_gelu: bool):
        super().__init__()
        self.block, self.fused, self.fast_gelu = block, fused, fast_gelu

    def forward(self, hidden, cos, sin, segments):
        block = self.block
        hidden = hidden + _attention(block.attn, block.norm1(hidden), cos, sin, segments, self.fused)
        mlp = block.mlp
        normed = block.norm2(hidden)
        return hidden + (mlp.linear_fc2(gelu_tanh(mlp.linear_fc1(normed))) if self.fast_gelu else mlp(normed))


class D3VisionHead(nn.Module):
    """The merger: each 2 x 2 block of patches one row of the text's width."""

    def __init__(self, merger: nn.Module):
        super().__init__()
        self.merger = merger

    def forward(self, hidden):
        merger = self.merger
        merged = merger.norm(hidden).reshape(-1, merger.hidden_size)
        return merger.linear_fc2(F.gelu(merger.linear_fc1(merged)))


def _attention(attn: nn.Module, hidden, cos, sin, segments, fused: bool):
    n = hidden.shape[0]
    q, k, v = attn.qkv(hidden).reshape(n, 3, attn.num_heads, -1).unbind(1)  # [n, heads, d]
    if fused:
        q, k = (patch_rotary(x.float(), cos, sin, attn.num_heads) for x in (q, k))
        return attn.proj(segment_attention(q, k, v.float(), segments, attn.num_heads, attn.scaling))
    q = q.float() * cos + _rotate_half(q.float()) * sin
    k = k.float() * cos + _rotate_half(k.float()) * sin
    count = segments.shape[0]
    q, k, v = (x.reshape(count, -1, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))  # [S, heads, n / S, d]
    probs = torch.softmax((q @ k.transpose(-1, -2)) * attn.scaling, dim=-1, dtype=torch.float32)
    out = (probs.to(v.dtype) @ v).transpose(1, 2).reshape(n, -1)
    return attn.proj(out)


class D3VisionGraph(nn.Module):
    """`fused`: each block's rotary as onnxruntime's RotaryEmbedding nodes, its attention as a MultiHeadAttention node
    and its MLP's tanh GELU as a FastGelu node (export/d3/fused_ops.py), for the CUDA form; the portable graph writes
    them out op by op. A front, one block a layer and a head (export/stack.py)."""

    def __init__(self, visual: nn.Module, fused: bool = False):
        super().__init__()
        self.front = D3VisionFront(visual, fused)
        fast_gelu = fused and visual.config.hidden_act == "gelu_pytorch_tanh"
        self.blocks = nn.ModuleList(D3VisionBlock(block, fused, fast_gelu) for block in visual.blocks)
        self.head = D3VisionHead(visual.merger)

    def forward(self, pixel_values, interp_index, interp_weight, rotary_pos, segments):
        hidden, cos, sin = self.front(pixel_values, interp_index, interp_weight, rotary_pos, segments)
        for block in self.blocks:
            hidden = block(hidden, cos, sin, segments)
        return self.head(hidden)
