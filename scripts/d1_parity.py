"""d1 ONNX-vs-torch answer parity and the prefix-reuse benchmark (CPU or CUDA).

Parity: the runtime (shared prefix prefilled once, questions as suffixes) against transformers' LFM2-VL run on each
question's whole prompt (its own vision tower on the same pixel crops), both read as spec 3.7 reads: every pick,
every probability, label_mass and argmax_is_label. Timing, side by side in one process: one 16-question request
with and without prefix reuse, and the torch model question by question.

    python scripts/d1_parity.py [--device cpu|cuda] [--size tiny|d1-3B] [--requests 70] [--time] [--out F]
"""

from __future__ import annotations

from typing import Any


from systemone.export.d1.answer_parity import (compare, onnx_reads, parity_requests, sixteen_questions, torch_pixels,
                                              whole_prompt_reads)


def time_prefix_reuse(service, reference, body: dict[str, Any], repeats: int = 5) -> dict[str, Any]:
    """Wall time of one request's graph runs and reads (media fetched and preprocessed once, before timing; encoded
    once per run in both) with and without prefix reuse, and the torch model on each whole prompt, side by side."""
    import torch

    from scripts.timing import median_seconds

    prepared = service.prepare(body)
    prompts = prepared.prompts
    pixels = torch_pixels(service, body)

    def torch_run():
        for p in prompts:
            reference.reference_logprobs(p.token_ids, pixels=pixels)
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    reuse = median_seconds(lambda: onnx_reads(service, prepared), repeats)
    whole = median_seconds(lambda: whole_prompt_reads(service, prepared), repeats)
    torch_s = median_seconds(torch_run, max(1, repeats // 2))
    from systemone.runtime.tokenizer import shared_prefix

    return {"questions": len(prompts), "prompt_tokens": sum(len(p.token_ids) for p in prompts),
            "shared_prefix_tokens": shared_prefix([p.token_ids for p in prompts]),
            "onnx_prefix_reuse_seconds": reuse, "onnx_whole_prompts_seconds": whole, "torch_seconds": torch_s,
            "whole_over_reuse": whole / reuse, "torch_over_reuse": torch_s / reuse}


def main() -> None:
    import argparse
    import json
    import sys
    from pathlib import Path

    sys.path.append(str(Path(__file__).resolve().parents[1]))
    from tests.d1_checkpoint import SIZES, build_d1_checkpoint
    from systemone.export.d1.config import D1ExportConfig
    from systemone.export.pipeline import export_checkpoint
    from systemone.runtime.artifact import Artifact
    from systemone.runtime.engine import EngineOptions
    from systemone.runtime.service import DecisionService

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--size", default="tiny", choices=list(SIZES))
    parser.add_argument("--requests", type=int, default=70, help="requests of 3 questions each")
    parser.add_argument("--work", default=".cache/d1-parity")
    parser.add_argument("--time", action="store_true", help="also time a 16-question request")
    parser.add_argument("--out", default=None, help="write the report JSON here too")
    parser.add_argument("--export-only", action="store_true", help="build and export, then stop")
    parser.add_argument("--reuse-artifact", action="store_true", help="use the checkpoint and artifact in --work")
    args = parser.parse_args()

    work = Path(args.work)
    checkpoint, artifact = work / args.size, work / f"{args.size}-onnx"
    if not (args.reuse_artifact and (artifact / "manifest.json").is_file()):
        build_d1_checkpoint(checkpoint, args.size)
        export_checkpoint(str(checkpoint), artifact, overwrite=True)
    if args.export_only:
        return
    service = DecisionService(Artifact.load(artifact), EngineOptions(device=args.device))
    reference = D1ExportConfig(checkpoint)
    if args.device == "cuda":
        reference.model.to("cuda")
    report: dict[str, Any] = {"device": args.device, "size": args.size, "provider": service.provider,
                              "export_parity": json.loads((artifact / "manifest.json").read_text())["parity"]["summary"]}
    report["parity"] = compare(service, reference, parity_requests(args.requests))
    print(json.dumps(report, indent=2), flush=True)
    if args.time:
        report["timing"] = {"text_only": time_prefix_reuse(service, reference, sixteen_questions(False)),
                            "with_image": time_prefix_reuse(service, reference, sixteen_questions(True))}
        print(json.dumps(report["timing"], indent=2), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
