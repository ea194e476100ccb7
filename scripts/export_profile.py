"""Where one graph's export spends its time: the graph exported as `systemone export` exports it
(export/graph_export.py: torch.onnx's dynamo exporter, its optimizer, onnx's checker) under cProfile; the wall time,
then the --top functions by cumulative time. On the lent GPU machine the portable exports are most of the time
before a lease's first bench (docs/gpu.md). cProfile slows Python-heavy parts more than the rest.

    python scripts/export_profile.py CHECKPOINT [--graph text] [--out DIR] [--top 40]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
from pathlib import Path

from systemone.export.graph_export import export_graph
from systemone.models.registry import FAMILIES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--graph", default="text")
    parser.add_argument("--out", type=Path, default=None, help="where the graph is written (default: a temp dir)")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    config = FAMILIES.recognise(args.checkpoint).load_export_config()(args.checkpoint)
    spec = next(spec for spec in config.graphs() if spec.name == args.graph)
    with tempfile.TemporaryDirectory() as scratch:
        out = args.out or Path(scratch)
        out.mkdir(parents=True, exist_ok=True)
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.runcall(export_graph, spec, out / spec.file)
        print(f"{args.checkpoint} {args.graph} graph: exported in {time.perf_counter() - start:.1f} s under cProfile")
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(args.top)
    print(text.getvalue())


if __name__ == "__main__":
    main()
