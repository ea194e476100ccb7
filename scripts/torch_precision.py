"""How far torch's own half-precision runs of a d3 checkpoint are from its fp32 run, on the questions the CUDA
form's answer gate asks (export/d3/answer_parity.py, 210 questions, 42 of them with images or a video), measured by
the gate's rule: a yardstick for the gate's figures on a random-init checkpoint (docs/gpu.md, "The CUDA form").

    python scripts/torch_precision.py CHECKPOINT ARTIFACT [--device cuda] [--out FILE]

The precisions: torch.autocast fp16 and bf16 (matrix products in half, norms and the residual stream fp32) and
the whole model cast to bf16 (how the checkpoint's own server and vLLM run it). The artifact only renders the
prompts and preprocesses the media.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path


def main() -> None:
    sys.path.append(str(Path(__file__).resolve().parents[1]))
    from systemone.export.d3.config import D3ExportConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("artifact")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out")
    args = parser.parse_args()

    config = D3ExportConfig(Path(args.checkpoint))
    with config.reference_on(args.device):
        report = measure(config, args)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


def measure(config, args: argparse.Namespace) -> dict:
    """Each of torch's half precisions against torch fp32 (the reference, on its device), by the gate's rule."""
    import torch

    from systemone.export.answer_gate import QuestionPair, answer_figures
    from systemone.export.d3.answer_parity import parity_requests, torch_probabilities
    from systemone.export.d3.config import GATE_MEDIA_EVERY, GATE_REQUESTS
    from systemone.runtime.artifact import Artifact
    from systemone.runtime.engine import EngineOptions
    from systemone.runtime.service import DecisionService

    service = DecisionService(Artifact.load(args.artifact), EngineOptions(device="cpu", form="portable"))
    requests = [service.prepare(body) for body in parity_requests(GATE_REQUESTS, GATE_MEDIA_EVERY)]

    @contextlib.contextmanager
    def autocast(dtype: torch.dtype) -> Iterator[None]:
        with torch.autocast(args.device, dtype=dtype):
            yield

    @contextlib.contextmanager
    def cast(dtype: torch.dtype) -> Iterator[None]:
        config.model.to(dtype)  # for good: casting back would not restore the rotary tables, so it runs last
        yield

    def answers() -> list[dict[str, list[float]]]:
        return [torch_probabilities(service, config, prepared) for prepared in requests]

    want = answers()
    variants: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
        "autocast float16": lambda: autocast(torch.float16), "autocast bfloat16": lambda: autocast(torch.bfloat16),
        "model in bfloat16": lambda: cast(torch.bfloat16)}
    report: dict = {"checkpoint": args.checkpoint, "device": args.device, "torch": torch.__version__}
    for name, variant in variants.items():
        start = time.perf_counter()
        with variant():
            got = answers()
        pairs = [QuestionPair(qid, g[qid], w[qid]) for g, w in zip(got, want) for qid in w]
        figures = answer_figures(pairs)
        report[name] = {k: figures[k] for k in ("questions", "max_abs_dp", "median_abs_dp",
                                                 "questions_with_clear_pick", "problems")}
        report[name]["clear_picks_differing"] = len(figures["clear_picks_differing"])
        report[name]["seconds"] = round(time.perf_counter() - start, 1)
        print(f"{name}: max |dp| {figures['max_abs_dp']:.4f}, median |dp| {figures['median_abs_dp']:.4f}, "
              f"{len(figures['clear_picks_differing'])} of {figures['questions_with_clear_pick']} clear picks differ",
              flush=True)
    return report


if __name__ == "__main__":
    main()
