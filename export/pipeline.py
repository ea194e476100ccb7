"""checkpoint -> ONNX artifact, for any registered family: recognise, load the family's export config, export
its graphs, check their axes and its parity gates, then write.

The artifact is assembled in a staging directory and moved into place only when every graph's declared axes are
symbolic and every parity gate holds; otherwise nothing is written.
"""

from __future__ import annotations

import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from importlib import metadata
from pathlib import Path
from typing import Any

from ..models.registry import FAMILIES, FamilyRegistry
from ..runtime.artifact import GraphEntry, Manifest
from ..runtime.session import resolve_device
from .config import ExportConfig, HalfForm, ParityError
from .forms import form_steps, remove_form_files, start_sources, write_forms
from .graph_export import OPSET, GraphExports
from .parity import DEFAULT_ATOL, DEFAULT_PROB_ATOL, PARITY_LENGTHS
from .source import checkpoint_name, file_hashes, resolve_checkpoint


def _versions() -> dict[str, str]:
    names = ["systemone-onnx", "torch", "transformers", "onnx", "onnxscript", "onnxruntime", "tokenizers"]
    found = {"python": platform.python_version()}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


class Progress:
    def __init__(self, total: int, stream=sys.stderr):
        self.total, self.step, self.stream, self.start = total, 0, stream, time.monotonic()

    def __call__(self, message: str) -> None:
        self.step += 1
        print(f"[{self.step}/{self.total} {time.monotonic() - self.start:6.1f}s] {message}", file=self.stream,
              flush=True)


def symbolic_axes(model_path: Path, axes: dict[str, dict[int, str]]) -> dict[str, list[str | int]]:
    """Check that every declared batch/sequence axis of the graph's inputs is symbolic, consistently named."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    shapes = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.input}
    symbols: dict[str, str] = {}
    for name, wanted in axes.items():
        if name not in shapes:
            raise ParityError(f"exported graph lacks input {name!r}")
        for axis, role in wanted.items():
            dim = shapes[name][axis]
            if not isinstance(dim, str) or not dim:
                raise ParityError(f"exported graph pins {name}[{axis}] ({role}) to {dim}: the export specialised "
                                  "a dynamic axis to the trace shape")
            if symbols.setdefault(role, dim) != dim:
                raise ParityError(f"exported graph gives the {role} axis two names ({symbols[role]}, {dim})")
    return shapes


def export_checkpoint(source: str, out: str | Path, *, revision: str | None = None, atol: float = DEFAULT_ATOL,
                      prob_atol: float = DEFAULT_PROB_ATOL, lengths: Sequence[int] = PARITY_LENGTHS,
                      overwrite: bool = False, seed: int = 0, families: FamilyRegistry = FAMILIES,
                      forms: Sequence[str] | None = None, gate_device: str = "auto", jobs: int = 1) -> Path:
    """Export the checkpoint `source` (directory or hub id) to an artifact directory `out`, with the family's
    half-precision `forms` (None: every one it declares; empty: the portable graphs only), their answer gates run
    on `gate_device` (auto: CUDA where onnxruntime has it, else the CPU); with `jobs` > 1 the graphs are exported in
    that many worker processes at once (export/graph_export.py, `GraphExports`)."""
    import torch

    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty (pass --overwrite to replace it)")
    progress = Progress(3)
    progress(f"resolving checkpoint {source}")
    checkpoint = resolve_checkpoint(source, revision)
    entry = families.recognise(checkpoint)
    progress(f"loading the torch reference model of family {entry.name} (fp32)")
    config: ExportConfig = entry.load_export_config()(checkpoint)
    graphs = config.graphs()
    gates = config.gates(atol, prob_atol, tuple(lengths), seed)
    half_forms = _chosen_forms(config, forms)
    progress.total += len(graphs) + 1 + len(gates) + form_steps(half_forms)
    torch.manual_seed(seed)

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    exports = GraphExports(type(config), checkpoint, jobs, seed)
    try:
        for spec in graphs:
            exports.start(("portable", spec.name), staging / spec.file)
        sources = start_sources(half_forms, staging, exports, progress)
        files = config.write_runtime_files(staging)
        for spec in graphs:
            progress(f"exporting the {spec.name} graph with torch.onnx (dynamo, opset {OPSET})")
            exports.wait(spec, staging / spec.file)
        roles = sorted({role for g in graphs for axes in g.axes.values() for role in axes.values()})
        progress(f"checking that the {', '.join(roles)} axes are symbolic")
        shapes = {spec.name: symbolic_axes(staging / spec.file, spec.axes) for spec in graphs}
        reports: dict[str | None, dict[str, Any]] = {}
        for gate in gates:
            progress(gate.title)
            reports[gate.graph] = gate.check(staging, files)
        progress("writing the artifact")
        manifest = Manifest(
            family=entry.name, source=checkpoint_name(source), checkpoint=str(checkpoint),
            source_files=file_hashes(checkpoint),
            max_model_len=config.max_model_len, opset=OPSET, model=files.model_fields,
            tokenizer_class=files.tokenizer_class, special_tokens=files.special_tokens,
            graphs={spec.name: GraphEntry(spec.file, shapes[spec.name], spec.outputs, "float32",
                                          reports.get(spec.name)) for spec in graphs},
            parity=reports[None], versions=_versions(),
            exported_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        manifest = write_forms(config, half_forms, staging, manifest, resolve_device(gate_device), progress, sources)
        if out.exists():
            shutil.rmtree(out)
        staging.chmod(0o755)
        staging.rename(out)
    finally:
        exports.close()
        if staging.exists():
            shutil.rmtree(staging)
    print(f"artifact written to {out} (parity: {manifest.parity['summary']})", file=sys.stderr)
    _print_forms(manifest)
    return out


def add_forms(source: str, artifact: str | Path, *, revision: str | None = None, forms: Sequence[str] | None = None,
              gate_device: str = "auto", families: FamilyRegistry = FAMILIES, jobs: int = 1) -> Manifest:
    """Write the half-precision `forms` (None: every one the family declares) onto `artifact`, an export of the
    checkpoint `source`, in place of the forms it has: for an artifact exported where the gate could not run on
    the forms' device. The portable graphs and their gates are kept as they are. `jobs` as `export_checkpoint`
    takes it."""
    artifact = Path(artifact)
    manifest = Manifest.read(artifact)
    progress = Progress(3)
    progress(f"resolving checkpoint {source}")
    checkpoint = resolve_checkpoint(source, revision)
    if file_hashes(checkpoint) != manifest.source_files:
        raise ValueError(f"{artifact} was not exported from {source}: the checkpoint's files differ from those its "
                         "manifest records")
    entry = families.recognise(checkpoint)
    progress(f"loading the torch reference model of family {entry.name} (fp32)")
    config: ExportConfig = entry.load_export_config()(checkpoint)
    half_forms = _chosen_forms(config, forms)
    progress.total += form_steps(half_forms)
    for form in manifest.forms.values():
        remove_form_files(artifact, form.graphs)
    with GraphExports(type(config), checkpoint, jobs) as exports:
        sources = start_sources(half_forms, artifact, exports, progress)
        manifest = write_forms(config, half_forms, artifact, replace(manifest, forms={}), resolve_device(gate_device),
                               progress, sources)
    _print_forms(manifest)
    return manifest


def _chosen_forms(config: ExportConfig, names: Sequence[str] | None) -> list[HalfForm]:
    declared = config.forms()
    if names is None:
        return declared
    unknown = sorted(set(names) - {form.name for form in declared})
    if unknown:
        raise ValueError(f"forms {', '.join(unknown)} are not among the family's: "
                         f"{', '.join(form.name for form in declared) or 'none'}")
    return [form for form in declared if form.name in names]


def _print_forms(manifest: Manifest) -> None:
    for name, form in manifest.forms.items():
        print(f"form {name}: " + (f"refused ({form.refused})" if form.refused else form.gate["summary"]),
              file=sys.stderr)
