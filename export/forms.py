"""The forms export writes beside the portable fp32 graphs: each graph the form rewrites converted to half
precision (export/half_precision.py), then the whole runtime on that form gated against the torch fp32 model on
answers (export/answer_gate.py). A form that fails its gate is not written: its files are removed, export says why,
and the manifest records the refusal. Forms for the same providers are tried in the order declared (most half
first) and only until one is written: an artifact holds at most one form per provider set."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..runtime.artifact import FormEntry, Manifest
from .answer_gate import gate_answers
from .config import ExportConfig, GraphSpec, HalfForm, ParityError
from .graph_export import GraphExports
from .half_precision import Precision, convert_to_half

HALF_DTYPE = "float16"


def form_files(form: HalfForm) -> dict[str, str]:
    return {graph: f"{graph}.{form.name}.onnx" for graph in form.graphs}


def remove_form_files(root: Path, files: dict[str, str]) -> None:
    """A form's graph files (by graph name) and their weights, where they are."""
    for file in files.values():
        for path in (root / file, root / f"{file}.data"):
            path.unlink(missing_ok=True)


class _FormSources:
    """The fp32 exports of the graphs forms export themselves (`HalfForm.sources`): each written once, however many
    forms of the ladder convert it, and removed when the forms are written."""

    def __init__(self, staging: Path, progress: Callable[[str], None], exports: GraphExports):
        self.staging, self.progress, self.exports = staging, progress, exports
        self.paths: dict[int, Path] = {}  # by the spec's identity: the forms of one ladder share their specs
        self.exported: set[int] = set()

    def start(self, forms: Sequence[HalfForm]) -> None:
        """Each source of `forms` given its file, and begun where the exports run in workers."""
        for form in forms:
            for graph, spec in form.sources.items():
                if id(spec) not in self.paths:
                    path = self.staging / f"{graph}.source{len(self.paths)}.float32.onnx"
                    self.paths[id(spec)] = path
                    self.exports.start(("form", form.name, graph), path)

    def path(self, graph: str, spec: GraphSpec) -> Path:
        path = self.paths[id(spec)]
        if id(spec) not in self.exported:
            self.progress(f"exporting the {graph} graph with onnxruntime's fused ops (fp32, before conversion)")
            self.exports.wait(spec, path)
            self.exported.add(id(spec))
        return path

    def remove(self) -> None:
        for path in self.paths.values():
            self.exports.forget(path)
        remove_form_files(self.staging, {str(key): path.name for key, path in self.paths.items()})


class _Conversions:
    """Each (source graph, precision) converted once per ladder: a later rung that converts the same graph at the
    same precision (d3's vision graph: fp16 products on every rung) takes a linked copy of the first conversion,
    which is kept aside until the forms are written."""

    def __init__(self, staging: Path):
        self.staging = staging
        self.kept: dict[tuple[str, str, tuple[str, ...]], Path] = {}

    def convert(self, source: Path, target: Path, outputs: Sequence[str], precision: Precision) -> None:
        key = (str(source), precision.name, tuple(outputs))
        kept = self.kept.get(key)
        if kept is None:
            convert_to_half(source, target, outputs, precision)
            kept = self.staging / f"{target.stem}.kept{len(self.kept)}.onnx"
            _link_graph(target, kept)
            self.kept[key] = kept
        else:
            _link_graph(kept, target)

    def remove(self) -> None:
        remove_form_files(self.staging, {str(i): path.name for i, path in enumerate(self.kept.values())})


def _link_graph(source: Path, target: Path) -> None:
    """`source` (a graph with its weights in `source.name + '.data'`) as `target`, its weights linked, not copied."""
    import onnx

    model = onnx.load(str(source), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = f"{target.name}.data"
    onnx.save(model, str(target))
    os.link(source.with_name(f"{source.name}.data"), target.with_name(f"{target.name}.data"))


def gate_form(config: ExportConfig, staging: Path, form: HalfForm, device: str) -> dict[str, Any]:
    """The runtime on `form` (staged artifact, `device`) against the torch fp32 model on the form's questions."""
    from ..runtime.artifact import Artifact
    from ..runtime.engine import EngineOptions
    from ..runtime.service import DecisionService

    service = DecisionService(Artifact.load(staging), EngineOptions(device=device, form=form.name))
    # Measured as serve measures at start-up, so a request's questions are grouped into calls as serve groups them:
    # in half precision the grouping moves answers (d1-3B on an H200: median |dp| 0.0022 with calls split by
    # length, 0.0030 with calls filled).
    sizing = service.batch_sizing()
    with config.reference_on(device):
        report = gate_answers(form.answer_pairs(service), form.tolerance)
    return {**report, "device": device, "provider": service.provider, "batch_rows": sizing.describe()}


def form_steps(forms: list[HalfForm]) -> int:
    """The progress steps `write_forms` takes at most: two a form, one a graph a form exports itself."""
    return 2 * len(forms) + len({id(spec) for form in forms for spec in form.sources.values()})


def start_sources(forms: list[HalfForm], staging: Path, exports: GraphExports,
                  progress: Callable[[str], None]) -> _FormSources:
    """The graphs `forms` export themselves, planned in `staging` and begun where `exports` runs workers: pass it
    to `write_forms`."""
    sources = _FormSources(staging, progress, exports)
    sources.start(forms)
    return sources


def write_forms(config: ExportConfig, forms: list[HalfForm], staging: Path, manifest: Manifest, device: str,
                progress: Callable[[str], None], sources: _FormSources) -> Manifest:
    """Each of `forms` (the config's) written and gated in `staging`, but none after a written one for the same
    providers; the manifest that records them (written). `sources`: the forms' own graphs as `start_sources`
    planned them."""
    written: set[tuple[str, ...]] = set()
    conversions = _Conversions(staging)
    try:
        for form in forms:
            if form.providers in written:
                progress(f"the {form.name} form is not needed: a form for {', '.join(form.providers)} is written")
                continue
            files = form_files(form)
            progress(f"writing the {form.name} form: "
                     + ", ".join(f"{graph} at {form.precision_of(graph).name}" for graph in form.graphs)
                     + ", readout in float32")
            for graph, outputs in form.graphs.items():
                spec = form.sources.get(graph)
                source = staging / manifest.graphs[graph].file if spec is None else sources.path(graph, spec)
                conversions.convert(source, staging / files[graph], outputs, form.precision_of(graph))
            entry = FormEntry(HALF_DTYPE, list(form.providers), files,
                              precisions={graph: form.precision_of(graph).name for graph in form.graphs})
            replace(manifest, forms={**manifest.forms, form.name: entry}).write(staging)
            progress(f"checking the {form.name} form's answers against the torch fp32 model on {device}")
            try:
                entry = replace(entry, gate=gate_form(config, staging, form, device))
                written.add(form.providers)
            except Exception as exc:  # noqa: BLE001 - a form this onnxruntime cannot run is refused like one that fails
                reason = str(exc) if isinstance(exc, ParityError) else \
                    f"onnxruntime could not run it on {device}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                print(f"the {form.name} form is not written: {reason}", file=sys.stderr)
                remove_form_files(staging, files)
                entry = FormEntry(HALF_DTYPE, list(form.providers), refused=reason)
            manifest = replace(manifest, forms={**manifest.forms, form.name: entry})
    finally:
        sources.remove()
        conversions.remove()
    manifest.write(staging)
    return manifest
