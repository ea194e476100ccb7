"""The code logits of a d3 artifact's text graphs (the portable fp32 one and each half-precision form written)
against the torch fp32 model, prompt by prompt, on export's parity runs: random token runs of several lengths and a
run of one repeated token (200 x token 0), which the portable graph's old chunk solve got 0.079 wrong at d3-nano's
size (docs/gpu.md, "Fourteenth run"). The answer gate judges a form on real questions; this says how far each
graph's raw logits are on those runs, each prompt alone and all in one right-padded batch.

    python scripts/form_logits.py CHECKPOINT ARTIFACT [--device cuda] [--lengths 7 200 1000] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def main() -> None:
    from systemone.export.d3.config import RANDOM_TOKEN_IDS, D3ExportConfig
    from systemone.runtime.artifact import Manifest
    from systemone.runtime.batch import BatchBudget
    from systemone.runtime.d3.code_logits import CodeLogitsRunner, TextRow, text_positions
    from systemone.runtime.session import GraphSession

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lengths", type=int, nargs="+", default=[7, 200, 1000])
    parser.add_argument("--out")
    args = parser.parse_args()

    config = D3ExportConfig(args.checkpoint)
    rng = np.random.default_rng(0)
    prompts = [(f"random-{n}", rng.integers(0, RANDOM_TOKEN_IDS, n).tolist()) for n in args.lengths]
    prompts.append(("repeated-200", [0] * 200))
    with config.reference_on(args.device):
        want = [config.reference_logits(ids, text_positions(len(ids))) for _, ids in prompts]
    manifest = Manifest.read(args.artifact)
    graphs = {"portable": "text.onnx", **{name: form.graphs["text"] for name, form in manifest.forms.items()
                                          if form.graphs.get("text")}}
    hidden = int(config.text_config.hidden_size)
    report = {}
    for name, file in graphs.items():
        runner = CodeLogitsRunner(GraphSession(args.artifact / file, args.device), BatchBudget(), hidden)
        batched = runner.run_batch([TextRow(ids) for _, ids in prompts])  # one call, every row padded to the longest
        rows = []
        for (label, ids), together, reference in zip(prompts, batched, want):
            alone = runner.run([ids])[0]
            rows.append({"prompt": label, "tokens": len(ids), "finite": bool(np.isfinite(alone).all()
                                                                          and np.isfinite(together).all()),
                         "max_abs_logit_diff_alone": float(np.abs(alone - reference).max()),
                         "max_abs_logit_diff_in_batch": float(np.abs(together - reference).max()),
                         "same_argmax": bool(np.argmax(alone) == np.argmax(reference))})
            print(name, json.dumps(rows[-1]), flush=True)
        report[name] = {"graph": file, "prompts": rows}
    if args.out:
        Path(args.out).write_text(json.dumps({"checkpoint": str(args.checkpoint), "device": args.device,
                                              "graphs": report}, indent=1))


if __name__ == "__main__":
    main()
