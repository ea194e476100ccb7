"""The forms export writes beside the portable fp32 graphs: each graph the form rewrites converted to half
precision (export/half_precision.py), then the whole runtime on that form gated against the torch fp32 model on
answers (export/answer_gate.py). A form that fails its gate is not written: its files are removed, export says why,
and the manifest records the refusal. Forms for the same providers are tried in the order declared (most half
first) and only until one is written: an artifact holds at most one form per provider set."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..runtime.artifact import FormEntry, Manifest
from .answer_gate import gate_answers
from .config import ExportConfig, HalfForm, ParityError
from .half_precision import convert_to_half

HALF_DTYPE = "float16"


def form_files(form: HalfForm) -> dict[str, str]:
    return {graph: f"{graph}.{form.name}.onnx" for graph in form.graphs}


def remove_form_files(root: Path, files: dict[str, str]) -> None:
    """A form's graph files (by graph name) and their weights, where they are."""
    for file in files.values():
        for path in (root / file, root / f"{file}.data"):
            path.unlink(missing_ok=True)


def gate_form(config: ExportConfig, staging: Path, form: HalfForm, device: str) -> dict[str, Any]:
    """The runtime on `form` (staged artifact, `device`) against the torch fp32 model on the form's questions."""
    from ..runtime.artifact import Artifact
    from ..runtime.engine import EngineOptions
    from ..runtime.service import DecisionService

    config.reference_on(device)
    service = DecisionService(Artifact.load(staging), EngineOptions(device=device, form=form.name))
    report = gate_answers(form.answer_pairs(service), form.tolerance)
    return {**report, "device": device, "provider": service.provider}


def write_forms(config: ExportConfig, forms: list[HalfForm], staging: Path, manifest: Manifest, device: str,
                progress: Callable[[str], None]) -> Manifest:
    """Each of `forms` (the config's) written and gated in `staging`, but none after a written one for the same
    providers; the manifest that records them (written)."""
    written: set[tuple[str, ...]] = set()
    for form in forms:
        if form.providers in written:
            progress(f"the {form.name} form is not needed: a form for {', '.join(form.providers)} is written")
            continue
        files = form_files(form)
        progress(f"writing the {form.name} form: {', '.join(form.graphs)} at {form.precision.name}, readout in "
                 "float32")
        for graph, outputs in form.graphs.items():
            convert_to_half(staging / manifest.graphs[graph].file, staging / files[graph], outputs, form.precision)
        entry = FormEntry(HALF_DTYPE, list(form.providers), files)
        replace(manifest, forms={**manifest.forms, form.name: entry}).write(staging)
        progress(f"checking the {form.name} form's answers against the torch fp32 model on {device}")
        try:
            entry = replace(entry, gate=gate_form(config, staging, form, device))
            written.add(form.providers)
        except ParityError as exc:
            print(f"the {form.name} form is not written: {exc}", file=sys.stderr)
            remove_form_files(staging, files)
            entry = FormEntry(HALF_DTYPE, list(form.providers), refused=str(exc))
        manifest = replace(manifest, forms={**manifest.forms, form.name: entry})
    manifest.write(staging)
    return manifest
