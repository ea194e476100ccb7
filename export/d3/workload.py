"""d3's token batches and requests for `systemone bench` (export/workload.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ...models.family import Readout
from ...runtime.batch import TextRow
from ...runtime.d3.code_logits import code_logits
from ...runtime.engine import Prepared
from ..workload import Workload


class D3Workload(Workload):
    def runtime_batch(self, ids: np.ndarray) -> np.ndarray:
        return code_logits(self.service.engine.runner.run_rows([TextRow(row.tolist()) for row in ids]))

    def torch_inputs(self, model: Any, ids: np.ndarray) -> dict[str, Any]:
        import torch

        device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
        batch, length = ids.shape
        inputs: dict[str, Any] = {"input_ids": torch.from_numpy(ids).to(device),
                                  "position_ids": torch.arange(length, device=device).view(1, 1, -1)
                                  .expand(3, batch, length)}
        if self.reference.attention_mode == "noncausal_full_attention":
            inputs["attention_mask"] = {"full_attention": torch.zeros(batch, 1, length, length, dtype=dtype,
                                                                      device=device), "linear_attention": None}
        return inputs

    def torch_logits(self, model: Any, inputs: dict[str, Any]) -> Any:
        ref = self.reference
        device = inputs["input_ids"].device
        hidden = model(**inputs).last_hidden_state[:, -1].float()
        logits = hidden @ self.on_device("readout", lambda: ref.readout("weight").t(), device)
        if ref.readout_bias is not None:
            logits = logits + self.on_device("bias", lambda: ref.readout("bias"), device)
        return logits

    @staticmethod
    def requests() -> dict[str, Callable[[int], dict[str, Any]]]:
        def one(i: int) -> dict[str, Any]:
            # A new prompt length every time: the runtime must not depend on having seen a shape.
            return {"state": {"ticket": "x " * (40 + i), "tier": "gold"},
                    "questions": {"urgent": {"type": "noul", "instructions": "Is it urgent?"}}}

        def sixteen(i: int) -> dict[str, Any]:
            questions = {f"q{k}": {"type": "choice", "instructions": f"Which team, case {k}?",
                                   "criteria": {f"team {j}": None for j in range(2 + k % 5)}} for k in range(16)}
            return {"state": {"ticket": "Charged twice for order 1234 " * (1 + i % 3)}, "questions": questions}

        return {"one_question": one, "sixteen_questions": sixteen}

    @staticmethod
    def vision_rows(model: Any, media: Any) -> Any:
        """The rows of the request's media in prompt order, each distinct input through the tower once, all of them
        in one run."""
        import torch

        loaded = media.loaded
        keys = list(loaded.items)
        items = [loaded.items[key] for key in keys]
        pixels = torch.from_numpy(np.concatenate([item.pixels for item in items])).to(model.device, model.dtype)
        grids = torch.tensor([list(item.grid) for item in items], device=model.device)
        rows = model.visual(pixels, grid_thw=grids).pooler_output
        merge = int(model.config.vision_config.spatial_merge_size) ** 2
        sizes = [int(np.prod(item.grid)) // merge for item in items]
        parts = dict(zip(keys, torch.split(rows, sizes), strict=True))
        return torch.cat([parts[key] for key in loaded.keys])

    def torch_answers(self, model: Any, prepared: Prepared) -> list[Readout]:
        import torch

        ref = self.reference
        ids, lengths = self.padded(model, prepared)
        batch, width = ids.shape
        embeds = model.get_input_embeddings()(ids)
        if prepared.media is not None:  # the same positions in every prompt (they share the media prefix)
            embeds[:, torch.from_numpy(prepared.media.positions).to(model.device)] = \
                self.vision_rows(model, prepared.media).to(embeds.dtype)
        positions = np.zeros((3, batch, width), np.int64)
        for row, prompt in enumerate(prepared.prompts):
            positions[:, row, :lengths[row]] = prompt.positions
        inputs: dict[str, Any] = {"inputs_embeds": embeds, "position_ids": torch.from_numpy(positions).to(model.device)}
        if ref.attention_mode == "noncausal_full_attention":
            padding = torch.from_numpy(np.arange(width)[None, :] >= lengths[:, None]).to(model.device)
            mask = torch.zeros(batch, 1, width, width, dtype=embeds.dtype, device=model.device)
            mask.masked_fill_(padding[:, None, None, :], torch.finfo(embeds.dtype).min)
            inputs["attention_mask"] = {"full_attention": mask, "linear_attention": None}
        hidden = model(**inputs).last_hidden_state
        last = hidden[torch.arange(batch, device=model.device), torch.from_numpy(lengths - 1).to(model.device)]
        # The readout on the model's device once, in fp32 as the spec reads it.
        logits = last.float() @ self.on_device("readout", lambda: ref.readout("weight").t(), model.device)
        if ref.readout_bias is not None:
            logits = logits + self.on_device("bias", lambda: ref.readout("bias"), model.device)
        return [Readout(dict(enumerate(row))) for row in logits.cpu().tolist()]
