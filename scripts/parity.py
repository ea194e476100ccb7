"""d3 ONNX-vs-torch answer parity (systemone.export.d3.answer_parity) and timing, on CPU or CUDA."""

from __future__ import annotations

from systemone.export.d3.answer_parity import compare, parity_requests, sixteen_questions

def time_request(service, reference, body: dict, repeats: int = 5) -> dict:
    """Wall time of one request: the runtime (one padded ONNX batch) vs the torch model run question by question,
    side by side in the same process on the same device."""
    import torch

    from scripts.timing import median_seconds
    from systemone.runtime.d3.code_logits import text_positions

    prompts = service.render(body)

    def torch_run():
        for p in prompts:
            reference.reference_logits(p.token_ids, text_positions(len(p.token_ids)))
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def onnx_run():
        service.decide(body)

    onnx_s, torch_s = median_seconds(onnx_run, repeats), median_seconds(torch_run, repeats)
    return {"questions": len(prompts), "prompt_tokens": sum(len(p.token_ids) for p in prompts),
            "onnx_seconds": onnx_s, "torch_seconds": torch_s, "torch_over_onnx": torch_s / onnx_s}

def main() -> None:
    import argparse
    import json
    import sys
    from pathlib import Path

    sys.path.append(str(Path(__file__).resolve().parents[1]))
    from tests.d3_checkpoint import RELEASED_TEXT, build_d3_checkpoint
    from systemone.export.d3.config import D3ExportConfig
    from systemone.export.pipeline import export_checkpoint
    from systemone.runtime.artifact import Artifact
    from systemone.runtime.engine import EngineOptions
    from systemone.runtime.service import DecisionService

    parser = argparse.ArgumentParser(description="Build, export and check a random-init d3 checkpoint: ONNX (on "
                                     "--device) vs the torch model on the same token ids; optionally timed.")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--size", default="tiny", choices=["tiny", *RELEASED_TEXT])
    parser.add_argument("--modes", nargs="+", default=["noncausal_full_attention", "causal"])
    parser.add_argument("--requests", type=int, default=70, help="requests of 3 questions each")
    parser.add_argument("--work", default=".cache/parity")
    parser.add_argument("--time", action="store_true", help="also time a 16-question request")
    parser.add_argument("--out", default=None, help="write the report JSON here too")
    args = parser.parse_args()

    work = Path(args.work)
    report = {"device": args.device, "size": args.size, "modes": {}}
    for mode in args.modes:
        checkpoint = build_d3_checkpoint(work / f"{args.size}-{mode}", args.size, mode)
        artifact = export_checkpoint(str(checkpoint), work / f"{args.size}-{mode}-onnx", overwrite=True)
        service = DecisionService(Artifact.load(artifact), EngineOptions(device=args.device))
        service.warm_up()  # this thread times the graphs: their CUDA graphs are captured here
        reference = D3ExportConfig(checkpoint)
        if args.device == "cuda":
            reference.model.to("cuda")
        result = compare(service, reference, parity_requests(args.requests))
        result.update(provider=service.provider,
                      export_parity=json.loads((artifact / "manifest.json").read_text())["parity"]["max_abs_prob_diff"])
        if args.time:
            result["timing"] = time_request(service, reference, sixteen_questions())
        report["modes"][mode] = result
        print(json.dumps({mode: result}, indent=2), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))

if __name__ == "__main__":
    main()
