"""d1's vision graph as the CUDA rungs write it, timed side by side from a checkpoint alone (no text graph, no
answer gate, so it fits a short lease): the portable graph and the fused one (each layer's attention one
MultiHeadAttention node read in fp16, its GELU one FastGelu node), each with its matrix products converted to fp16
as every CUDA rung converts the vision graph, on the crops of one 1024x1024 image (four 512-pixel tiles and the
thumbnail: five crops of 32x32 patches), against the portable fp32 graph on the same device.

    python scripts/d1_vision_forms.py CHECKPOINT [--device cuda] [--crops 5] [--grid 32 32] [--repeats 20]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from systemone.bench import percentile_ms, timed
from systemone.export.d1.config import D1ExportConfig
from systemone.export.graph_export import export_graph
from systemone.export.half_precision import convert_to_half
from systemone.runtime.d1.cells import unshuffle_order
from systemone.runtime.session import GraphSession


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--crops", type=int, default=5)
    parser.add_argument("--grid", type=int, nargs=2, default=(32, 32))
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    config = D1ExportConfig(Path(args.checkpoint))
    vision = next(spec for spec in config.graphs() if spec.name == "vision")
    # The vision graph and its precision as the family declares its fused CUDA rungs (export/d1/config.py `forms`),
    # so this times what export writes.
    fused = next(form for form in config.forms() if "vision" in form.sources)
    specs = {"portable": vision, "fused": fused.sources["vision"]}
    grid = tuple(args.grid)
    order = unshuffle_order(*grid, config.config.downsample_factor)
    rng = np.random.default_rng(0)  # patches as the processor writes them: normalized to [-1, 1]
    patches = rng.uniform(-1, 1, (args.crops, grid[0] * grid[1], config.patch_width)).astype(np.float32)
    feeds = {"patches": patches[:, order], "positions": config.reference_positions(grid)[order]}
    with tempfile.TemporaryDirectory() as scratch:
        sessions = {}
        for name, spec in specs.items():
            source = export_graph(spec, Path(scratch) / f"vision.{name}.onnx")
            half = Path(scratch) / f"vision.{name}.fp16-products.onnx"
            convert_to_half(source, half, list(vision.outputs), fused.precision_of("vision"))
            sessions[f"{name} fp32"] = GraphSession(source, args.device)
            sessions[f"{name}, fp16 products"] = GraphSession(half, args.device)
        reference = sessions["portable fp32"].run(feeds)[0]
        print(f"{args.crops} crops of {grid[0]}x{grid[1]} patches on {args.device}, rows {reference.shape}, "
              f"largest row value {np.abs(reference).max():.3f}")
        for name, session in sessions.items():
            ms = percentile_ms(timed(lambda: session.run(feeds), args.repeats), 50)
            diff = np.abs(session.run(feeds)[0] - reference).max()
            print(f"{name:28s} p50 {ms:8.2f} ms   largest difference from portable fp32 {diff:.3e}")


if __name__ == "__main__":
    main()
