"""The torch fp32 reference of a d3 checkpoint too large for the gate's device (d3 (27B): 108 GB in fp32), run layer
group by layer group over every prompt of the gate at once: the embeddings and the vision tower first, then each
group of decoder layers loaded from the checkpoint, run on every prompt's hidden states and let go, then the final
norm and the readout. The prompts' hidden states stay on the device between groups (a few GB for the gate's 210).

Each stage is transformers' own `Qwen3_5Model` code (`get_image_features`, `get_placeholder_mask`, the decoder
layers, the rotary embedding, the masks); only the loop over the layers is written here, as `Qwen3_5TextModel.forward`
writes it, so that the layers can be loaded a group at a time. Every prompt's logits are those of the whole model
read prompt by prompt (tests/test_streamed_reference.py)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

MediaInput = tuple[np.ndarray, list[tuple[int, int, int]]]  # pixel rows and their (t, h, w) grids
# (token ids, 3-D positions [3, L], images, videos): one prompt as `reference_logits_with_media` takes it.
Prompt = tuple[list[int], np.ndarray, MediaInput | None, MediaInput | None]


def layer_groups(layers: Sequence[Any], group_bytes: int) -> Iterator[range]:
    """Consecutive ranges of `layers` whose fp32 weights fit `group_bytes` (at least one layer a group)."""
    start, size = 0, 0
    for index, layer in enumerate(layers):
        layer_bytes = 4 * sum(param.numel() for param in layer.parameters())
        if index > start and size + layer_bytes > group_bytes:
            yield range(start, index)
            start, size = index, 0
        size += layer_bytes
    if start < len(layers):
        yield range(start, len(layers))


@torch.no_grad()
def streamed_logits(config: Any, prompts: Sequence[Prompt], device: str, group_bytes: int) -> list[np.ndarray]:
    """Readout logits at each prompt's last token (`D3ExportConfig.reference_logits_with_media`'s), with no more
    than `group_bytes` of decoder layers on `device` at once."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    skeleton, meta = config.skeleton, config.meta
    text = meta.language_model
    hidden = _embedded(skeleton, meta, prompts, device)
    rotary = text.rotary_emb.to(device)
    bidirectional = config.attention_mode == "noncausal_full_attention"
    steps = []
    for states, (ids, positions, _, _) in zip(hidden, prompts):
        position_ids = torch.from_numpy(np.ascontiguousarray(positions)).view(3, 1, -1).to(device)
        if bidirectional:  # spec 4.3, as `_read_last_token` asks the whole model
            masks = {"full_attention": torch.zeros(1, 1, len(ids), len(ids), device=device),
                     "linear_attention": None}
        else:
            arguments = dict(config=text.config, inputs_embeds=states, attention_mask=None, past_key_values=None,
                             position_ids=None)
            masks = {"full_attention": qwen.create_causal_mask(**arguments),
                     "linear_attention": qwen.create_recurrent_attention_mask(**arguments)}
        steps.append((rotary(states, position_ids), masks))
    types = text.config.layer_types
    for group in layer_groups(text.layers, group_bytes):
        layers = [skeleton.materialize(device, text.layers[index]) for index in group]
        for k, (position_embeddings, masks) in enumerate(steps):
            for index, layer in zip(group, layers):
                hidden[k] = layer(hidden[k], position_embeddings=position_embeddings,
                                  attention_mask=masks[types[index]], position_ids=None, past_key_values=None,
                                  use_cache=False)
        del layers
        if device == "cuda":
            torch.cuda.empty_cache()
    norm = skeleton.materialize(device, text.norm)
    weight = config.readout("weight").to(device)
    bias = config.readout("bias")
    bias = bias.to(device) if bias is not None else None
    out = []
    for states in hidden:
        last = norm(states)[0, -1].float()
        logits = last @ weight.t()
        if bias is not None:
            logits = logits + bias
        out.append(logits.cpu().numpy())
    return out


def _embedded(skeleton: Any, meta: Any, prompts: Sequence[Prompt], device: str) -> list[torch.Tensor]:
    """Each prompt's input embeddings with its images' and videos' rows scattered in, as `Qwen3_5Model.forward`
    makes them (the vision tower and the embedding table loaded for this, then let go)."""
    model = _Front(skeleton.materialize(device, meta.language_model.embed_tokens),
                   skeleton.materialize(device, meta.visual), meta)
    out = []
    for ids, _, images, videos in prompts:
        input_ids = torch.tensor([ids], device=device)
        embeds = model.embed_tokens(input_ids)
        for media, kind in ((images, "image"), (videos, "video")):
            if media is None:
                continue
            pixels = torch.from_numpy(media[0]).to(device, torch.float32)
            grid = torch.tensor(media[1], device=device)
            features = torch.cat(model.features(pixels, grid), dim=0).to(device, embeds.dtype)
            image_mask, video_mask = model.placeholder_mask(input_ids, embeds, features, kind)
            embeds = embeds.masked_scatter(image_mask if kind == "image" else video_mask, features)
        out.append(embeds)
    return out


class _Front:
    """`Qwen3_5Model`'s embedding and media methods on the loaded embedding table and vision tower."""

    def __init__(self, embed_tokens: Any, visual: Any, meta: Any):
        self.embed_tokens, self.visual, self.meta = embed_tokens, visual, meta

    def features(self, pixels: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs = self.visual(pixels.type(self.visual.dtype), grid_thw=grid)
        split_sizes = (grid.prod(-1) // self.visual.spatial_merge_size**2).tolist()
        return torch.split(outputs.pooler_output, split_sizes)

    def placeholder_mask(self, input_ids: torch.Tensor, embeds: torch.Tensor, features: torch.Tensor,
                         kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

        key = "image_features" if kind == "image" else "video_features"
        return Qwen3_5Model.get_placeholder_mask(self.meta, input_ids, inputs_embeds=embeds, **{key: features})
