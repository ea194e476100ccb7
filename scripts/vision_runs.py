"""Several attention segments in one vision run, or one run each? The d3 vision graphs of ARTIFACT (portable and,
where the artifact has one, the CUDA form) on --device, with the runtime's GraphSession: the seeds' video (10 frame
groups of 20x36 patches) and four photos of 60x80, each as one run per segment and as one run of all of them (the
`segments` input). Prints median and min ms of 20 runs after 3, and the largest difference between the two ways
(the same rows: each segment attends only to itself). The encoder runs segments together on a GPU and alone on the
CPU (runtime/d3/media.py), from this script's figures: on two CPU cores (tiny d3, portable graph) the video took 21
ms in ten runs and 38 ms in one (scripts/results/vision_runs_cpu_d3_tiny.txt); on the H200 (d3-nano, the fused
form) 66.0 ms in ten and 31.9 ms in one (scripts/results/gpu_vision_runs_d3-nano_noncausal.txt).

    python scripts/vision_runs.py ARTIFACT [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def main() -> None:
    sys.path.append(str(Path(__file__).resolve().parents[1]))
    from systemone.runtime.d3.vision_inputs import vision_inputs
    from systemone.runtime.session import GraphSession

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    manifest = json.loads((args.artifact / "manifest.json").read_text())
    side, merge = manifest["vision"]["position_grid_side"], manifest["vision"]["merge_size"]
    rng = np.random.default_rng(0)
    graphs = ["vision.onnx"] + [f"vision.{form}.onnx" for form in manifest.get("forms", {})
                                if (args.artifact / f"vision.{form}.onnx").exists()]
    for name in graphs:
        session = GraphSession(args.artifact / name, args.device)
        if "segments" not in session.input_names:
            raise SystemExit(f"{name} takes one segment a run: exported before the `segments` input")
        width = session.session.get_inputs()[0].shape[1]
        print(f"{name} on {session.provider}")
        for count, h, w in ((10, 20, 36), (4, 60, 80)):
            n = h * w
            pixels = rng.standard_normal((count * n, width)).astype(np.float32)
            alone = vision_inputs(h, w, side, merge)

            def one_run_each() -> np.ndarray:
                return np.concatenate([session.run({"pixel_values": pixels[g * n:(g + 1) * n], **alone})[0]
                                       for g in range(count)])

            def one_run() -> np.ndarray:
                return session.run({"pixel_values": pixels, **vision_inputs(h, w, side, merge, count)})[0]

            for way in (one_run_each, one_run):
                for _ in range(3):
                    way()
                times = []
                for _ in range(20):
                    start = time.perf_counter()
                    way()
                    times.append(time.perf_counter() - start)
                print(f"  {count:2d} segments of {h}x{w}: {way.__name__:12s} median {1000 * np.median(times):8.2f} ms,"
                      f" min {1000 * min(times):8.2f} ms")
            print(f"  largest difference {np.abs(one_run_each() - one_run()).max():.2e}")


if __name__ == "__main__":
    main()
