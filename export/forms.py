"""The forms export writes beside (or instead of) the portable fp32 graphs: each graph the form rewrites converted to
half precision (export/half_precision.py) and written with its weights in fp16, then the whole runtime on that form
gated against the torch fp32 model on answers (export/answer_gate.py). A form that fails its gate is not written:
its files are removed, export says why, and the manifest records the refusal. Forms for the same providers are
tried in the order declared (most half first) and only until one is written: an artifact holds at most one form
per provider set."""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..runtime.artifact import FormEntry, Manifest
from ..runtime.linked_weights import links_path
from .answer_gate import gate_answers
from .config import ExportConfig, HalfForm, ParityError
from .graph_export import GraphExports
from .progress import Progress
from .weights import TracedGraph
from .half_precision import convert_to_half

HALF_DTYPE = "float16"


def form_files(form: HalfForm) -> dict[str, str]:
    return {graph: f"{graph}.{form.name}.onnx" for graph in form.graphs}


def remove_form_files(root: Path, files: dict[str, str]) -> None:
    """A form's graph files (by graph name) and their weights, where they are."""
    for file in files.values():
        for path in (root / file, root / f"{file}.data", links_path(root / file)):
            path.unlink(missing_ok=True)


def form_keys(form: HalfForm) -> dict[str, tuple[str, ...]]:
    """The trace each graph of `form` converts: the fused one (every fused rung of a ladder converts the same
    fused graphs, traced once), or the portable graph's."""
    return {graph: ("fused", graph) if graph in form.sources else ("portable", graph) for graph in form.graphs}


def form_steps(forms: list[HalfForm]) -> int:
    """The progress steps `write_forms` takes at most: two a form."""
    return 2 * len(forms)


def start_form_traces(config: ExportConfig, forms: list[HalfForm], exports: GraphExports) -> None:
    """Begin every trace `forms` convert, where `exports` runs workers (a fused graph shared by rungs once)."""
    for form in forms:
        for key in form_keys(form).values():
            exports.start(key)


def traced_source(config: ExportConfig, exports: GraphExports, form: HalfForm, graph: str) -> TracedGraph:
    key = form_keys(form)[graph]
    spec = form.sources[graph] if key[0] == "fused" else next(s for s in config.graphs() if s.name == graph)
    return exports.wait(key, spec)


def gate_form(config: ExportConfig, staging: Path, form: HalfForm, device: str,
              detail: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """The runtime on `form` (staged artifact, `device`) against the torch fp32 model on the form's questions;
    `detail(line)` says how long each part took."""
    from ..runtime.artifact import Artifact
    from ..runtime.engine import EngineOptions
    from ..runtime.service import DecisionService

    began = time.monotonic()
    service = DecisionService(Artifact.load(staging), EngineOptions(device=device, form=form.name))
    # Measured as serve measures at start-up, so a request's questions are grouped into calls as serve groups them:
    # in half precision the grouping moves answers (docs/decisions/form-gate-batching.md).
    sizing = service.batch_sizing()
    provider = service.provider
    detail(f"the runtime on {provider}: loaded, its rows a call measured, in {time.monotonic() - began:.1f} s")
    began = time.monotonic()
    answers = form.runtime_answers(service)
    detail(f"the questions through the runtime in {time.monotonic() - began:.1f} s")
    service.close()
    del service  # its sessions and their device memory go before the torch model comes
    gc.collect()
    began = time.monotonic()
    with config.reference_on(device):
        streamed = f", {config.stream_bytes / 2**30:.1f} GiB of layers at a time" if config.stream_bytes else ""
        detail(f"the torch reference on {device} in {time.monotonic() - began:.1f} s{streamed}")
        began = time.monotonic()
        report = gate_answers(form.reference_pairs(answers), form.tolerance)
    detail(f"{report['questions']} questions through the torch reference in {time.monotonic() - began:.1f} s")
    return {**report, "device": device, "provider": provider, "batch_rows": sizing.describe()}


def write_forms(config: ExportConfig, forms: list[HalfForm], staging: Path, manifest: Manifest, device: str,
                progress: Progress, exports: GraphExports,
                write: Callable[[Any, Path, TracedGraph], None]) -> Manifest:
    """Each of `forms` (the config's) written and gated in `staging`, but none after a written one for the same
    providers; the manifest that records them (written). `write(model, path, traced)` writes a converted graph
    with the weights of `traced`."""
    written: set[tuple[str, ...]] = set()
    for form in forms:
        if form.providers in written:
            progress(f"the {form.name} form is not needed: a form for {', '.join(form.providers)} is written")
            continue
        files = form_files(form)
        progress(f"writing the {form.name} form: "
                 + ", ".join(f"{graph} at {form.precision_of(graph).name}" for graph in form.graphs)
                 + ", readout in float32")
        for graph, outputs in form.graphs.items():
            traced = traced_source(config, exports, form, graph)
            half = convert_to_half(traced.proto(), outputs, form.precision_of(graph))
            write(half, staging / files[graph], traced)
        entry = FormEntry(HALF_DTYPE, list(form.providers), files,
                          precisions={graph: form.precision_of(graph).name for graph in form.graphs})
        replace(manifest, forms={**manifest.forms, form.name: entry}).write(staging)
        progress(f"checking the {form.name} form's answers against the torch fp32 model on {device}")
        try:
            entry = replace(entry, gate=gate_form(config, staging, form, device, progress.detail))
            written.add(form.providers)
        except Exception as exc:  # noqa: BLE001 - a form this onnxruntime cannot run is refused like one that fails
            reason = str(exc) if isinstance(exc, ParityError) else \
                f"onnxruntime could not run it on {device}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            print(f"the {form.name} form is not written: {reason}", file=sys.stderr)
            remove_form_files(staging, files)
            entry = FormEntry(HALF_DTYPE, list(form.providers), refused=reason)
        manifest = replace(manifest, forms={**manifest.forms, form.name: entry})
    manifest.write(staging)
    return manifest
