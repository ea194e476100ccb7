"""`systemone bench`: the runtime against the torch model it replaces, side by side in one process, on one
checkpoint and its artifact.

- Token batches: the same random token ids (batch x length) through the runtime's text graph and through
  transformers eager (each dtype asked for), timed as medians; the runtime's numbers are checked against the fp32
  reference on the same batches, so a fast wrong graph cannot pass for a fast one.
- Whole requests through `DecisionService.decide` (a new prompt length each time): p50 and p99.
- GPU memory (the device's used memory while serving; torch's peak allocation) and the artifact's size.

It needs the export extra (torch, transformers): the reference is the export's own (`ExportConfig`).
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .gpu_memory import device_used_mib
from .models.registry import FAMILIES
from .runtime.artifact import Artifact
from .runtime.engine import EngineOptions
from .runtime.service import DecisionService

SNAKE_STATE = {"game": "snake", "board": {"width": 12, "height": 12}, "snake": [[5, 5], [5, 6], [5, 7], [6, 7]],
               "direction": "up", "food": [[2, 3]], "score": 3, "turn": 41,
               "walls": [[0, 0], [0, 11], [11, 0], [11, 11]], "last_moves": ["up", "up", "left", "up"]}
SNAKE_QUESTIONS = {"move": {"type": "choice", "instructions": "Which move gets closer to the food safely?",
                            "criteria": {"up": None, "down": None, "left": None, "right": None}}}


def percentile_ms(times: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(times) * 1000.0, q))


def timed(fn: Callable[[], Any], repeats: int, sync: Callable[[], None] = lambda: None) -> list[float]:
    """Wall times of `repeats` calls after one warm-up call."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def directory_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


@dataclass
class Workload(ABC):
    """A family's batches and requests: how to run a token batch through the runtime and through torch."""

    service: DecisionService | None  # None once its form is measured
    reference: Any  # the family's ExportConfig (torch model on the reference device)
    vocab: int

    @abstractmethod
    def runtime_batch(self, ids: np.ndarray) -> np.ndarray:
        """The runtime's numbers for a [B, L] batch of token ids (the graph run only)."""

    @abstractmethod
    def torch_batch(self, model: Any, ids: np.ndarray) -> np.ndarray:
        """The same numbers from the torch model (`model`: the reference's, moved to a device and dtype)."""

    @staticmethod
    @abstractmethod
    def requests() -> dict[str, Callable[[int], dict[str, Any]]]:
        """Whole-request kinds: name -> the i-th request body."""


class D3Workload(Workload):
    def runtime_batch(self, ids: np.ndarray) -> np.ndarray:
        return self.service.engine.runner.run([row.tolist() for row in ids])

    def torch_batch(self, model: Any, ids: np.ndarray) -> np.ndarray:
        import torch

        ref = self.reference
        device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
        batch, length = ids.shape
        inputs: dict[str, Any] = {"input_ids": torch.from_numpy(ids).to(device),
                                  "position_ids": torch.arange(length, device=device).view(1, 1, -1)
                                  .expand(3, batch, length)}
        if ref.attention_mode == "noncausal_full_attention":
            inputs["attention_mask"] = {"full_attention": torch.zeros(batch, 1, length, length, dtype=dtype,
                                                                      device=device), "linear_attention": None}
        with torch.no_grad():
            hidden = model(**inputs).last_hidden_state[:, -1].float()
            logits = hidden @ ref.readout_weight.to(device).t()
            if ref.readout_bias is not None:
                logits = logits + ref.readout_bias.to(device)
        return logits.cpu().numpy()

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


class D1Workload(Workload):
    def __init__(self, service: DecisionService, reference: Any, vocab: int):
        super().__init__(service, reference, vocab)
        from .export.d1.gates import label_ids

        self.labels = label_ids(service.artifact.tokenizer.encode)

    def runtime_batch(self, ids: np.ndarray) -> np.ndarray:
        logprobs, _ = self.service.engine.runner.whole_logprobs([row.tolist() for row in ids], self.labels)
        return logprobs

    def torch_batch(self, model: Any, ids: np.ndarray) -> np.ndarray:
        import torch

        device = next(model.parameters()).device
        with torch.no_grad():
            # Only the last position's logits, as a server computes them (not the LM head on every token).
            logits = model(input_ids=torch.from_numpy(ids).to(device), logits_to_keep=1).logits[:, -1].float()
        return torch.log_softmax(logits, dim=-1)[:, self.labels].cpu().numpy()

    @staticmethod
    def requests() -> dict[str, Callable[[int], dict[str, Any]]]:
        from .export.d1.answer_parity import sixteen_questions
        from .export.sample_media import image_url

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


WORKLOADS = {"d3": D3Workload, "d1": D1Workload}


def form_bytes(artifact: Artifact) -> int:
    """Bytes on disk of the graphs `artifact` runs in its form (external weights included)."""
    paths = [artifact.graph_path(name) for name in artifact.manifest.graphs]
    return sum(p.stat().st_size for path in paths for p in (path, path.with_name(path.name + ".data")) if p.is_file())


def bench_form(work: Workload, token_batches: dict[tuple[int, int], np.ndarray], repeats: int,
               request_repeats: int, log: Callable[[str], None]) -> tuple[dict[str, Any], dict[tuple[int, int], Any]]:
    """One form's token batches and whole requests; its report and its outputs per batch."""
    service = work.service
    label = f"{service.form} (cuda graphs)" if service.captures else service.form
    report: dict[str, Any] = {"provider": service.provider, "graph_bytes": form_bytes(service.artifact),
                              "batches": [], "requests": {}}
    # Measured as serve measures it at start-up: the rows a shared call takes and the cost model by which a
    # request's questions are grouped into calls.
    report["batch_sizing"] = service.batch_sizing().describe()
    log(f"{label:>10s} batch rows: {report['batch_sizing']}")
    outputs: dict[tuple[int, int], np.ndarray] = {}
    for (b, n), ids in token_batches.items():
        def run_runtime(ids: np.ndarray = ids, key: tuple[int, int] = (b, n)) -> None:
            outputs[key] = work.runtime_batch(ids)

        times = timed(run_runtime, repeats)
        row = {"batch": b, "length": n, "runtime_ms": percentile_ms(times, 50),
               "runtime_questions_per_s": b / float(np.median(times))}
        report["batches"].append(row)
        log(f"{label:>10s} batch {b:3d} x {n:5d}: {row['runtime_ms']:9.2f} ms  "
            f"{row['runtime_questions_per_s']:8.1f} q/s")
    for name, make in work.requests().items():
        times = timed(lambda i=iter(range(10**6)): service.decide(make(next(i))), request_repeats)
        report["requests"][name] = {"p50_ms": percentile_ms(times, 50), "p99_ms": percentile_ms(times, 99),
                                    "runs": len(times)}
        log(f"{label:>10s} request {name}: p50 {report['requests'][name]['p50_ms']:.2f} ms, p99 "
            f"{report['requests'][name]['p99_ms']:.2f} ms")
    return report, outputs


def run_bench(checkpoint: Path, artifact_dir: Path, device: str = "cpu", batches: tuple[int, ...] = (1, 8, 32, 64),
              lengths: tuple[int, ...] = (200, 1000), repeats: int = 10, request_repeats: int = 30,
              torch_dtypes: tuple[str, ...] = ("bfloat16", "float32"), max_tokens: int = 65536,
              forms: tuple[str, ...] | None = None, gpu_memory: int | None = None, cuda_graphs: bool = True,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Each form of the artifact for `device` (default: every one it has; with and without CUDA graphs where it
    captures them), then transformers eager in each of `torch_dtypes`, on the same token batches."""
    import gc

    import torch

    entry = FAMILIES.recognise(checkpoint)
    artifact = Artifact.load(artifact_dir)
    if artifact.manifest.family != entry.name:
        raise ValueError(f"{artifact_dir} is a {artifact.manifest.family} artifact; {checkpoint} is {entry.name}")
    reference = entry.load_export_config()(checkpoint)
    vocab = 150_000 if entry.name == "d3" else int(reference.text_config.vocab_size)
    torch_device = "cuda" if device == "cuda" else "cpu"
    sync = torch.cuda.synchronize if torch_device == "cuda" else (lambda: None)
    rng = np.random.default_rng(0)
    report: dict[str, Any] = {"family": entry.name, "checkpoint": str(checkpoint), "device": device,
                              "artifact_bytes": directory_bytes(artifact_dir), "gpu_memory_limit_bytes": gpu_memory,
                              "bf16_weight_bytes": 2 * sum(p.numel() for p in reference.model.parameters()),
                              "forms": {}}
    shapes = [(b, n) for n in lengths for b in batches if b * n <= max_tokens]
    token_batches = {shape: rng.integers(0, vocab, shape) for shape in shapes}

    outputs: dict[str, dict[tuple[int, int], np.ndarray]] = {}
    work: Workload | None = None
    # Each form as serve runs it; a form whose small batches replay CUDA graphs also uncaptured, beside it.
    queue = [(form, cuda_graphs) for form in forms or tuple(artifact.forms_for(device))]
    while queue:
        form, capture = queue.pop(0)
        name = f"{form} uncaptured" if cuda_graphs and not capture else form
        work = None
        gc.collect()  # the last form's sessions (and their device arenas) go before this one is measured
        before = device_used_mib()
        service = DecisionService(artifact, EngineOptions(device=device, form=form, gpu_memory=gpu_memory,
                                                          cuda_graphs=capture))
        # As serve starts: the call cost measured first, uncaptured (it groups d1's suffix reads, which never
        # replay), then the CUDA graphs captured on this thread, which runs every timed call.
        service.batch_sizing()
        service.warm_up()
        work = WORKLOADS[entry.name](service, reference, vocab)
        form_report, outputs[name] = bench_form(work, token_batches, repeats, request_repeats, log)
        serving = device_used_mib()
        form_report["gpu_memory_serving_mib"] = None if serving is None or before is None else serving - before
        form_report["cuda_graphs"] = service.cuda_graphs
        if service.captures:
            queue.insert(0, (form, False))
        report["forms"][name] = form_report
        del service
    assert work is not None, "no form to bench"
    work.service = None  # the last form's sessions (and device arena) go before torch is measured
    gc.collect()

    # float32 first: the bf16 copy is made in place, so the fp32 weights must be used before it.
    base_model = reference.model
    for dtype_name in sorted(torch_dtypes, key=lambda d: d != "float32"):
        model = base_model.to(torch_device, getattr(torch, dtype_name))
        if torch_device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        torch_rows = []
        for (b, n), ids in token_batches.items():
            out: dict[str, np.ndarray] = {}

            def run(ids: np.ndarray = ids) -> None:
                out["logits"] = work.torch_batch(model, ids)

            times = timed(run, max(1, repeats // 2), sync)
            seconds = float(np.median(times))
            torch_rows.append({"batch": b, "length": n, "ms": percentile_ms(times, 50)})
            log(f"torch {dtype_name:8s} batch {b:3d} x {n:5d}: {torch_rows[-1]['ms']:9.2f} ms")
            for form, form_report in report["forms"].items():
                row = next(r for r in form_report["batches"] if (r["batch"], r["length"]) == (b, n))
                row[f"runtime_over_torch_{dtype_name}"] = seconds / (row["runtime_ms"] / 1000.0)
                if dtype_name == "float32":
                    row["max_abs_diff_vs_torch_float32"] = float(np.abs(outputs[form][b, n] - out["logits"]).max())
        report[f"torch_{dtype_name}"] = {"batches": torch_rows}
        if torch_device == "cuda":
            report[f"torch_{dtype_name}"]["peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return report


def write_report(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2), encoding="utf-8")
