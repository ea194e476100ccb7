"""The d1 text graph: the LFM2 decoder with its state in and out, read at the last token, written for ONNX export.

One graph serves both halves of a d1 request (spec 3.7; issue: state prefix reuse):

* prefill: the shared prompt prefix (state, images) of one request, batch 1, no past (empty KV, zero conv state);
  it returns the prefix's new keys/values and conv states;
* suffixes: every question's remaining tokens as a right-padded batch on that state; the past has batch 1 and
  is broadcast to the batch inside the graph (queries of every row read the same past keys, nothing is copied).

Inputs:  input_ids [B, T] int64, media_embeds [M, hidden] float32, media_index [M] int64 (flat positions in B*T),
         last_index [B] int64, label_ids [K] int64, then per decoder layer in order: attention layers
         past_key_i / past_value_i [1, kv_heads, P, head_dim], conv layers past_conv_i [1, hidden, L-1].
Outputs: label_logprobs [B, K] float32 (full-vocabulary log-softmax at each row's last_index, at label_ids),
         argmax [B] int64 (greedy token), then per layer new_key_i / new_value_i [B, kv_heads, T, head_dim]
         (this call's keys only) and new_conv_i [B, hidden, L-1] (the conv window after the last token).

Right padding keeps every real token's computation exact: attention and the short convolution are causal, so a
row's pads come after it and never reach it.

`fused` writes the CUDA form's graph: each attention layer one onnxruntime MultiHeadAttention node reading the past
as its past inputs, each residual sum inside the next norm (export/fused_ops.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..fused_ops import past_attention, skip_rms_norm
from ..short_conv import shifted_conv_rows


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Divided by the root rather than times its reciprocal: the pattern onnxruntime fuses into one
    # SimplifiedLayerNormalization kernel (fp32 accumulation, one launch instead of six).
    return weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Lfm2AttentionBlock(nn.Module):
    """Grouped-query attention over [past ; this call] with rotary positions P..P+T-1 (LFM2's q/k RMS norms).
    `fused`: the scores, mask and softmax as one onnxruntime MultiHeadAttention node (the CUDA form,
    `fused_ops.py`)."""

    def __init__(self, attn, eps: float, fused: bool = False):
        super().__init__()
        self.attn = attn
        self.eps = eps
        self.fused = fused
        self.head_dim = attn.head_dim
        self.heads = attn.q_proj.out_features // attn.head_dim
        self.groups = attn.num_key_value_groups

    def forward(self, x, cos, sin, causal, past_key, past_value):
        batch, length, _ = x.shape
        hd = self.head_dim
        q = self.attn.q_proj(x).view(batch, length, -1, hd)
        k = self.attn.k_proj(x).view(batch, length, -1, hd)
        v = self.attn.v_proj(x).view(batch, length, -1, hd).transpose(1, 2)
        q = _rms_norm(q, self.attn.q_layernorm.weight, self.eps).transpose(1, 2)
        k = _rms_norm(k, self.attn.k_layernorm.weight, self.eps).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        kv_heads = k.shape[1]
        if self.fused:
            out = past_attention(q, k, v, past_key, past_value, self.heads, hd**-0.5)
            return self.attn.out_proj(out), k, v
        # Query head h reads kv head h // groups: fold the group into the query rows, so K/V are never repeated.
        q = q.reshape(batch, kv_heads, self.groups * length, hd) * (hd**-0.5)
        past_scores = torch.matmul(q, past_key.transpose(2, 3))  # [B, kvh, g*T, P], past broadcast over B
        new_scores = torch.matmul(q, k.transpose(2, 3)).view(batch, kv_heads, self.groups, length, length)
        new_scores = (new_scores + causal).view(batch, kv_heads, self.groups * length, length)
        probs = torch.softmax(torch.cat([past_scores, new_scores], dim=-1), dim=-1)
        past_len = past_key.shape[2]
        out = torch.matmul(probs[..., :past_len], past_value) + torch.matmul(probs[..., past_len:], v)
        out = out.view(batch, kv_heads * self.groups, length, hd).transpose(1, 2).reshape(batch, length, -1)
        return self.attn.out_proj(out), k, v


class Lfm2ConvBlock(nn.Module):
    """LFM2's gated short convolution, continued from the previous call's window of B*x values, channels last: its
    products read and write [B, T, hidden] as they are, where a transposed view of them had a row length of T (odd
    for most prompts) and sent each layer's out projection to an unaligned kernel (d1-3B's prefill on the H200:
    3.6 of 34 GPU ms, docs/decisions/fused-ops.md). The state keeps its [B, hidden, L-1] layout.
    `fused`: B, C and x as a product each (the CUDA form), where the portable graph splits one product's output."""

    def __init__(self, conv, fused: bool = False):
        super().__init__()
        self.conv = conv
        self.fused = fused
        if fused and conv.in_proj.bias is not None:
            raise ValueError("the fused LFM2 convolution block takes no in-projection bias")

    def forward(self, x, past_conv):
        if self.fused:
            weights = torch.split(self.conv.in_proj.weight, self.conv.in_proj.out_features // 3)  # weights of their own
            b, c, xx = (F.linear(x, weight) for weight in weights)
        else:
            b, c, xx = self.conv.in_proj(x).chunk(3, dim=-1)
        bx = b * xx  # [B, T, H]
        taps = past_conv.shape[2]
        window = torch.cat([past_conv.transpose(1, 2).expand(bx.shape[0], -1, -1), bx], dim=1)
        out = shifted_conv_rows(window, self.conv.conv.weight[:, 0, :], bx.shape[1])
        if self.conv.conv.bias is not None:
            out = out + self.conv.conv.bias
        y = self.conv.out_proj(c * out)
        return y, window[:, window.shape[1] - taps:].transpose(1, 2)


class D1TextFront(nn.Module):
    """Embeddings with the media rows put in, the rotary tables from the past's length on (read off the first
    attention layer's past keys), the causal mask of this call's tokens, and the first block's `update` (zeros:
    every block sums in the same way, x + 0 being x)."""

    outputs = ["hidden", "update", "cos", "sin", "causal"]

    def __init__(self, language_model: nn.Module):
        super().__init__()
        self.embed_tokens = language_model.embed_tokens
        self.register_buffer("inv_freq", language_model.rotary_emb.inv_freq.detach().clone(), persistent=False)

    def forward(self, input_ids, media_embeds, media_index, first_past_key):
        batch, length = input_ids.shape
        hidden = self.embed_tokens(input_ids)
        width = hidden.shape[-1]
        hidden = hidden.reshape(-1, width).index_put((media_index,), media_embeds).view(batch, length, width)
        past_len = first_past_key.shape[2]
        steps = torch.arange(length, device=input_ids.device)
        # Positions from a range that starts at the past's length: a shape on the host, read by Range as such. Added
        # to the steps instead, it was copied to the device each call, which keeps onnxruntime from capturing.
        positions = torch.arange(past_len, past_len + length, device=input_ids.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        causal = torch.where(steps[None, :] <= steps[:, None], 0.0, torch.finfo(torch.float32).min)
        return hidden, torch.zeros_like(hidden), emb.cos(), emb.sin(), causal


class D1TextBlock(nn.Module):
    """One decoder layer: the residual stream and what the last block adds to it -> the same after this layer,
    and the layer's new state (an attention layer's keys and values, a convolution layer's window)."""

    def __init__(self, layer: nn.Module, mixer: nn.Module, eps: float, fused: bool):
        super().__init__()
        self.layer, self.mixer, self.eps, self.fused = layer, mixer, eps, fused

    @property
    def attention(self) -> bool:
        return isinstance(self.mixer, Lfm2AttentionBlock)

    @property
    def inputs(self) -> list[str]:
        shared = ["cos", "sin", "causal", "past_key", "past_value"] if self.attention else ["past_conv"]
        return ["hidden", "update", *shared]

    @property
    def outputs(self) -> list[str]:
        return ["next_hidden", "next_update", *(["new_key", "new_value"] if self.attention else ["new_conv"])]

    def forward(self, hidden, update, *rest):
        layer = self.layer
        normed, hidden = _add_norm(hidden, update, layer.operator_norm.weight, self.eps, self.fused)
        out, *new = self.mixer(normed, *rest)
        ff = layer.feed_forward
        normed, hidden = _add_norm(hidden, out, layer.ffn_norm.weight, self.eps, self.fused)
        return (hidden, ff.w2(F.silu(ff.w1(normed)) * ff.w3(normed)), *new)


class D1TextHead(nn.Module):
    """The last block's update summed in, each row's token at `last_index` normed and read through the LM head:
    the full vocabulary's log-softmax at `label_ids`, and the greedy token."""

    def __init__(self, language_model: nn.Module, lm_head: nn.Linear, eps: float):
        super().__init__()
        self.norm, self.lm_head, self.eps = language_model.embedding_norm, lm_head, eps

    def forward(self, hidden, update, last_index, label_ids):
        hidden = hidden + update
        last = hidden[torch.arange(hidden.shape[0], device=hidden.device), last_index]
        logits = self.lm_head(_rms_norm(last, self.norm.weight, self.eps))
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        return logprobs[:, label_ids], torch.argmax(logits, dim=-1)


def _add_norm(hidden: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, eps: float, fused: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the norm of the residual stream after `update` is added, the stream); fused: one node for both."""
    if fused:
        return skip_rms_norm(hidden, update, weight, eps)
    hidden = hidden + update
    return _rms_norm(hidden, weight, eps), hidden


class D1TextGraph(nn.Module):
    """LFM2 decoder (weights shared with transformers' `Lfm2Model`) + tied LM head log-softmax at the last token: a
    front, one block a layer and a head (export/stack.py traces one block of each kind and stamps it)."""

    def __init__(self, language_model, lm_head: nn.Linear, fused: bool = False):
        super().__init__()
        eps = language_model.config.norm_eps
        self.front = D1TextFront(language_model)
        self.blocks = nn.ModuleList(
            D1TextBlock(layer, Lfm2AttentionBlock(layer.self_attn, eps, fused) if layer.is_attention_layer
                        else Lfm2ConvBlock(layer.conv, fused), eps, fused) for layer in language_model.layers)
        # The LM head is tied to embed_tokens in LFM2: the graph then holds the table once.
        self.head = D1TextHead(language_model, lm_head, eps)

    def forward(self, input_ids, media_embeds, media_index, last_index, label_ids, states):
        grouped = self._split(states)
        first_key = next(past for past, block in zip(grouped, self.blocks) if block.attention)[0]
        made = dict(zip(D1TextFront.outputs, self.front(input_ids, media_embeds, media_index, first_key)))
        hidden, update = made["hidden"], made["update"]
        new_states = []
        for block, past in zip(self.blocks, grouped):
            shared = [made[name] for name in block.inputs[2:] if not name.startswith("past_")]
            hidden, update, *new = block(hidden, update, *shared, *past)
            new_states += new
        return (*self.head(hidden, update, last_index, label_ids), *new_states)

    def _split(self, states):
        """The flat state tuple regrouped per layer: (key, value) for attention layers, (conv,) for conv layers."""
        grouped, i = [], 0
        for block in self.blocks:
            take = 2 if block.attention else 1
            grouped.append(tuple(states[i:i + take]))
            i += take
        return grouped
