"""How export writes each graph (export/graph_export.py): without the optimizer rules it leaves out, the graphs
are those of the optimizer's full rule set; in worker processes (`--jobs`), the artifact is the one written in one
process."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
import torch

from scripts.export_rules_timing import same_graph
from systemone.export.graph_export import SKIPPED_RULES, export_graph
from systemone.export.pipeline import export_checkpoint
from systemone.export.source import resolve_checkpoint
from systemone.models.registry import FAMILIES
from systemone.runtime.artifact import Manifest


def _config(checkpoint: Path):
    checkpoint = resolve_checkpoint(str(checkpoint), None)
    return FAMILIES.recognise(checkpoint).load_export_config()(checkpoint)


@pytest.mark.parametrize("family, graph", [("d3", "text"), ("d3", "vision"), ("d1", "text"), ("d1", "vision")])
def test_the_portable_graphs_are_those_of_the_full_rule_set(family, graph, request, tmp_path):
    # d3's causal graph: the chunked delta rule in a Scan, with the state in and out (the most Slices of any graph).
    names = ("d3_causal_checkpoint", "d3_causal_artifact") if family == "d3" else ("d1_checkpoint", "d1_artifact")
    checkpoint, artifact = (request.getfixturevalue(name) for name in names)
    spec = next(s for s in _config(checkpoint).graphs() if s.name == graph)
    torch.manual_seed(0)
    full = export_graph(spec, tmp_path / spec.file, skipped_rules=())
    assert same_graph(artifact / spec.file, full)


@pytest.mark.parametrize("family, graph", [("d3", "text"), ("d3", "vision"), ("d1", "text"), ("d1", "vision")])
def test_the_fused_graphs_are_those_of_the_full_rule_set(family, graph, request, tmp_path):
    checkpoint = request.getfixturevalue("d3_causal_checkpoint" if family == "d3" else "d1_checkpoint")
    spec = next(form for form in _config(checkpoint).forms() if form.sources).sources[graph]
    (tmp_path / "skipped").mkdir(), (tmp_path / "full").mkdir()
    assert same_graph(export_graph(spec, tmp_path / "skipped" / spec.file),
                      export_graph(spec, tmp_path / "full" / spec.file, skipped_rules=()))


def test_the_optimizer_runs_without_the_skipped_rules_and_gets_them_back(monkeypatch, tmp_path):
    import onnxscript.rewriter as rewriter

    before = rewriter._DEFAULT_REWRITE_RULES
    assert SKIPPED_RULES <= {rule.name for rule in before}, "onnxscript no longer has the rule export leaves out"
    seen = []
    monkeypatch.setattr(torch.onnx, "export",
                        lambda *args, **kwargs: seen.append({r.name for r in rewriter._DEFAULT_REWRITE_RULES}))
    monkeypatch.setattr(onnx.checker, "check_model", lambda path: None)

    class Spec:
        inputs = outputs = []
        dynamic_shapes = translations = None
        module = example_inputs = staticmethod(lambda: None)

    export_graph(Spec, tmp_path / "g.onnx")
    assert seen and not seen[0] & SKIPPED_RULES
    assert seen[0] == {rule.name for rule in before} - SKIPPED_RULES
    assert rewriter._DEFAULT_REWRITE_RULES is before
    export_graph(Spec, tmp_path / "g.onnx", skipped_rules=())
    assert seen[1] == {rule.name for rule in before}


def _gate_figures(manifest: Manifest) -> dict:
    """Each form's gate but `batch_rows`, the call cost start-up measured (a timing)."""
    return {name: {k: v for k, v in form.gate.items() if k != "batch_rows"} for name, form in manifest.forms.items()}


def test_graphs_exported_in_worker_processes_make_the_same_artifact(d3_causal_checkpoint, d3_causal_artifact, tmp_path):
    out = export_checkpoint(str(d3_causal_checkpoint), tmp_path / "art", jobs=2)
    graphs = sorted(path.name for path in d3_causal_artifact.glob("*.onnx"))
    assert graphs == sorted(path.name for path in out.glob("*.onnx"))
    assert len(graphs) >= 4  # the portable text and vision graphs, and the form's
    for name in graphs:
        assert same_graph(out / name, d3_causal_artifact / name), name
    alone, workers = Manifest.read(d3_causal_artifact), Manifest.read(out)
    assert workers.parity == alone.parity
    assert _gate_figures(workers) == _gate_figures(alone)
    assert not list(tmp_path.glob(".art.*")), "a staging folder was left behind"
