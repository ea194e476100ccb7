"""onnxruntime's own profile of an artifact's text graph on one token batch: node time by operator type (after one
warm-up run), and the nodes placed outside the asked-for provider. Answers "where does the graph's time go" before
optimising. On CUDA a node's time is the host's time in its compute call (launches are asynchronous), so the shares
say where launch-bound runs spend the host's time, not the GPU's.

    python scripts/ort_profile.py ARTIFACT [--device cuda] [--form auto] [--batch 8] [--length 200] [--runs 5]
        [--out F]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np


def main() -> None:
    sys.path.append(str(Path(__file__).resolve().parents[1]))
    import onnxruntime as ort

    from systemone.runtime.artifact import Artifact
    from systemone.runtime.d3.code_logits import code_logit_feeds, text_positions
    from systemone.runtime.session import provider_options, resolve_providers

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--form", default="auto", help="the artifact's form (auto: the one the runtime would take)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=200)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    artifact = Artifact.load(args.artifact).with_form(args.form, args.device)
    if artifact.manifest.family != "d3":
        raise SystemExit("the profile feeds d3's text graph inputs")
    providers = resolve_providers(args.device)
    if providers[0] != "CPUExecutionProvider" and hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = "/tmp/ort_profile"
    options.log_severity_level = 2  # warnings: nodes placed outside the asked-for provider are reported
    session = ort.InferenceSession(str(artifact.graph_path("text")), options,
                                   providers=[(p, provider_options(p, None)) for p in providers])
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 150_000, args.length).tolist() for _ in range(args.batch)]
    feeds = code_logit_feeds(prompts, [text_positions(args.length)] * args.batch, None,
                             int(artifact.manifest.model["hidden_size"]))
    for _ in range(args.runs + 1):
        session.run(None, feeds)
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
    report = {"batch": args.batch, "length": args.length, "form": artifact.form,
              "provider": session.get_providers()[0],
              "kernel_ms_per_run": total,
              "by_op": {op: {"ms": ms, "share": ms / total} for op, ms in sorted(by_op.items(), key=lambda x: -x[1])},
              "ops_by_provider": {p: sorted(ops) for p, ops in providers_seen.items()}}
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
