"""Time a checkpoint's graph exports with the optimizer rules export leaves out (export/graph_export.py) and with the
full rule set, and check that both write the same graph.

    python scripts/export_rules_timing.py CKPT OUT [--graphs text,vision,fused_text] [--order skipped,full]

Each graph is exported both ways in this process, in `--order` (the first export of a process pays for warming
torch up, so run both orders). `fused_NAME` is the graph a CUDA form exports with onnxruntime's fused ops.
"""

from __future__ import annotations

import argparse
import filecmp
import time
from pathlib import Path

import onnx


def without_debug_records(path: Path) -> bytes:
    """The graph as onnxruntime reads it: the exporter's per-node debug records (stack traces that name generated
    code by a counter, different from one export to the next in a process) taken out, subgraphs included."""
    model = onnx.load(str(path), load_external_data=False)

    def strip(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            del node.metadata_props[:]
            for attribute in node.attribute:
                for body in [attribute.g] * attribute.HasField("g") + list(attribute.graphs):
                    strip(body)

    strip(model.graph)
    return model.SerializeToString()


def same_graph(a: Path, b: Path) -> bool:
    """Whether two exports wrote the same graph and the same weights."""
    return (without_debug_records(a) == without_debug_records(b)
            and filecmp.cmp(f"{a}.data", f"{b}.data", shallow=False))


def main() -> None:
    from systemone.export.graph_export import export_graph
    from systemone.export.source import resolve_checkpoint
    from systemone.models.registry import FAMILIES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("out", type=Path)
    parser.add_argument("--graphs", default="text")
    parser.add_argument("--order", default="skipped,full")
    args = parser.parse_args()
    checkpoint = resolve_checkpoint(args.checkpoint, None)
    config = FAMILIES.recognise(checkpoint).load_export_config()(checkpoint)
    specs = {spec.name: spec for spec in config.graphs()}
    fused = next((form.sources for form in config.forms() if form.sources), {})
    specs.update({f"fused_{name}": spec for name, spec in fused.items()})
    for name in args.graphs.split(","):
        spec, paths, seconds = specs[name], {}, {}
        for way in args.order.split(","):
            folder = args.out / name / way
            folder.mkdir(parents=True, exist_ok=True)
            start = time.perf_counter()
            paths[way] = export_graph(spec, folder / spec.file, **({"skipped_rules": ()} if way == "full" else {}))
            seconds[way] = time.perf_counter() - start
        verdict = "the same graph" if same_graph(paths["skipped"], paths["full"]) else "DIFFERENT graphs"
        print(f"{name}: " + ", ".join(f"{way} rules {s:.1f} s" for way, s in seconds.items()) + f"; {verdict}",
              flush=True)


if __name__ == "__main__":
    main()
