"""`systemone bench`: the runtime against the checkpoint's own runtime at its best, side by side in one process, on
one checkpoint and its artifact.

- Token batches: the same random token ids (batch x length) through the runtime's text graph and through the
  family's transformers model as a user runs it (systemone/torch_runtime.py: transformers' default attention, the
  flash-linear-attention / causal-conv1d kernels where they import; bf16 by default). Both sides get the same number
  of timed runs, taken in turn (ours, torch, ours, torch...), and the spread of each is reported; at batch 1 on
  CUDA torch is also timed replaying a CUDA graph, so the ratio is not only against host-bound eager. The runtime's
  numbers are checked against fp32 torch on the same batches, so a fast wrong graph cannot pass for a fast one.
- What the torch side ran: versions, attention implementation, the kernels transformers chose, and the profiler's
  top kernels of one call.
- Whole requests through `DecisionService.decide` (a new prompt length each time): p50 and p99.
- GPU memory (the device's used memory while serving; torch's peak allocation) and the artifact's size.

It needs the export extra (torch, transformers): the model class and readout are the export's own (`ExportConfig`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .gpu_memory import device_used_mib
from .models.registry import FAMILIES
from .runtime.artifact import Artifact
from .runtime.engine import EngineOptions
from .export.workload import Workload
from .runtime.service import DecisionService

def percentile_ms(times: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(times) * 1000.0, q))


def timed(fn: Callable[[], Any], repeats: int, sync: Callable[[], None] = lambda: None) -> list[float]:
    """Wall times of `repeats` calls after one warm-up call."""
    return alternated({"": fn}, repeats, sync)[""]


def alternated(calls: dict[str, Callable[[], Any]], repeats: int,
               sync: Callable[[], None] = lambda: None) -> dict[str, list[float]]:
    """Wall times of `repeats` calls of each of `calls`, taken in turn (one of each a round, in order) after one
    warm-up call of each: a drift of the machine (clocks, other load) falls on every side alike."""
    for fn in calls.values():
        fn()
        sync()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return times


def spread_ms(times: list[float]) -> dict[str, float]:
    """min, p10, median, p90 and max of `times` (seconds) in ms."""
    ms = np.asarray(times) * 1000.0
    return {"min": float(ms.min()), "p10": float(np.percentile(ms, 10)), "median": float(np.median(ms)),
            "p90": float(np.percentile(ms, 90)), "max": float(ms.max())}


def capture_cuda_graph(forward: Callable[[], Any]) -> Callable[[], np.ndarray]:
    """`forward` (device tensors in, a device tensor out, fixed shapes) captured once as a CUDA graph after three
    warm-up calls on a side stream (kernels autotune and allocate outside the capture); the replay returns its
    output on the host."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream):
        for _ in range(3):
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = forward()

    def replay() -> np.ndarray:
        graph.replay()
        return out.float().cpu().numpy()

    return replay


def directory_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())




def form_bytes(artifact: Artifact) -> int:
    """Bytes on disk of the graphs `artifact` runs in its form (external weights included)."""
    paths = [artifact.graph_path(name) for name in artifact.manifest.graphs]
    return sum(p.stat().st_size for path in paths for p in (path, path.with_name(path.name + ".data")) if p.is_file())


@dataclass
class TorchSide:
    """One dtype of the torch model as the bench times it, and its CUDA graphs at batch 1 (or why there are none),
    captured once and replayed for every form."""

    dtype: str
    model: Any
    graphs: dict[tuple[int, int], Callable[[], np.ndarray] | str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"torch_{self.dtype}"


def torch_graph(side: TorchSide, work: Workload, ids: np.ndarray, eager: np.ndarray) -> Callable[[], np.ndarray] | str:
    """The side's CUDA-graph replay for `ids`, or why there is none: the capture failed, or its replay does not give
    eager's numbers."""
    key = ids.shape
    if key not in side.graphs:
        try:
            inputs = work.torch_inputs(side.model, ids)
            replay = capture_cuda_graph(lambda: work.torch_logits(side.model, inputs))
            diff = float(np.abs(replay() - eager).max())
            # Replay runs the same kernels on the same inputs: past rounding noise (a GEMM may pick another
            # algorithm under capture) the capture is broken.
            bound = 2e-2 * max(1.0, float(np.abs(eager).max()))
            side.graphs[key] = replay if diff <= bound else f"its replay differs from eager by {diff:.3g}"
        except Exception as exc:  # a host sync or an allocation inside the capture: eager is then all there is
            side.graphs[key] = f"capture failed: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    return side.graphs[key]


def bench_form(work: Workload, token_batches: dict[tuple[int, int], np.ndarray], sides: list[TorchSide],
               references: dict[tuple[int, int], np.ndarray], repeats: int, request_repeats: int,
               log: Callable[[str], None], sync: Callable[[], None] = lambda: None,
               torch_cuda_graphs: bool = False) -> dict[str, Any]:
    """One form's token batches, each timed in turn with every torch side, and its whole requests."""
    service = work.service
    label = f"{service.form} (cuda graphs)" if service.captures else service.form
    report: dict[str, Any] = {"provider": service.provider, "graph_bytes": form_bytes(service.artifact),
                              "batches": [], "requests": {}}
    # Measured as serve measures it at start-up: the rows a shared call takes and the cost model by which a
    # request's questions are grouped into calls.
    report["batch_sizing"] = service.batch_sizing().describe()
    log(f"{label:>10s} batch rows: {report['batch_sizing']}")
    for (b, n), ids in token_batches.items():
        out: dict[str, np.ndarray] = {}

        def ours(ids: np.ndarray = ids) -> None:
            out["ours"] = work.runtime_batch(ids)

        calls: dict[str, Callable[[], Any]] = {"ours": ours}
        row: dict[str, Any] = {"batch": b, "length": n}
        for side in sides:
            calls[side.name] = lambda side=side, ids=ids: work.torch_batch(side.model, ids)
            if torch_cuda_graphs and b == 1:
                graph = torch_graph(side, work, ids, work.torch_batch(side.model, ids))
                if callable(graph):
                    calls[f"{side.name}_cuda_graph"] = graph
                    row["torch_against"] = "eager and CUDA graphs"
                else:
                    row["torch_against"] = f"host-bound eager (torch CUDA graphs: {graph})"
        times = alternated(calls, repeats, sync)
        ours_s = float(np.median(times["ours"]))
        row.update({"runs": len(times["ours"]), "runtime_ms": ours_s * 1000.0,
                    "runtime_ms_spread": spread_ms(times["ours"]), "runtime_questions_per_s": b / ours_s,
                    "torch": {}})
        for name, taken in times.items():
            if name == "ours":
                continue
            seconds = float(np.median(taken))
            key = name.removeprefix("torch_")
            row["torch"][key] = {"runs": len(taken), "ms": seconds * 1000.0, "spread": spread_ms(taken),
                                 "questions_per_s": b / seconds}
            # Above 1: the runtime is that many times faster than torch on this batch.
            row[f"speedup_over_torch_{key}"] = seconds / ours_s
        row["max_abs_diff_vs_torch_float32"] = float(np.abs(out["ours"] - references[b, n]).max())
        report["batches"].append(row)
        spread = row["runtime_ms_spread"]
        torch_text = "  ".join(f"torch {key} {t['ms']:9.2f} ms [{t['spread']['p10']:.2f}-{t['spread']['p90']:.2f}] "
                               f"speedup {row[f'speedup_over_torch_{key}']:.2f}x" for key, t in row["torch"].items())
        log(f"{label:>10s} batch {b:3d} x {n:5d}: ours {row['runtime_ms']:9.2f} ms [{spread['p10']:.2f}-"
            f"{spread['p90']:.2f}] {row['runtime_questions_per_s']:8.1f} q/s  {torch_text}"
            + (f"  ({row['torch_against']})" if "torch_against" in row else ""))
    for name, make in work.requests().items():
        times = timed(lambda i=iter(range(10**6)): service.decide(make(next(i))), request_repeats)
        report["requests"][name] = {"p50_ms": percentile_ms(times, 50), "p99_ms": percentile_ms(times, 99),
                                    "runs": len(times)}
        log(f"{label:>10s} request {name}: p50 {report['requests'][name]['p50_ms']:.2f} ms, p99 "
            f"{report['requests'][name]['p99_ms']:.2f} ms")
    return report


def run_bench(checkpoint: Path, artifact_dir: Path, device: str = "cpu", batches: tuple[int, ...] = (1, 8, 32, 64),
              lengths: tuple[int, ...] = (200, 1000), repeats: int = 10, request_repeats: int = 30,
              torch_dtypes: tuple[str, ...] = ("bfloat16",), max_tokens: int = 65536,
              forms: tuple[str, ...] | None = None, gpu_memory: int | None = None, cuda_graphs: bool = True,
              torch_cuda_graphs: bool = True, shapes: tuple[tuple[int, int], ...] | None = None,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Each form of the artifact for `device` (default: every one it has; with and without CUDA graphs where it
    captures them), timed in turn with the checkpoint's own runtime in each of `torch_dtypes` on the same token
    batches (`shapes`, or each of `batches` at each of `lengths` up to `max_tokens`), and checked against that
    runtime in fp32."""
    import gc

    import torch

    from . import torch_runtime

    entry = FAMILIES.recognise(checkpoint)
    artifact = Artifact.load(artifact_dir)
    if artifact.manifest.family != entry.name:
        raise ValueError(f"{artifact_dir} is a {artifact.manifest.family} artifact; {checkpoint} is {entry.name}")
    reference = entry.load_export_config()(checkpoint)
    vocab = reference.random_token_bound()
    torch_device = "cuda" if device == "cuda" else "cpu"
    sync = torch.cuda.synchronize if torch_device == "cuda" else (lambda: None)
    rng = np.random.default_rng(0)
    report: dict[str, Any] = {"family": entry.name, "checkpoint": str(checkpoint), "device": device,
                              "artifact_bytes": directory_bytes(artifact_dir), "gpu_memory_limit_bytes": gpu_memory,
                              "bf16_weight_bytes": 2 * reference.skeleton.parameter_count(),
                              "forms": {}}
    shapes = shapes or tuple((b, n) for n in lengths for b in batches if b * n <= max_tokens)
    token_batches = {shape: rng.integers(0, vocab, shape) for shape in shapes}
    # The export's reference model (fp32) is not what is timed: each side is loaded fresh with transformers'
    # defaults.
    model_class = type(reference.skeleton.model)
    if torch_device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sides = [TorchSide(dtype, torch_runtime.load_model(model_class, checkpoint, dtype, torch_device))
             for dtype in torch_dtypes]
    check = next((side.model for side in sides if side.dtype == "float32"), None)
    if check is None:  # fp32 is the check's, untimed unless asked for
        check = torch_runtime.load_model(model_class, checkpoint, "float32", torch_device)
    described = torch_runtime.describe(sides[0].model if sides else check)
    report["torch"] = {**described, "dtypes": list(torch_dtypes), "timed_runs": repeats,
                       "timing": "alternated: one call of the runtime, then of torch in each dtype (and its CUDA "
                                 "graph at batch 1), every round; one warm-up call of each first"}
    log(f"torch side: {torch_runtime.summary(described)}")
    references: dict[tuple[int, int], np.ndarray] = {}

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
        work = reference.workload(service, reference, vocab)
        if not references:
            references = {shape: work.torch_batch(check, ids) for shape, ids in token_batches.items()}
            if all(side.model is not check for side in sides):
                check = None  # the fp32 copy's memory goes before anything is timed
                gc.collect()
                if torch_device == "cuda":
                    torch.cuda.empty_cache()
        form_report = bench_form(work, token_batches, sides, references, repeats, request_repeats, log, sync,
                                 torch_cuda_graphs and torch_device == "cuda")
        serving = device_used_mib()
        form_report["gpu_memory_serving_mib"] = None if serving is None or before is None else serving - before
        form_report["cuda_graphs"] = service.cuda_graphs
        if service.captures:
            queue.insert(0, (form, False))
        report["forms"][name] = form_report
        del service
    assert work is not None, "no form to bench"
    work.service = None
    gc.collect()
    # Which kernels ran, as the profiler saw one call of the largest batch (after the timing, which it would slow).
    largest = max(token_batches, key=lambda shape: shape[0] * shape[1])
    report["torch"]["profile"] = {
        f"{side.dtype} batch {largest[0]} x {largest[1]}":
            torch_runtime.profile_ops(lambda side=side: work.torch_batch(side.model, token_batches[largest]),
                                      torch_device == "cuda")
        for side in sides}
    if torch_device == "cuda":
        report["torch"]["peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return report


def write_report(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2), encoding="utf-8")
