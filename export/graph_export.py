"""One graph spec -> one ONNX file, through torch.onnx's dynamo exporter: what export writes for the portable graphs
and for a form's own graphs (export/forms.py)."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .config import ExportConfig, GraphSpec

OPSET = 18

# The rewrite rules of onnxscript's optimizer (run by torch.onnx after the export) that export leaves out.
# SlicesSplit (two Slices of one tensor -> one Split) is the only default rule whose pattern ends in two nodes, and
# its matcher pairs them by walking the whole graph once for every Slice it tries, so its cost grows with the square
# of the graph: most of the optimizer's 369 s in d3-edge's text export (docs/gpu.md, "After the twenty-fifth run").
# It rewrites none of this project's graphs (tests/test_graph_export.py holds each written graph byte for byte equal
# to the one the full rule set writes), so leaving it out changes no graph.
SKIPPED_RULES = frozenset({"SlicesSplit"})


@contextmanager
def _rewrite_rules_without(names: Collection[str]) -> Iterator[None]:
    """onnxscript's optimizer runs its default rewrite rules but those named, inside the block. The optimizer reads
    its rule list from its module when it runs, and offers no other way to choose them."""
    import onnxscript.rewriter as rewriter

    rules = getattr(rewriter, "_DEFAULT_REWRITE_RULES", None)
    if not names or rules is None:  # an onnxscript without that list: its optimizer as it is
        yield
        return
    rewriter._DEFAULT_REWRITE_RULES = tuple(rule for rule in rules if rule.name not in names)
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = rules


def export_graph(spec: GraphSpec, path: Path, skipped_rules: Collection[str] = SKIPPED_RULES) -> Path:
    """Write `spec` to `path`, its weights beside it in `path.name + '.data'`; checked by onnx's checker.
    `skipped_rules`: the optimizer's rewrite rules left out (the full set with none)."""
    import onnx
    import torch

    with torch.no_grad(), _rewrite_rules_without(skipped_rules):
        torch.onnx.export(spec.module(), spec.example_inputs(), str(path), dynamo=True, opset_version=OPSET,
                          external_data=True, input_names=spec.inputs, output_names=spec.outputs,
                          dynamic_shapes=spec.dynamic_shapes, custom_translation_table=spec.translations,
                          verbose=False)
    onnx.checker.check_model(str(path))
    return path


# Which graph of a checkpoint's export config a spec is, by name, so that a worker process can build it again:
# ("portable", graph) or ("form", form, graph) for a graph the form exports itself.
SpecKey = tuple[str, ...]


def _spec_of(config: ExportConfig, key: SpecKey) -> GraphSpec:
    """The spec `key` names in `config`."""
    if key[0] == "portable":
        return next(spec for spec in config.graphs() if spec.name == key[1])
    return next(form for form in config.forms() if form.name == key[1]).sources[key[2]]


def _export_in_worker(config_class: type, checkpoint: str, key: SpecKey, path: str, seed: int) -> str:
    import torch

    torch.manual_seed(seed)
    return str(export_graph(_spec_of(config_class(Path(checkpoint)), key), Path(path)))


class GraphExports:
    """A checkpoint's graph exports: one after another in this process, when each is waited for (`jobs` = 1); or,
    with `jobs` > 1, all those started at once in that many worker processes, each of which loads the checkpoint's
    export config again (a spec holds torch modules, which do not travel between processes). One export is one core
    of Python for minutes (d3-nano's text graph: 262 s on the H100's host), so on a host with cores to spare the
    graphs take about the time of the longest, at the cost of a copy of the fp32 model in each worker."""

    def __init__(self, config_class: type, checkpoint: Path | None = None, jobs: int = 1, seed: int = 0):
        self.config_class, self.checkpoint, self.seed = config_class, checkpoint, seed
        self.pool = None
        if jobs > 1:
            if checkpoint is None:
                raise ValueError("exports in worker processes need the checkpoint's directory")
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            # Spawned, not forked: this process's torch and OpenMP threads do not survive a fork.
            self.pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))
        self.started: dict[Path, Any] = {}

    def start(self, key: SpecKey, path: Path) -> None:
        """Begin exporting `key` to `path` now, where workers run; otherwise `wait` exports it."""
        if self.pool is not None and path not in self.started:
            self.started[path] = self.pool.submit(_export_in_worker, self.config_class, str(self.checkpoint), key,
                                                  str(path), self.seed)

    def wait(self, spec: GraphSpec, path: Path) -> Path:
        """`spec` written at `path`: by the worker `start` gave it, or here and now."""
        started = self.started.pop(path, None)
        if started is None:
            return export_graph(spec, path)
        return Path(started.result())

    def forget(self, path: Path) -> None:
        """No wait for `path`'s export any more: its worker, if it has one, has finished with the file when this
        returns (its failure ignored), so the file may be removed."""
        started = self.started.pop(path, None)
        if started is not None and not started.cancel():
            started.exception()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> GraphExports:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
