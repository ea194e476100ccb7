"""A probe, not a product path: the d3 fp32 text graph converted to fp16 after export (onnxruntime's
float16 converter, inputs and outputs kept fp32), timed on CUDA against the fp32 graph on the same token batches,
with the code-logit and probability differences. Tells whether a converted graph is worth a gate before a
hand-built half-precision form is written.

    python scripts/fp16_probe.py ARTIFACT WORKDIR
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np


def main() -> None:
    sys.path.append(str(Path(__file__).resolve().parents[1]))
    import onnx
    import onnxruntime as ort
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from systemone.runtime.artifact import Artifact
    from systemone.runtime.d3.code_logits import code_logit_feeds, text_positions

    artifact, work = Artifact.load(sys.argv[1]), Path(sys.argv[2])
    work.mkdir(parents=True, exist_ok=True)
    fp16_path = work / "text_fp16.onnx"
    report: dict = {}
    if not fp16_path.is_file():
        start = time.perf_counter()
        model = onnx.load(str(artifact.graph_path("text")))
        try:
            converted = convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=True)
            report["blocked"] = "default list"
        except Exception as exc:  # the probe records what the converter cannot do
            report["first_try"] = f"{type(exc).__name__}: {exc}"[:300]
            converted = convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=True,
                                                 op_block_list=["Scan"])
            report["blocked"] = "default list + Scan"
        onnx.save(converted, str(fp16_path), save_as_external_data=True, location="text_fp16.onnx.data")
        report["convert_seconds"] = time.perf_counter() - start
    ort.preload_dlls()
    providers = [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"]
    sessions = {"fp32": ort.InferenceSession(str(artifact.graph_path("text")), providers=providers),
                "fp16": ort.InferenceSession(str(fp16_path), providers=providers)}
    hidden = int(artifact.manifest.model["hidden_size"])
    temperature = artifact.family.config.temperature
    rng = np.random.default_rng(0)
    rows = []
    for batch, length in ((1, 200), (8, 200), (32, 200), (8, 1000)):
        prompts = [rng.integers(0, 150_000, length).tolist() for _ in range(batch)]
        feeds = code_logit_feeds(prompts, [text_positions(length)] * batch, None, hidden)
        out, ms = {}, {}
        for name, session in sessions.items():
            session.run(None, feeds)
            times = []
            for _ in range(5):
                start = time.perf_counter()
                out[name] = session.run(None, feeds)[0]
                times.append(time.perf_counter() - start)
            ms[name] = 1000 * float(np.median(times))
        e32 = np.exp((out["fp32"] - out["fp32"].max(-1, keepdims=True)) / temperature)
        e16 = np.exp((out["fp16"] - out["fp16"].max(-1, keepdims=True)) / temperature)
        dp = np.abs(e32 / e32.sum(-1, keepdims=True) - e16 / e16.sum(-1, keepdims=True))
        rows.append({"batch": batch, "length": length, "fp32_ms": ms["fp32"], "fp16_ms": ms["fp16"],
                     "max_abs_logit_diff": float(np.abs(out["fp32"] - out["fp16"]).max()),
                     "max_abs_dp": float(dp.max()), "median_abs_dp": float(np.median(dp))})
        print(json.dumps(rows[-1]), flush=True)
    report["batches"] = rows
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
