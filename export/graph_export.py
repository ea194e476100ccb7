"""One graph spec -> one ONNX file, through torch.onnx's dynamo exporter: what export writes for the portable graphs
and for a form's own graphs (export/forms.py)."""

from __future__ import annotations

from pathlib import Path

from .config import GraphSpec

OPSET = 18


def export_graph(spec: GraphSpec, path: Path) -> Path:
    """Write `spec` to `path`, its weights beside it in `path.name + '.data'`; checked by onnx's checker."""
    import onnx
    import torch

    with torch.no_grad():
        torch.onnx.export(spec.module(), spec.example_inputs(), str(path), dynamo=True, opset_version=OPSET,
                          external_data=True, input_names=spec.inputs, output_names=spec.outputs,
                          dynamic_shapes=spec.dynamic_shapes, custom_translation_table=spec.translations,
                          verbose=False)
    onnx.checker.check_model(str(path))
    return path
