"""The d3 text graph: Qwen3.5 text backbone + last-token readout, written for ONNX export.

It reads the weights of transformers' `Qwen3_5Model` (same modules, same names) and reproduces its forward pass
(spec 4.13/4.14) in a form `torch.onnx.export(dynamo=True)` keeps dynamic:

* the gated delta rule is the portable chunked one (`delta_rule.py`) or, in the CUDA form's graph, onnxruntime's
  fused node, with the short convolution and the gated norm beside it (`fused_ops.py`);
* the 3-D M-RoPE positions are a graph input (computed by the runtime, spec 4.11);
* attention masks are built in the graph from the 2-D padding mask: causal for `causal`, bidirectional over the
  whole prompt for `noncausal_full_attention` (full-attention layers only; Gated DeltaNet stays causal, spec 4.3);
  in the CUDA form's graph each full-attention layer is onnxruntime's fused attention node, bounded by each row's
  length, which never holds the scores.

Inputs: input_ids [B, L] int64, attention_mask [B, L] int64 (right padding), position_ids [3, B, L] int64,
media_embeds [M, hidden] float32 and media_index [M] int64 (the vision graph's rows and their flat positions in
B x L; M = 0 for text-only prompts).
Output: code_logits [B, len(codes)] float32 at each row's last real token.

In `causal` mode the graph also carries the state of the tokens before its own, as d1's does (prefix reuse: a
request's shared prefix, its media among it, runs once, and its questions are read as suffixes on that state):
after the inputs above, per decoder layer in order, Gated DeltaNet layers past_conv_i [1, conv channels, K - 1] and
past_recurrent_i [1, value heads, Dk, Dv], full-attention layers past_key_i / past_value_i [1, KV heads, P, D] (batch
1, read by every row; P = 0 and zeros for a prompt from its start); after code_logits the same per layer, new_*:
the windows and recurrent states after each row's last token (exact for a row without padding, as a prefill is) and
this call's keys and values [B, KV heads, L, D]. The bidirectional mode has no such state: every question reads its
whole prompt (spec 4.3).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..short_conv import shifted_conv
from .delta_rule import chunk_gated_delta_rule
from ..fused_ops import past_attention, rms, skip_rms_norm
from .fused_ops import (causal_conv_silu, causal_conv_silu_past, gated_delta_rule, gated_delta_rule_past,
                        gated_rms_norm, padded_attention)


def _norm_1p(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Qwen3.5 RMSNorm, `(1 + w)` form, computed in float32."""
    return (rms(x.float(), norm.eps) * (1.0 + norm.weight.float())).to(x.dtype)


class GatedDeltaNetLayer(nn.Module):
    """`fused`: the short convolution, delta rule and gated norm as onnxruntime's fused nodes (the CUDA form,
    `fused_ops.py`) rather than the portable graph's ops and chunk loop."""

    def __init__(self, hf: nn.Module, fused: bool = False):
        super().__init__()
        self.hf = hf
        self.fused = fused
        self.sizes = [hf.key_dim, hf.key_dim, hf.value_dim]  # query, key, value in the joint projection
        if fused:
            if hf.in_proj_qkv.bias is not None or hf.conv1d.bias is not None:
                raise ValueError("the fused Gated DeltaNet layer takes no in-projection or convolution bias")

    def forward(self, hidden: torch.Tensor, pad_mask: torch.Tensor, past: tuple[torch.Tensor, ...] | None = None):
        """The layer's output; with `past` (the convolution's last K - 1 inputs [1, C, K - 1] and the delta rule's
        state [1, H, Dk, Dv] of the tokens before, the same for every row) also the two after each row's last
        token, exact for a row without padding."""
        hf = self.hf
        if not self.fused:
            # The padding's rows zeroed, as transformers does. Rows are right-padded and the layer reads only back
            # in time, yet without it the portable graph's d3-nano export gave NaN on padded rows: the padding is one
            # token repeated, which the chunk solve of the time got wrong, and its garbage grew to inf and reached
            # real rows through the chunk's products (docs/decisions/delta-rule-chunk-solve.md). The solve is fixed; the
            # zeroing stays, as measured. The fused node's kernel, gated at d3-nano on CUDA without it, saves the pass.
            hidden = hidden * pad_mask[:, :, None].to(hidden.dtype)
        batch, length, _ = hidden.shape
        taps = hf.conv_kernel_size - 1
        new_conv = None
        if self.fused:
            # One product and one convolution each for query, key and value, on row slices of the joint weights
            # (weights of their own in the graph): the node reads them apart, and a Split of the joint output was
            # one more copy of it a layer.
            weights = zip(torch.split(hf.in_proj_qkv.weight, self.sizes), torch.split(hf.conv1d.weight, self.sizes))
        if self.fused and past is None:
            query, key, value = (causal_conv_silu(F.linear(hidden, weight), conv) for weight, conv in weights)
        elif self.fused:
            parts = [causal_conv_silu_past(F.linear(hidden, weight), conv, part) for (weight, conv), part
                     in zip(weights, torch.split(past[0], self.sizes, dim=1))]
            query, key, value = (out for out, _ in parts)
            new_conv = torch.cat([window for _, window in parts], dim=1)
        else:
            inputs = hf.in_proj_qkv(hidden).transpose(1, 2)
            window = (F.pad(inputs, (taps, 0)) if past is None  # zeros before the first token
                      else torch.cat([past[0].expand(batch, -1, -1), inputs], dim=2))
            mixed = F.silu(shifted_conv(window, hf.conv1d.weight[:, 0, :], length)).transpose(1, 2)
            query, key, value = torch.split(mixed, self.sizes, dim=-1)
            new_conv = window[:, :, window.shape[2] - taps:]
        query = query.reshape(batch, length, -1, hf.head_k_dim)
        key = key.reshape(batch, length, -1, hf.head_k_dim)
        value = value.reshape(batch, length, -1, hf.head_v_dim)
        z = hf.in_proj_z(hidden).reshape(batch, length, -1, hf.head_v_dim)
        repeat = hf.num_v_heads // hf.num_k_heads
        if repeat > 1:
            query = query.repeat_interleave(repeat, dim=2)
            key = key.repeat_interleave(repeat, dim=2)
        norm = hf.norm
        new_state = None
        if self.fused:
            rule = (query.float(), key.float(), value.float(), hf.in_proj_a(hidden).float(),
                    hf.in_proj_b(hidden).float(), hf.A_log.float(), hf.dt_bias.float(), hf.head_k_dim ** -0.5)
            if past is None:
                core = gated_delta_rule(*rule)
            else:
                core, new_state = gated_delta_rule_past(*rule, past[1])
            gated = gated_rms_norm(core.reshape(batch, length, -1), norm.weight.float(),
                                   z.reshape(batch, length, -1).float(), norm.variance_epsilon)
            out = hf.out_proj(gated.to(hidden.dtype))
        else:
            beta = hf.in_proj_b(hidden).sigmoid()
            g = -hf.A_log.float().exp() * F.softplus(hf.in_proj_a(hidden).float() + hf.dt_bias)
            if past is None:
                core = chunk_gated_delta_rule(query, key, value, g, beta)
            else:
                core, new_state = chunk_gated_delta_rule(query, key, value, g, beta, past[1])
            gated = rms(core.to(hidden.dtype).float(), norm.variance_epsilon).to(hidden.dtype) * norm.weight
            gated = (gated * F.silu(z.float())).to(hidden.dtype)
            out = hf.out_proj(gated.reshape(batch, length, -1))
        return out if past is None else (out, (new_conv, new_state))


class FullAttentionLayer(nn.Module):
    """`fused`: the scores, mask and softmax as onnxruntime's MultiHeadAttention node (the CUDA form,
    `fused_ops.py`), which never holds the B x heads x L x L scores; the portable graph writes them as products."""

    def __init__(self, hf: nn.Module, fused: bool = False, causal: bool = True):
        super().__init__()
        self.hf = hf
        self.fused = fused
        self.causal = causal
        if fused and hf.q_proj.bias is not None:
            raise ValueError("the fused attention layer takes no query projection bias")

    def forward(self, hidden, cos, sin, additive_mask, lengths, past=None):
        """The layer's output; with `past` (keys and values [1, KV, P, D] of the tokens before, the same for every
        row; causal only) also this call's keys and values [B, KV, L, D]."""
        hf = self.hf
        batch, length, _ = hidden.shape
        head_dim = hf.head_dim
        if self.fused:
            # The query and its output gate as two products (each head's rows are [query; gate]), not one split.
            heads = hf.q_proj.weight.view(-1, 2, head_dim, hf.q_proj.weight.shape[-1])  # [H, (q, gate), D, in]
            rows = heads.shape[0] * head_dim
            query_weight, gate_weight = torch.split(heads.transpose(0, 1).reshape(2 * rows, -1), [rows, rows])
            query = F.linear(hidden, query_weight).view(batch, length, -1, head_dim)
            gate = F.linear(hidden, gate_weight)
        else:
            query, gate = torch.chunk(hf.q_proj(hidden).view(batch, length, -1, head_dim * 2), 2, dim=-1)
            gate = gate.reshape(batch, length, -1)
        query = _norm_1p(hf.q_norm, query).transpose(1, 2)
        key = _norm_1p(hf.k_norm, hf.k_proj(hidden).view(batch, length, -1, head_dim)).transpose(1, 2)
        value = hf.v_proj(hidden).view(batch, length, -1, head_dim).transpose(1, 2)
        query, key = _rotary(query, cos, sin), _rotary(key, cos, sin)
        if past is not None:
            return self._over_past(query, key, value, gate, *past), (key, value)
        groups = hf.num_key_value_groups
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
        if self.fused:
            out = padded_attention(query.float(), key.float(), value.float(), lengths, query.shape[1], self.causal,
                                   hf.scaling)
            return hf.o_proj(out.to(hidden.dtype) * torch.sigmoid(gate))
        # The scale on the query [B, H, L, D] rather than on the scores [B, H, L, L]: L / D times fewer products.
        scores = (query * hf.scaling) @ key.transpose(-1, -2) + additive_mask
        probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
        out = (probs @ value).transpose(1, 2).reshape(batch, length, -1)
        return hf.o_proj(out * torch.sigmoid(gate))

    def _over_past(self, query, key, value, gate, past_key, past_value):
        """Causal attention of this call's queries [B, H, L, D] over the past's keys and their own row's up to
        themselves (query t after P past tokens sees keys 0 .. P + t)."""
        hf = self.hf
        batch, heads, length, _ = query.shape
        if self.fused:
            out = past_attention(query.float(), key.float(), value.float(), past_key, past_value, heads, hf.scaling)
            return hf.o_proj(out.to(gate.dtype) * torch.sigmoid(gate))
        groups = hf.num_key_value_groups
        keys, values = (torch.cat([old.expand(batch, -1, -1, -1), new], dim=2).repeat_interleave(groups, dim=1)
                        for old, new in ((past_key, key), (past_value, value)))
        past = past_key.shape[2]
        allowed = torch.arange(past + length, device=query.device)[None, :] <= (
            torch.arange(length, device=query.device)[:, None] + past)
        scores = ((query * hf.scaling) @ keys.transpose(-1, -2)).masked_fill(~allowed, torch.finfo(query.dtype).min)
        probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
        out = (probs @ values).transpose(1, 2).reshape(batch, length, -1)
        return hf.o_proj(out * torch.sigmoid(gate))


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotary(x, cos, sin):
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat([x_rot * cos + _rotate_half(x_rot) * sin, x_pass], dim=-1)


def _add_norm(hidden: torch.Tensor, update: torch.Tensor, norm: nn.Module, fused: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the norm of the residual stream after `update` is added, the stream); fused: one node for both."""
    if fused:
        normed, hidden = skip_rms_norm(hidden.float(), update.float(), 1.0 + norm.weight.float(), norm.eps)
        return normed.to(update.dtype), hidden.to(update.dtype)
    hidden = hidden + update
    return _norm_1p(norm, hidden), hidden


class D3TextFront(nn.Module):
    """Embeddings with the media rows put in, the rotary tables, the additive mask where the blocks read one, each
    row's length, and the first block's `update`: zeros, so that every block sums in the same way (x + 0 is x)."""

    def __init__(self, text: nn.Module, bidirectional: bool, additive_mask: bool):
        super().__init__()
        self.embed_tokens = text.embed_tokens
        self.bidirectional, self.additive_mask = bidirectional, additive_mask
        rotary = text.rotary_emb
        self.register_buffer("inv_freq", rotary.inv_freq.float().clone(), persistent=False)
        # Interleaved M-RoPE: frequency j reads the T, H or W position (spec 4.11).
        channel = torch.zeros(self.inv_freq.shape[0], dtype=torch.long)
        for axis, offset in ((1, 1), (2, 2)):
            channel[slice(offset, rotary.mrope_section[axis] * 3, 3)] = axis
        self.register_buffer("freq_channel", channel, persistent=False)
        self.attention_scaling = float(rotary.attention_scaling)

    @property
    def outputs(self) -> list[str]:
        return ["hidden", "update", "cos", "sin", *(["additive_mask"] if self.additive_mask else []), "lengths"]

    def forward(self, input_ids, attention_mask, position_ids, media_embeds, media_index):
        hidden = self.embed_tokens(input_ids)
        # Image/video embeddings replace the placeholder tokens' rows (flat index into batch x sequence).
        batch, length, width = hidden.shape
        hidden = hidden.reshape(-1, width).index_put((media_index,), media_embeds.to(hidden.dtype))
        hidden = hidden.reshape(batch, length, width)
        cos, sin = self._rope(position_ids, hidden.dtype)
        out = (hidden, torch.zeros_like(hidden), cos, sin)
        if self.additive_mask:
            out += (self._attention_mask(attention_mask, hidden.dtype),)
        return (*out, attention_mask.sum(dim=1))

    def _rope(self, position_ids: torch.Tensor, dtype: torch.dtype):
        freqs = position_ids[..., None].float() * self.inv_freq  # [3, B, L, F]
        index = self.freq_channel.view(1, 1, 1, -1).expand(1, freqs.shape[1], freqs.shape[2], -1)
        freqs = torch.gather(freqs, 0, index)[0]  # [B, L, F]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)[:, None]
        sin = (emb.sin() * self.attention_scaling).to(dtype)[:, None]
        return cos, sin

    def _attention_mask(self, attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        keys = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, L]
        if not self.bidirectional:
            length = attention_mask.shape[1]
            causal = torch.ones(length, length, dtype=torch.bool, device=attention_mask.device).tril()
            keys = keys & causal[None, None]
        zero = torch.zeros((), dtype=dtype, device=attention_mask.device)
        return torch.where(keys, zero, torch.finfo(dtype).min)


class D3TextBlock(nn.Module):
    """One decoder layer: the residual stream and what the last block adds to it (`update`, summed in by this
    block's first norm) -> the same after this layer. The mixer reads what the front made (`inputs` names it)
    and, in causal mode, its past state (two tensors), whose new values it returns after the stream."""

    def __init__(self, layer: nn.Module, mixer: nn.Module, fused: bool, reads_past: bool, additive_mask: bool):
        super().__init__()
        self.layer, self.mixer = layer, mixer
        self.fused, self.reads_past, self.additive_mask = fused, reads_past, additive_mask

    @property
    def inputs(self) -> list[str]:
        if isinstance(self.mixer, GatedDeltaNetLayer):
            shared = ["attention_mask"]
        else:
            shared = ["cos", "sin", *(["additive_mask"] if self.additive_mask else []), "lengths"]
        return ["hidden", "update", *shared, *(["past_a", "past_b"] if self.reads_past else [])]

    @property
    def outputs(self) -> list[str]:
        return ["next_hidden", "next_update", *(["new_a", "new_b"] if self.reads_past else [])]

    def forward(self, hidden, update, *rest):
        normed, hidden = _add_norm(hidden, update, self.layer.input_layernorm, self.fused)
        past = (rest[-2], rest[-1]) if self.reads_past else None
        shared = rest[:-2] if self.reads_past else rest
        if isinstance(self.mixer, GatedDeltaNetLayer):
            mixed = self.mixer(normed, shared[0], past)
        else:
            cos, sin, *masks = shared
            additive, lengths = (masks[0], masks[1]) if self.additive_mask else (None, masks[0])
            mixed = self.mixer(normed, cos, sin, additive, lengths, past)
        new = ()
        if past is not None:
            mixed, new = mixed
        normed, hidden = _add_norm(hidden, mixed, self.layer.post_attention_layernorm, self.fused)
        return (hidden, self.layer.mlp(normed), *new)


class D3TextHead(nn.Module):
    """The final norm of the stream and the readout at each row's last real token."""

    def __init__(self, norm: nn.Module, readout_weight: torch.Tensor, readout_bias: torch.Tensor | None,
                 fused: bool):
        super().__init__()
        self.norm, self.fused = norm, fused
        self.register_buffer("readout_weight", readout_weight, persistent=False)
        self.register_buffer("readout_bias", readout_bias, persistent=False)

    def forward(self, hidden, update, attention_mask):
        hidden = _add_norm(hidden, update, self.norm, self.fused)[0]
        last = attention_mask.sum(dim=1) - 1
        pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last].float()
        logits = pooled @ self.readout_weight.t()
        if self.readout_bias is not None:
            logits = logits + self.readout_bias
        return logits


class D3TextGraph(nn.Module):
    """Qwen3.5 text backbone (weights shared with a transformers `Qwen3_5Model`) + readout at the last token: a
    front, one block a layer and a head (export/stack.py traces one block of each kind and stamps it)."""

    def __init__(self, hf_model: nn.Module, readout_weight: torch.Tensor, readout_bias: torch.Tensor | None,
                 attention_mode: str, fused: bool = False):
        super().__init__()
        if attention_mode not in ("causal", "noncausal_full_attention"):
            raise ValueError(f"unsupported attention_mode {attention_mode!r}")
        text = hf_model.language_model
        self.config = text.config
        bidirectional = attention_mode == "noncausal_full_attention"
        self.reads_past = not bidirectional
        additive = not (fused or self.reads_past)  # the fused layers bound each row by its length
        self.front = D3TextFront(text, bidirectional, additive)
        self.blocks = nn.ModuleList()
        for layer in text.layers:
            mixer = (GatedDeltaNetLayer(layer.linear_attn, fused) if layer.block_type == "linear_attention"
                     else FullAttentionLayer(layer.self_attn, fused, not bidirectional))
            self.blocks.append(D3TextBlock(layer, mixer, fused, self.reads_past, additive))
        self.head = D3TextHead(text.norm, readout_weight, readout_bias, fused)

    def forward(self, input_ids, attention_mask, position_ids, media_embeds, media_index, states=()):
        made = dict(zip(self.front.outputs, self.front(input_ids, attention_mask, position_ids, media_embeds,
                                                       media_index)))
        made["attention_mask"] = attention_mask
        hidden, update = made["hidden"], made["update"]
        pasts = iter(zip(states[::2], states[1::2]))  # two a layer, of either kind
        new_states: list[torch.Tensor] = []
        for block in self.blocks:
            shared = [made[name] for name in block.inputs[2:] if not name.startswith("past_")]
            hidden, update, *new = block(hidden, update, *shared, *(next(pasts) if self.reads_past else ()))
            new_states += new
        logits = self.head(hidden, update, attention_mask)
        return (logits, *new_states) if self.reads_past else logits
