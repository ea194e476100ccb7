"""The reference server `systemone bench --serve` measures us against: the checkpoint's own runtime served as a
competent torch server would serve it, behind the same FastAPI app.

- The model as systemone/torch_runtime.py loads it: transformers' default attention, flash-linear-attention's
  Gated DeltaNet kernels and causal-conv1d where they import, bf16 on CUDA (fp32 on the CPU).
- A request's media through the model's vision tower once (each distinct input once), however many questions ask
  about it; then all of its questions in one padded forward, each read at its last token.
- Media fetched and decoded in the media pool's threads and turned into pixel rows in its worker processes, as our
  server does (`--media-processes`, default as serve's).

It answers from the same prompts, labels and media pixels our engine prepares, so the two servers read identical
token ids and pixels. Needs the export extra (torch, transformers).

    python -m systemone.reference_server CHECKPOINT --artifact ART [--device cuda] [--dtype auto] [--port 8001]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from . import torch_runtime
from .models.family import Readout
from .models.registry import FAMILIES
from .runtime.artifact import Artifact
from .runtime.engine import Engine, EngineOptions, Prepared
from .runtime.pixel_workers import default_processes
from .runtime.service import DecisionService


class TorchEngine(Engine):
    """Our engine's `prepare`; the torch model for `run`: vision once per request, one padded forward for all of
    the request's questions."""

    def __init__(self, inner: Engine, reference: Any, model: Any):
        self.inner = inner
        self.reference = reference  # the family's ExportConfig: readout and attention mode (d3)
        self.model = model
        if inner.family.name == "d3":  # the readout on the model's device once, in fp32 as the spec reads it
            self.readout = reference.readout("weight").to(model.device).t()
            self.readout_bias = None if reference.readout_bias is None else reference.readout("bias").to(model.device)
        self.family = inner.family
        self.max_model_len = inner.max_model_len
        self.session = inner.session
        self.unsupported = inner.unsupported
        self.media = inner.media
        self.forwards = 0  # padded forwards of the language model run (one a request)
        self.vision_runs = 0  # vision tower runs (at most one a request)

    def draft(self, request: Any, questions: list[Any]) -> Any:
        return self.inner.draft(request, questions)

    def prepare(self, request: Any, questions: list[Any], media: Any = None, draft: Any = None) -> Prepared:
        return self.inner.prepare(request, questions, media, draft)

    def run(self, prepared: Prepared, run_options: Any = None) -> list[Readout]:
        import torch

        with torch.inference_mode():
            if self.family.name == "d3":
                return self._run_d3(prepared)
            return self._run_d1(prepared)

    def _padded(self, prepared: Prepared) -> tuple[Any, np.ndarray]:
        """The prompts' token ids right-padded into one [B, L] batch on the model's device, and their lengths: a
        prompt's tokens come before its padding, so no causal layer (Gated DeltaNet, the short convolutions,
        causal attention) sees it, and d3's bidirectional attention masks it."""
        import torch

        lengths = np.array([len(p.token_ids) for p in prepared.prompts])
        ids = np.zeros((len(lengths), int(lengths.max())), np.int64)
        for row, prompt in enumerate(prepared.prompts):
            ids[row, :lengths[row]] = prompt.token_ids
        return torch.from_numpy(ids).to(self.model.device), lengths

    def _d3_vision(self, media: Any) -> Any:
        """The rows of the request's media in prompt order, each distinct input through the tower once, all of them
        in one run."""
        import torch

        model, loaded = self.model, media.loaded
        keys = list(loaded.items)
        items = [loaded.items[key] for key in keys]
        pixels = torch.from_numpy(np.concatenate([item.pixels for item in items])).to(model.device, model.dtype)
        grids = torch.tensor([list(item.grid) for item in items], device=model.device)
        rows = model.visual(pixels, grid_thw=grids).pooler_output
        self.vision_runs += 1
        merge = int(model.config.vision_config.spatial_merge_size) ** 2
        sizes = [int(np.prod(item.grid)) // merge for item in items]
        parts = dict(zip(keys, torch.split(rows, sizes), strict=True))
        return torch.cat([parts[key] for key in loaded.keys])

    def _run_d3(self, prepared: Prepared) -> list[Readout]:
        import torch

        model, ref = self.model, self.reference
        ids, lengths = self._padded(prepared)
        batch, width = ids.shape
        embeds = model.get_input_embeddings()(ids)
        if prepared.media is not None:  # the same positions in every prompt (they share the media prefix)
            embeds[:, torch.from_numpy(prepared.media.positions).to(model.device)] = \
                self._d3_vision(prepared.media).to(embeds.dtype)
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
        self.forwards += 1
        last = hidden[torch.arange(batch, device=model.device), torch.from_numpy(lengths - 1).to(model.device)]
        logits = last.float() @ self.readout
        if self.readout_bias is not None:
            logits = logits + self.readout_bias
        return [Readout(dict(enumerate(row))) for row in logits.cpu().tolist()]

    def _run_d1(self, prepared: Prepared) -> list[Readout]:
        import torch

        from .export.d1.answer_parity import model_pixels

        model = self.model
        ids, lengths = self._padded(prepared)
        embeds = model.get_input_embeddings()(ids)
        pixels = model_pixels(prepared.media.in_order()) if prepared.media is not None else None
        if pixels is not None:
            tensors = {k: torch.as_tensor(v).to(model.device) for k, v in pixels.items()}
            tensors["pixel_values"] = tensors["pixel_values"].to(model.dtype)
            features = torch.cat(model.model.get_image_features(**tensors).pooler_output)
            self.vision_runs += 1
            # Every prompt holds the image tokens once, in the same order: the features fill each row's in turn.
            embeds[ids == model.config.image_token_id] = features.to(embeds.dtype).repeat(len(lengths), 1)
        hidden = model.model(inputs_embeds=embeds).last_hidden_state
        self.forwards += 1
        last = hidden[torch.arange(len(lengths), device=model.device), torch.from_numpy(lengths - 1).to(model.device)]
        logprobs = torch.log_softmax(model.lm_head(last).float(), dim=-1).cpu().numpy()
        return [Readout({i: float(row[i]) for i in labels.ids}, int(np.argmax(row)))
                for row, labels in zip(logprobs, prepared.labels, strict=True)]


def reference_service(checkpoint: Path, artifact_dir: Path, device: str = "cpu", dtype: str = "auto",
                      served_model_names: list[str] | None = None,
                      media_processes: int | None = None) -> DecisionService:
    """A service whose engine is the checkpoint's own runtime (`dtype` auto: bf16 on CUDA, fp32 on the CPU); the
    ONNX graphs are never run."""

    entry = FAMILIES.recognise(checkpoint)
    artifact = Artifact.load(artifact_dir)
    # Our engine prepares the requests; its graphs are never run. Opened on the CPU where the artifact has the
    # portable graphs; a CUDA-only artifact's fused ops have no CPU kernels in onnxruntime-gpu, so it is opened
    # on the device.
    on = "cpu" if artifact.forms_for("cpu") else device
    service = DecisionService(artifact, EngineOptions(device=on), served_model_names,
                              media_processes=default_processes() if media_processes is None else media_processes)
    reference = entry.load_export_config()(checkpoint)
    model_class = type(reference.skeleton.model)  # served as a user loads it, not as the export's fp32 reference
    torch_device = "cuda" if device == "cuda" else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if torch_device == "cuda" else "float32"
    model = torch_runtime.load_model(model_class, checkpoint, dtype, torch_device)
    service.engine = TorchEngine(service.engine, reference, model)
    return service


def main() -> None:
    import uvicorn

    from .server.app import create_app

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--artifact", required=True, help="an artifact of the same checkpoint (prompts, media)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="auto: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--media-processes", type=int, default=None,
                        help="processes that make pixel rows, as serve's flag (default: all cores but two, at most "
                             "16; none below 6 cores)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    args = parser.parse_args()
    service = reference_service(Path(args.checkpoint), Path(args.artifact), args.device, args.dtype,
                                media_processes=args.media_processes)
    engine = service.engine
    print(f"reference server: {type(engine.model).__name__} {engine.model.dtype} on {engine.model.device}; "
          f"media: {service.media_pool.describe()}", flush=True)
    print(f"reference server: {torch_runtime.summary(torch_runtime.describe(engine.model))}", flush=True)
    uvicorn.run(create_app(service), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
