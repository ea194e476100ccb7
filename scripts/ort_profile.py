"""onnxruntime's own profile of an artifact's text graph (d3's, or d1's read of whole prompts) on one token batch,
or of d3's vision graph (`--graph vision`) on SEGMENTS random segments of one patch grid (`--grid 60x80`, the seeds'
photo; `--grid 20x36 --segments 10`, its video's frame groups in one run): node time by operator type (after one
warm-up run), and the nodes placed outside the asked-for provider. Answers "where does the graph's time go" before
optimising. On CUDA a node's time is the host's time in its compute call (launches are asynchronous), so the shares
say where launch-bound runs spend the host's time, not the GPU's; with `--gpu-kernels` (CUDA, torch installed: a
profiling tool, not the runtime) CUPTI records every kernel the same runs launch, through torch's profiler, and the
report adds the GPU's own time by kernel family and the kernels that take most of it. A run fetches the outputs the
runtime fetches (d1: the reads, not the new state); `--all-outputs` fetches every output, as the runtime did before
d1's reads left their state on the device.

    python scripts/ort_profile.py ARTIFACT [--device cuda] [--form auto] [--batch 8] [--length 200] [--runs 5]
        [--gpu-kernels] [--all-outputs] [--graph text|vision] [--grid HxW] [--segments N] [--out F]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np


# Kernel families by name (cuBLAS/CUTLASS names vary by GPU and library version; the rest are onnxruntime's own).
KERNEL_FAMILIES = (("matrix products", ("gemm", "cutlass", "xmma", "cublas", "sm90", "sm80")),
                   ("casts", ("cast",)),
                   ("normalisation", ("layernorm", "layer_norm", "rmsnorm", "simplified")),
                   ("softmax", ("softmax",)),
                   ("delta rule", ("gated_delta", "gateddelta", "delta")),
                   ("convolution", ("conv",)),
                   ("reductions", ("reduce",)),
                   ("copies and layout", ("transpose", "copy", "concat", "slice", "split", "gather", "scatter",
                                          "pad", "expand", "where", "memcpy", "memset")),
                   ("elementwise", ("elementwise", "binary", "unary", "mul", "add", "sigmoid", "gelu", "silu",
                                    "sqrt", "pow", "div", "sub", "neg", "exp")))


def kernel_family(name: str) -> str:
    lowered = name.lower()
    return next((family for family, marks in KERNEL_FAMILIES if any(m in lowered for m in marks)), "other")


def gpu_kernel_times(run: Callable[[], None], runs: int) -> dict:
    """GPU time per run of the kernels `run` launches (CUPTI through torch's profiler), by family and top kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            run()
        torch.cuda.synchronize()
    by_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            by_kernel[event.name][0] += event.device_time / 1000.0 / runs  # microseconds -> ms per run
            by_kernel[event.name][1] += 1
    total = sum(ms for ms, _ in by_kernel.values())
    families: dict[str, float] = defaultdict(float)
    for name, (ms, _) in by_kernel.items():
        families[kernel_family(name)] += ms
    top = sorted(by_kernel.items(), key=lambda item: -item[1][0])[:30]
    return {"gpu_ms_per_run": total,
            "kernels_per_run": sum(count for _, count in by_kernel.values()) / runs,
            "by_family": {f: {"ms": ms, "share": ms / total if total else 0.0}
                          for f, ms in sorted(families.items(), key=lambda x: -x[1])},
            "top_kernels": [{"name": name[:160], "ms": ms, "launches_per_run": count / runs}
                            for name, (ms, count) in top]}


def main() -> None:
    sys.path.append(str(Path(__file__).resolve().parents[1]))
    import onnxruntime as ort

    from systemone.runtime.artifact import Artifact
    from systemone.runtime.batch import TextRow
    from systemone.runtime.d1.label_reads import LabelLogprobs
    from systemone.runtime.d1.state import layout_of as d1_layout
    from systemone.runtime.d3.code_logits import CodeLogits
    from systemone.runtime.d3.state import layout_of as d3_layout
    from systemone.runtime.d3.vision_inputs import vision_inputs
    from systemone.runtime.session import provider_options, resolve_providers

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--form", default="auto", help="the artifact's form (auto: the one the runtime would take)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=200)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--gpu-kernels", action="store_true", help="also the GPU's own kernel times (CUDA, torch)")
    parser.add_argument("--all-outputs", action="store_true", help="fetch every output (d1: its new state too)")
    parser.add_argument("--graph", choices=("text", "vision"), default="text")
    parser.add_argument("--grid", default="60x80", help="vision: the segments' patch grid, rows x columns")
    parser.add_argument("--segments", type=int, default=1, help="vision: segments of that grid in the run")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    artifact = Artifact.load(args.artifact).with_form(args.form, args.device)
    providers = resolve_providers(args.device)
    if providers[0] != "CPUExecutionProvider" and hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = "/tmp/ort_profile"
    options.log_severity_level = 2  # warnings: nodes placed outside the asked-for provider are reported
    session = ort.InferenceSession(str(artifact.graph_path(args.graph)), options,
                                   providers=[(p, provider_options(p, None)) for p in providers])
    rng = np.random.default_rng(0)
    fields = artifact.manifest.model
    if args.graph == "vision":
        if artifact.manifest.family != "d3":
            raise SystemExit("--graph vision profiles d3's vision graph")
        h, w = (int(x) for x in args.grid.split("x"))
        vision = fields["vision"]
        width = session.get_inputs()[0].shape[1]
        feeds = {"pixel_values": rng.standard_normal((args.segments * h * w, width)).astype(np.float32),
                 **vision_inputs(h, w, vision["position_grid_side"], vision["merge_size"], args.segments)}
        if "segments" not in {i.name for i in session.get_inputs()}:
            if args.segments != 1:
                raise SystemExit("this vision graph takes one segment a run (exported before the segments input)")
            feeds.pop("segments")
        fetch = None
    else:  # whole prompts from an empty state (d1: five label tokens read)
        d1 = artifact.manifest.family == "d1"
        hidden = int(fields["hidden_size"])
        reads, layout = (LabelLogprobs(hidden), d1_layout(fields)) if d1 else (CodeLogits(hidden), d3_layout(fields))
        rows = [TextRow(rng.integers(0, 60_000 if d1 else 150_000, args.length).tolist(), label_ids=tuple(range(5)))
                for _ in range(args.batch)]
        feeds = {**reads.feeds(rows), **(layout.empty() if layout is not None else {})}
        fetch = None if args.all_outputs or layout is None else list(reads.fetch)
    for _ in range(args.runs + 1):
        session.run(fetch, feeds)
    events = json.loads(Path(session.end_profiling()).read_text())
    # The first run pays for the shapes' allocations and library set-up: only the runs after it are counted.
    first = min((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    warmed = first["ts"] + first["dur"]
    by_op: dict[str, float] = defaultdict(float)
    providers_seen: dict[str, set[str]] = defaultdict(set)
    for event in events:
        if event.get("cat") != "Node" or not event.get("name", "").endswith("_kernel_time"):
            continue
        if event["ts"] < warmed:
            continue
        op = event["args"].get("op_name", "?")
        by_op[op] += event["dur"] / 1000.0 / args.runs
        providers_seen[event["args"].get("provider", "?")].add(op)
    total = sum(by_op.values())
    shape = ({"grid": args.grid, "segments": args.segments} if args.graph == "vision"
             else {"batch": args.batch, "length": args.length})
    report = {"family": artifact.manifest.family, "graph": args.graph, **shape, "form": artifact.form,
              "outputs": fetch or "all",
              "provider": session.get_providers()[0],
              "kernel_ms_per_run": total,
              "by_op": {op: {"ms": ms, "share": ms / total} for op, ms in sorted(by_op.items(), key=lambda x: -x[1])},
              "ops_by_provider": {p: sorted(ops) for p, ops in providers_seen.items()}}
    if args.gpu_kernels:
        options.enable_profiling = False
        plain = ort.InferenceSession(str(artifact.graph_path(args.graph)), options,
                                     providers=[(p, provider_options(p, None)) for p in providers])
        plain.run(fetch, feeds)  # the shapes' allocations and library set-up, outside the record
        report["gpu_kernels"] = gpu_kernel_times(lambda: plain.run(fetch, feeds), args.runs)
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
