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

from . import torch_runtime
from .export.workload import Workload
from .models.family import Readout
from .models.registry import FAMILIES
from .runtime.artifact import Artifact
from .runtime.engine import Engine, EngineOptions, Prepared
from .runtime.pixel_workers import default_processes
from .runtime.service import DecisionService


class TorchEngine(Engine):
    """Our engine's `prepare`; the torch model for `run`, read by the family's workload
    (`ExportConfig.workload.torch_answers`): vision once per request, one padded forward for all of the request's
    questions."""

    def __init__(self, inner: Engine, work: Workload, model: Any):
        self.inner = inner
        self.work = work
        self.model = model
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
            readouts = self.work.torch_answers(self.model, prepared)
        self.forwards += 1
        self.vision_runs += prepared.media is not None
        return readouts


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
    work = reference.workload(service, reference, reference.random_token_bound())
    service.engine = TorchEngine(service.engine, work, model)
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
