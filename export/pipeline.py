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
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from ..models.registry import FAMILIES, FamilyRegistry
from ..runtime.artifact import PORTABLE, GraphEntry, Manifest
from ..runtime.session import resolve_device
from ..runtime.tokenizer import PromptTokenizer
from .config import ExportConfig, HalfForm, ParityError
from .forms import form_steps, start_form_traces, traced_source, write_forms
from .graph_export import OPSET, GraphExports, TracedGraph
from .parity import DEFAULT_ATOL, DEFAULT_PROB_ATOL, PARITY_LENGTHS
from .progress import Progress
from .source import checkpoint_name, file_hashes, resolve_checkpoint
from .weights import CheckpointTensors, Linker, graph_tensors, write_graph

WEIGHTS = ("copy", "link")  # how an artifact holds its weights (`--weights`)

# The portable fp32 graphs are not written by default for a model this large: on a CPU they would hold four bytes
# a parameter and answer too slowly to serve (d3 (27B): 108 GB); `--forms portable` still writes them.
PORTABLE_MAX_PARAMETERS = 10_000_000_000


def _versions() -> dict[str, str]:
    names = ["systemone-onnx", "torch", "transformers", "onnx", "onnxscript", "onnxruntime", "tokenizers"]
    found = {"python": platform.python_version()}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def symbolic_axes(model, axes: dict[str, dict[int, str]]) -> dict[str, list[str | int]]:
    """Check that every declared batch/sequence axis of the graph's inputs (a ModelProto) is symbolic, consistently
    named."""
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


@dataclass(frozen=True)
class FormPlan:
    """What an export writes: the portable fp32 graphs or not, the half-precision forms to try, and why."""

    portable: bool
    forms: list[HalfForm]
    why: str


def plan_forms(config: ExportConfig, names: Sequence[str] | None, device: str) -> FormPlan:
    """`names` (`portable` and form names) as asked, or, with None, what the gate device can check: on CUDA the
    family's CUDA forms only (their gate runs there; the portable graphs are for a CPU, and `--forms portable,...`
    writes them too), on a CPU the portable graphs only (a CUDA form gated without CUDA is gated on emulated
    kernels, and nobody serves it there: `--forms` names those to write them anyway)."""
    declared = config.forms()
    parameters = config.skeleton.parameter_count()
    if names is None:
        if device == "cuda":
            forms = [form for form in declared if "cuda" in form.providers]
            if forms:
                return FormPlan(False, forms, f"the CUDA forms, gated on {device}; no portable graphs "
                                               "(--forms portable,... writes them as well)")
        if parameters > PORTABLE_MAX_PARAMETERS:
            raise ValueError(f"the portable fp32 graphs of a {parameters / 1e9:.0f}B-parameter model would hold "
                             f"{4 * parameters / 1e9:.0f} GB and be too slow to serve on a CPU, and no CUDA device "
                             "can gate a CUDA form here: export on a machine with CUDA, or name the forms with "
                             "--forms (portable for the fp32 graphs)")
        return FormPlan(True, [], "the portable fp32 graphs, which every provider runs; no CUDA form without a CUDA "
                                  "device to gate it (--forms NAME writes one anyway)")
    names = list(dict.fromkeys(names))
    unknown = sorted(set(names) - {PORTABLE} - {form.name for form in declared})
    if unknown:
        raise ValueError(f"forms {', '.join(unknown)} are not among the family's: "
                         f"{', '.join([PORTABLE] + [form.name for form in declared])}")
    forms = [form for form in declared if form.name in names]
    if PORTABLE not in names and not forms:
        raise ValueError("no form to write: name portable or a half-precision form")
    return FormPlan(PORTABLE in names, forms, "as --forms asks")


class _Writer:
    """Writes traced graphs with their weights from the checkpoint, showing the bytes as they go."""

    def __init__(self, checkpoint: Path, progress: Progress, root: Path, weights: str = "copy"):
        if weights not in WEIGHTS:
            raise ValueError(f"weights={weights!r}: copy or link")
        self.tensors = CheckpointTensors(checkpoint)
        self.progress = progress
        self.linker = Linker(root, self.tensors, say=progress.detail) if weights == "link" else None

    @property
    def linked(self) -> dict[str, int]:
        """The checkpoint files linked so far, by their path in the artifact, with sizes (the manifest's)."""
        return dict(self.linker.files) if self.linker is not None else {}

    def __call__(self, model, path: Path, traced: TracedGraph, check: bool = False) -> Path:
        """`model` written at `path` with the weights of `traced`; `check`: run onnx's checker on it (a portable
        graph: onnx has no schema for onnxruntime's fused ops, and the half-precision rewrite leaves its casts
        out of order, which onnxruntime sorts)."""
        import onnx
        from onnx.helper import tensor_dtype_to_np_dtype

        expected = sum(int(np.prod(t.dims, dtype=np.int64)) * _itemsize(t.data_type, tensor_dtype_to_np_dtype)
                       for t in graph_tensors(model))
        self.progress.writing(f"{path.name}.data", expected)
        write_graph(model, path, traced.book, self.tensors, written=self.progress.wrote, linker=self.linker)
        self.progress.writing("", 0)
        if check:
            onnx.checker.check_model(str(path))
        return path


def _itemsize(data_type: int, to_numpy) -> int:
    import onnx

    if data_type == onnx.TensorProto.BFLOAT16:
        return 2
    return np.dtype(to_numpy(data_type)).itemsize


def export_checkpoint(source: str, out: str | Path, *, revision: str | None = None, atol: float = DEFAULT_ATOL,
                      prob_atol: float = DEFAULT_PROB_ATOL, lengths: Sequence[int] = PARITY_LENGTHS,
                      overwrite: bool = False, seed: int = 0, families: FamilyRegistry = FAMILIES,
                      forms: Sequence[str] | None = None, gate_device: str = "auto", jobs: int = 1,
                      weights: str = "copy") -> Path:
    """Export the checkpoint `source` (directory or hub id) to an artifact directory `out`: the forms `forms` names
    (`portable` for the fp32 graphs; None: what `plan_forms` chooses for the gate device), the half-precision ones
    gated on `gate_device` (auto: CUDA where onnxruntime has it, else the CPU); with `jobs` > 1 the graphs are
    traced in that many worker processes at once (export/graph_export.py, `GraphExports`). No model is held in
    memory: graphs are traced without weights, which go from the checkpoint into each graph as it is written; with
    `weights="link"` those used as stored are linked to the checkpoint's files instead (export/weights.py,
    `Linker`)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty (pass --overwrite to replace it)")
    progress = Progress(3)
    progress(f"resolving checkpoint {source}")
    checkpoint = resolve_checkpoint(source, revision)
    entry = families.recognise(checkpoint)
    progress(f"reading the configs of family {entry.name} (its model built without weights)")
    config: ExportConfig = entry.load_export_config()(checkpoint)
    device = resolve_device(gate_device)
    plan = plan_forms(config, forms, device)
    graphs = config.graphs()
    gates = config.gates(atol, prob_atol, tuple(lengths), seed) if plan.portable else []
    progress.total += 2 + len(graphs) + (1 + len(gates) if plan.portable else 0) + form_steps(plan.forms)
    progress(f"writing {', '.join(([PORTABLE] if plan.portable else []) + [f.name for f in plan.forms][:1])}"
             + (" (or the next form that passes its gate)" if len(plan.forms) > 1 else "") + f": {plan.why}")

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    exports = GraphExports(type(config), checkpoint, jobs, seed)
    write = _Writer(checkpoint, progress, staging, weights)
    try:
        if plan.portable:
            for spec in graphs:
                exports.start(("portable", spec.name))
        start_form_traces(config, plan.forms, exports)
        files = config.write_runtime_files(staging)
        shapes = {}
        for spec in graphs:
            # Without the portable graphs, the first form's trace of the graph gives its inputs' shapes.
            progress(f"tracing the {spec.name} graph with torch.onnx (dynamo, opset {OPSET}), no weights")
            traced = (exports.wait(("portable", spec.name), spec) if plan.portable
                      else traced_source(config, exports, plan.forms[0], spec.name))
            shapes[spec.name] = symbolic_axes(traced.proto(), spec.axes)
            if plan.portable:
                write(traced.proto(), staging / spec.file, traced, check=True)
        reports: dict[str | None, dict[str, Any]] = {}
        if plan.portable:
            roles = sorted({role for g in graphs for axes in g.axes.values() for role in axes.values()})
            progress(f"checked that the {', '.join(roles)} axes are symbolic")
            with config.reference_on(device):
                for gate in gates:
                    progress(gate.title + f" (torch on {device})")
                    reports[gate.graph] = gate.check(staging, files)
        progress("writing the artifact")
        manifest = Manifest(
            family=entry.name, source=checkpoint_name(source), checkpoint=str(checkpoint),
            source_files=file_hashes(checkpoint),
            max_model_len=config.max_model_len, opset=OPSET, model=files.model_fields,
            tokenizer_class=files.tokenizer_class, special_tokens=files.special_tokens,
            max_token_chars=PromptTokenizer(staging / "tokenizer.json").max_token_chars(),
            graphs={spec.name: GraphEntry(spec.file if plan.portable else "", shapes[spec.name], spec.outputs,
                                          "float32", reports.get(spec.name)) for spec in graphs},
            parity=reports.get(None, {"summary": "no portable graphs written (the forms' gates say how they "
                                                 "answer)"}),
            versions=_versions(), exported_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        manifest = replace(manifest, linked=write.linked)
        manifest.write(staging)
        manifest = write_forms(config, plan.forms, staging, manifest, device, progress, exports, write)
        manifest = replace(manifest, linked=write.linked)
        manifest.write(staging)
        if not plan.portable and all(form.refused for form in manifest.forms.values()):
            raise ParityError("no form passed its gate, and no portable graphs were asked for: nothing to serve "
                              "(the manifest's refusals: " + "; ".join(f"{n}: {f.refused}" for n, f in
                                                                       manifest.forms.items()) + ")")
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
              gate_device: str = "auto", families: FamilyRegistry = FAMILIES, jobs: int = 1,
              weights: str = "copy") -> Manifest:
    """Write the half-precision `forms` (None: every one the family declares) onto `artifact`, an export of the
    checkpoint `source`, in place of the forms it has: for an artifact exported where the gate could not run on
    the forms' device. The portable graphs and their gates are kept as they are. `jobs` as `export_checkpoint`
    takes it, and `weights`."""
    from .forms import remove_form_files

    artifact = Path(artifact)
    manifest = Manifest.read(artifact)
    progress = Progress(3)
    progress(f"resolving checkpoint {source}")
    checkpoint = resolve_checkpoint(source, revision)
    if file_hashes(checkpoint) != manifest.source_files:
        raise ValueError(f"{artifact} was not exported from {source}: the checkpoint's files differ from those its "
                         "manifest records")
    entry = families.recognise(checkpoint)
    progress(f"reading the configs of family {entry.name} (its model built without weights)")
    config: ExportConfig = entry.load_export_config()(checkpoint)
    names = [name for name in forms if name != PORTABLE] if forms is not None else [f.name for f in config.forms()]
    half_forms = plan_forms(config, names, resolve_device(gate_device)).forms
    progress.total += form_steps(half_forms)
    for form in manifest.forms.values():
        remove_form_files(artifact, form.graphs)
    with GraphExports(type(config), checkpoint, jobs) as exports:
        start_form_traces(config, half_forms, exports)
        write = _Writer(checkpoint, progress, artifact, weights)
        manifest = write_forms(config, half_forms, artifact, replace(manifest, forms={}), resolve_device(gate_device),
                               progress, exports, write)
        manifest = replace(manifest, linked={**manifest.linked, **write.linked})
        manifest.write(artifact)
    _print_forms(manifest)
    return manifest


def _print_forms(manifest: Manifest) -> None:
    for name, form in manifest.forms.items():
        print(f"form {name}: " + (f"refused ({form.refused})" if form.refused else form.gate["summary"]),
              file=sys.stderr)
