"""d1's token batches and requests for `systemone bench` (export/workload.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ...models.family import Readout
from ...runtime.batch import TextRow
from ...runtime.d1.label_reads import label_logprobs
from ...runtime.engine import Prepared
from ...runtime.service import DecisionService
from ..workload import Workload

SNAKE_STATE = {"game": "snake", "board": {"width": 12, "height": 12}, "snake": [[5, 5], [5, 6], [5, 7], [6, 7]],
               "direction": "up", "food": [[2, 3]], "score": 3, "turn": 41,
               "walls": [[0, 0], [0, 11], [11, 0], [11, 11]], "last_moves": ["up", "up", "left", "up"]}
SNAKE_QUESTIONS = {"move": {"type": "choice", "instructions": "Which move gets closer to the food safely?",
                            "criteria": {"up": None, "down": None, "left": None, "right": None}}}


class D1Workload(Workload):
    def __init__(self, service: DecisionService, reference: Any, vocab: int):
        super().__init__(service, reference, vocab)
        from .gates import label_ids

        self.labels = label_ids(service.artifact.tokenizer.encode)

    def runtime_batch(self, ids: np.ndarray) -> np.ndarray:
        rows = [TextRow(row.tolist(), label_ids=tuple(self.labels)) for row in ids]
        logprobs, _ = label_logprobs(self.service.engine.runner.run_rows(rows), self.labels)
        return logprobs

    def torch_inputs(self, model: Any, ids: np.ndarray) -> dict[str, Any]:
        import torch

        return {"input_ids": torch.from_numpy(ids).to(next(model.parameters()).device)}

    def torch_logits(self, model: Any, inputs: dict[str, Any]) -> Any:
        import torch

        # Only the last position's logits, as a server computes them (not the LM head on every token).
        logits = model(**inputs, logits_to_keep=1).logits[:, -1].float()
        labels = self.on_device("labels", lambda: torch.tensor(self.labels), logits.device)
        return torch.log_softmax(logits, dim=-1)[:, labels]

    @staticmethod
    def requests() -> dict[str, Callable[[int], dict[str, Any]]]:
        from ..sample_media import image_url
        from .answer_parity import sixteen_questions

        # The same pixels as a PNG and as a JPEG: the PNG's decode (its noise does not compress) is the larger
        # share of the request's host time, and photos arrive as JPEGs.
        images = {fmt: image_url(1024, 1024, seed=7, fmt=fmt) for fmt in ("PNG", "JPEG")}

        def one(i: int) -> dict[str, Any]:
            return {"state": {**SNAKE_STATE, "turn": 41 + i}, "questions": SNAKE_QUESTIONS}

        def sixteen(i: int) -> dict[str, Any]:
            body = sixteen_questions(with_image=False)
            body["state"]["tier"] = f"gold-{i}"
            return body

        def sixteen_image(fmt: str) -> Callable[[int], dict[str, Any]]:
            return lambda i: {**sixteen(i), "images": [images[fmt]]}

        return {"one_question": one, "sixteen_questions": sixteen,
                "sixteen_questions_1024px_image": sixteen_image("PNG"),
                "sixteen_questions_1024px_jpeg": sixteen_image("JPEG")}

    def torch_answers(self, model: Any, prepared: Prepared) -> list[Readout]:
        import torch

        from .answer_parity import model_pixels

        ids, lengths = self.padded(model, prepared)
        embeds = model.get_input_embeddings()(ids)
        pixels = model_pixels(prepared.media.in_order()) if prepared.media is not None else None
        if pixels is not None:
            tensors = {k: torch.as_tensor(v).to(model.device) for k, v in pixels.items()}
            tensors["pixel_values"] = tensors["pixel_values"].to(model.dtype)
            features = torch.cat(model.model.get_image_features(**tensors).pooler_output)
            # Every prompt holds the image tokens once, in the same order: the features fill each row's in turn.
            embeds[ids == model.config.image_token_id] = features.to(embeds.dtype).repeat(len(lengths), 1)
        hidden = model.model(inputs_embeds=embeds).last_hidden_state
        last = hidden[torch.arange(len(lengths), device=model.device), torch.from_numpy(lengths - 1).to(model.device)]
        logprobs = torch.log_softmax(model.lm_head(last).float(), dim=-1).cpu().numpy()
        return [Readout({i: float(row[i]) for i in labels.ids}, int(np.argmax(row)))
                for row, labels in zip(logprobs, prepared.labels, strict=True)]
