"""The reference server `systemone bench --serve` measures us against: the checkpoint's own runtime's way,
transformers eager (bf16 by default), one question at a time, behind the same FastAPI app.

It answers from the same prompts, labels and media our engine prepares (so the two servers read identical token
ids and pixels) but runs the torch model question by question on each whole prompt, with the model's own vision
tower. Needs the export extra (torch, transformers).

    python -m systemone.reference_server CHECKPOINT --artifact ART [--device cuda] [--dtype bfloat16] [--port 8001]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from .models.family import Readout
from .models.registry import FAMILIES
from .runtime.artifact import Artifact
from .runtime.engine import Engine, EngineOptions, Prepared
from .runtime.service import DecisionService


class TorchEngine(Engine):
    """Our engine's `prepare`; transformers eager for `run`, one question at a time."""

    def __init__(self, inner: Engine, reference: Any):
        self.inner = inner
        self.reference = reference
        self.family = inner.family
        self.max_model_len = inner.max_model_len
        self.session = inner.session
        self.unsupported = inner.unsupported
        self.media = inner.media

    def draft(self, request: Any, questions: list[Any]) -> Any:
        return self.inner.draft(request, questions)

    def prepare(self, request: Any, questions: list[Any], media: Any = None, draft: Any = None) -> Prepared:
        return self.inner.prepare(request, questions, media, draft)

    def run(self, prepared: Prepared, run_options: Any = None) -> list[Readout]:
        if self.family.name == "d3":
            return self._run_d3(prepared)
        return self._run_d1(prepared)

    def _run_d3(self, prepared: Prepared) -> list[Readout]:
        ref = self.reference
        media: dict[str, Any] = {}
        if prepared.media is not None:
            items = prepared.media.loaded.in_order()
            for kind, name in (("image", "images"), ("video", "videos")):
                chosen = [item for item in items if item.kind == kind]
                if chosen:
                    media[name] = (np.concatenate([i.pixels for i in chosen]), [i.grid for i in chosen])
        out = []
        for prompt in prepared.prompts:
            if media:
                logits = ref.reference_logits_with_media(prompt.token_ids, prompt.positions, **media)
            else:
                logits = ref.reference_logits(prompt.token_ids, prompt.positions)
            out.append(Readout(dict(enumerate(logits.tolist()))))
        return out

    def _run_d1(self, prepared: Prepared) -> list[Readout]:
        from .export.d1.answer_parity import model_pixels

        pixels = model_pixels(prepared.media.in_order()) if prepared.media is not None else None
        out = []
        for prompt, labels in zip(prepared.prompts, prepared.labels):
            logprobs = self.reference.reference_logprobs(prompt.token_ids, pixels=pixels)
            out.append(Readout({i: float(logprobs[i]) for i in labels.ids}, int(np.argmax(logprobs))))
        return out


def reference_service(checkpoint: Path, artifact_dir: Path, device: str = "cpu", dtype: str = "bfloat16",
                      served_model_names: list[str] | None = None) -> DecisionService:
    """A service whose engine is transformers eager; the ONNX graphs are opened on the CPU and never run."""
    import torch

    entry = FAMILIES.recognise(checkpoint)
    service = DecisionService(Artifact.load(artifact_dir), EngineOptions(device="cpu"), served_model_names)
    reference = entry.load_export_config()(checkpoint)
    reference.model.to("cuda" if device == "cuda" else "cpu", getattr(torch, dtype))
    service.engine = TorchEngine(service.engine, reference)
    return service


def main() -> None:
    import uvicorn

    from .server.app import create_app

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--artifact", required=True, help="an artifact of the same checkpoint (prompts, media)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    args = parser.parse_args()
    service = reference_service(Path(args.checkpoint), Path(args.artifact), args.device, args.dtype)
    uvicorn.run(create_app(service), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
