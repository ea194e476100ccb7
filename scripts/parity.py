"""ONNX-vs-torch answer parity: the requests the checks ask (tests on CPU, scripts/gpu_check.py on CUDA): three questions each, every
question type, states of every JSON kind, 1 to 29 choice options and 2 to 10 score levels."""

from __future__ import annotations

import numpy as np

STATES = [None, "The parcel arrived crushed and the customer wants a refund.", {"error": "Disk at 98%", "host": "db1"},
          "नमस्ते — एक छोटा संदेश", ["a", 1, {"b": None}], "x" * 300, "Short.", {"tickets": list(range(40))}]


def question_set(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    n_choice = int(rng.integers(1, 30))
    levels = int(rng.integers(2, 11))
    return {
        f"noul-{seed}": {"type": "noul", "instructions": f"Is case {seed} urgent?",
                         "criteria": {"true": "yes, today"} if seed % 2 else None},
        f"choice-{seed}": {"type": "choice", "instructions": "Which option fits?",
                           "criteria": {f"option {i}": (f"about {i}" if i % 2 else None) for i in range(n_choice)}},
        f"score-{seed}": {"type": "score", "criteria": [f"level {i}" for i in range(levels)]},
    }


def parity_requests(count: int = 70) -> list[dict]:
    """`count` requests of three questions each."""
    return [{"state": STATES[i % len(STATES)], "questions": question_set(i)} for i in range(count)]


def torch_probabilities(service, reference, body: dict) -> dict[str, list[float]]:
    """The torch model (`D3ExportConfig.reference_logits`) on each question's own prompt, read as spec 4.13 reads."""
    from systemone.runtime.text_batch import text_positions

    probs = {}
    for prompt in service.render(body):
        logits = reference.reference_logits(prompt.token_ids, text_positions(len(prompt.token_ids)))
        probs[prompt.question.id] = list(service.family.read(prompt.question, logits.tolist()).probs)
    return probs


def onnx_probabilities(service, body: dict) -> dict[str, list[float]]:
    """The artifact's answers through the whole runtime (one padded batch per request)."""
    return {qid: list(a["probabilities"].values()) for qid, a in service.decide(body)["answers"].items()}


def compare(service, reference, requests: list[dict]) -> dict:
    """ONNX vs torch over `requests`: question count, differing picks, max |dp|, median top probability."""
    from systemone.models.family import first_argmax

    count, worst, tops, differing = 0, 0.0, [], []
    for body in requests:
        want = torch_probabilities(service, reference, body)
        got = onnx_probabilities(service, body)
        for qid, probs in want.items():
            if first_argmax(got[qid]) != first_argmax(probs):
                differing.append(qid)
            worst = max(worst, float(np.abs(np.array(got[qid]) - np.array(probs)).max()))
            tops.append(max(probs))
            count += 1
    return {"questions": count, "picks_differing": differing, "max_abs_dp": worst,
            "median_top_probability": float(np.median(tops))}


def time_request(service, reference, body: dict, repeats: int = 5) -> dict:
    """Wall time of one request: the runtime (one padded ONNX batch) vs the torch model run question by question,
    side by side in the same process on the same device."""
    import torch

    from scripts.timing import median_seconds
    from systemone.runtime.text_batch import text_positions

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


def sixteen_questions() -> dict:
    questions = {}
    for seed in range(6):
        questions.update(question_set(seed))
    return {"state": {"ticket": "Charged twice for order 1234", "tier": "gold"},
            "questions": dict(list(questions.items())[:16])}


def main() -> None:
    import argparse
    import json
    import sys
    from pathlib import Path

    sys.path.append(str(Path(__file__).resolve().parents[1]))
    from scripts.build_d3_checkpoint import RELEASED_TEXT, build_d3_checkpoint
    from systemone.export.d3 import D3ExportConfig
    from systemone.export.pipeline import export_checkpoint
    from systemone.runtime.artifact import Artifact
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
        service = DecisionService(Artifact.load(artifact), device=args.device)
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
