"""How export writes each graph (export/graph_export.py, export/weights.py): traced on a model with no weights, the
weights streamed from the checkpoint one at a time in the dtype each graph declares; without the optimizer rules it
leaves out, the graphs are those of the full rule set; in worker processes (`--jobs`), the artifact is the one
written in one process."""

from __future__ import annotations

import filecmp
import pickle
import weakref
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from systemone.export.graph_export import READABLE_WHILE_TRACED, SKIPPED_RULES, GraphExports, spec_of, trace_graph
from systemone.export.source import resolve_checkpoint
from systemone.export.weights import CheckpointTensors, WeightBook, recipe_of, write_graph
from systemone.models.registry import FAMILIES


def _config(checkpoint: Path):
    checkpoint = resolve_checkpoint(str(checkpoint), None)
    return FAMILIES.recognise(checkpoint).load_export_config()(checkpoint)


def traced(config, spec, fused: bool = False):
    """`spec` traced as export traces it (once a test run: tests/conftest.py), for tests of what comes after."""
    return GraphExports(type(config), config.checkpoint).wait(("fused" if fused else "portable", spec.name), spec)


def without_debug_records(graph: Path | onnx.ModelProto) -> bytes:
    """The graph as onnxruntime reads it: the exporter's per-node debug records (stack traces that name generated
    code by a counter, different from one export to the next in a process) taken out, subgraphs included."""
    model = onnx.load(str(graph), load_external_data=False) if isinstance(graph, Path) else graph

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
    return without_debug_records(a) == without_debug_records(b) and filecmp.cmp(f"{a}.data", f"{b}.data", False)


class ReadLog:
    """CheckpointTensors.read, recorded: the keys and sizes read, and the most arrays it returned alive at once."""

    def __init__(self, monkeypatch):
        self.reads: list[tuple[str, int]] = []
        self.live = self.most_live = 0
        real = CheckpointTensors.read

        def read(tensors, file, key):
            values = real(tensors, file, key)
            self.reads.append((key, values.size))
            self.live += 1
            self.most_live = max(self.most_live, self.live)
            holder = np.asarray(values).view()
            weakref.finalize(holder, self._released)
            return holder

        monkeypatch.setattr(CheckpointTensors, "read", read)

    def _released(self) -> None:
        self.live -= 1


def test_a_graph_is_traced_without_reading_its_weights(d3_causal_checkpoint, monkeypatch):
    # d3's fused causal text graph: the embedding table, and the most weights folded into recipes of any (the
    # joint projections' row slices, a layer each); the portable one adds a chunk loop that reads no weight, at
    # three times the trace.
    config = _config(d3_causal_checkpoint)
    log = ReadLog(monkeypatch)
    traced = trace_graph(config.graphs(fused=True)[0], config.skeleton.tensors)
    assert all(size <= READABLE_WHILE_TRACED for _, size in log.reads), log.reads
    assert not any(key.endswith("embed_tokens.weight") for key, _ in log.reads)
    virtual = [t for t in traced.proto().graph.initializer if recipe_of(t) is not None]
    assert sum(int(np.prod(t.dims)) for t in virtual) > 16_000_000  # the embedding table among them, unread


def test_the_weights_are_made_within_the_memory_bound_and_written_as_the_checkpoint_stores_them(
        d3_checkpoint, monkeypatch, tmp_path):
    config = _config(d3_checkpoint)
    text = traced(config, config.graphs()[0])
    log = ReadLog(monkeypatch)
    # A bound smaller than any weight: one made at a time, however many threads.
    path = write_graph(text.proto(), tmp_path / "text.onnx", text.book, config.skeleton.tensors, threads=4,
                       in_flight_bytes=1)
    assert log.most_live <= 2  # one weight, or the two a folded node reads
    (tmp_path / "threaded").mkdir()
    threaded = write_graph(text.proto(), tmp_path / "threaded" / "text.onnx", text.book,
                           config.skeleton.tensors, threads=4)
    assert log.most_live > 2  # several made at once
    for suffix in ("", ".data"):  # in the same order, byte for byte
        assert filecmp.cmp(f"{path}{suffix}", f"{threaded}{suffix}", shallow=False)
    written = {t.name: t for t in onnx.load(str(path)).graph.initializer}
    table = onnx.numpy_helper.to_array(written["front/embed_tokens.weight"])
    from safetensors.torch import load_file

    expected = load_file(str(d3_checkpoint / "model.safetensors"))["language_model.embed_tokens.weight"].float()
    assert np.array_equal(table, expected.numpy())


def test_a_half_precision_weight_is_written_in_fp16_from_its_recipe(tmp_path):
    from systemone.export.weights import Constant, virtual_tensor

    book = WeightBook()
    values = np.array([[1e-9, -3.0, 70000.0, 0.5]], dtype=np.float32)
    book.add("w", Constant(values))
    model = onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["w"], ["y"])], "g", [],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT16, [1, 4])],
        [virtual_tensor("w", onnx.TensorProto.FLOAT16, (1, 4))]))
    path = write_graph(model, tmp_path / "g.onnx", book, None)
    written = onnx.numpy_helper.to_array(onnx.load(str(path)).graph.initializer[0])
    assert written.dtype == np.float16
    # As onnxruntime's converter writes fp16: the smallest magnitudes kept off zero, the largest off infinity.
    assert written[0, 0] > 0 and np.isfinite(written[0, 2]) and written[0, 1] == -3.0 and written[0, 3] == 0.5


def test_the_portable_graph_is_that_of_the_full_rule_set(d3_causal_checkpoint, d3_causal_artifact, tmp_path):
    # d3's causal text graph: the chunked delta rule in a Scan, with the state in and out (the most Slices of any).
    config = _config(d3_causal_checkpoint)
    spec = config.graphs()[0]
    torch.manual_seed(0)
    traced = trace_graph(spec, config.skeleton.tensors, skipped_rules=())
    full = write_graph(traced.proto(), tmp_path / spec.file, traced.book, config.skeleton.tensors)
    assert same_graph(d3_causal_artifact / spec.file, full)


def test_the_optimizer_runs_without_the_skipped_rules_and_gets_them_back(monkeypatch):
    import onnxscript.optimizer
    import onnxscript.rewriter as rewriter

    from systemone.export import graph_export

    before = rewriter._DEFAULT_REWRITE_RULES
    assert SKIPPED_RULES <= {rule.name for rule in before}, "onnxscript no longer has the rule export leaves out"
    seen = []
    monkeypatch.setattr(onnxscript.optimizer, "optimize_ir",
                        lambda *args, **kwargs: seen.append({r.name for r in rewriter._DEFAULT_REWRITE_RULES}))
    with graph_export._rewrite_rules_without(SKIPPED_RULES):
        onnxscript.optimizer.optimize_ir(None)
    assert seen[0] == {rule.name for rule in before} - SKIPPED_RULES
    assert rewriter._DEFAULT_REWRITE_RULES is before
    with graph_export._rewrite_rules_without(()):
        onnxscript.optimizer.optimize_ir(None)
    assert seen[1] == {rule.name for rule in before}


def test_each_export_call_gets_its_own_copy_of_a_torchlib_registry_built_once():
    from torch.onnx._internal.exporter import _registration

    from systemone.export import graph_export

    registry_class = _registration.ONNXRegistry
    built = registry_class.__dict__["from_torchlib"]
    add = torch.ops.aten.add.Tensor
    with graph_export._torchlib_registry_built_once():
        first = registry_class.from_torchlib()
        kept = len(graph_export._TORCHLIB_REGISTRIES)
        first.register_op(add, lambda x, y: x)  # a translation one export call registers
        second = registry_class.from_torchlib()
        assert len(graph_export._TORCHLIB_REGISTRIES) == kept, "the registry was built again"
    assert first.get_decomps(add)[0].is_custom
    assert not any(meta.is_custom for meta in second.get_decomps(add)), "a call's translation reached the next"
    assert second.get_decomps(add) == registry_class.from_torchlib().get_decomps(add)
    assert registry_class.__dict__["from_torchlib"] is built


def test_a_graph_traced_in_a_worker_process_is_the_one_traced_here(d3_causal_checkpoint, d3_causal_artifact):
    """`export --jobs N` traces in worker processes, each of which builds the export config again with its custom
    ops registered there: the fused vision graph (custom ops in it, and the quickest of the fused graphs to trace)
    a worker traces is the one traced in this process, node for node, with the same weights' recipes. The portable
    graphs take the same path (`spec_of`) without the custom ops."""
    config = _config(d3_causal_checkpoint)
    key = ("fused", "vision")
    spec = spec_of(config, key)
    here = traced(config, spec, fused=True)
    with GraphExports(type(config), config.checkpoint, jobs=2) as exports:
        exports.start(key)
        there = exports.wait(key, spec)
    assert without_debug_records(there.proto()) == without_debug_records(here.proto())
    assert pickle.dumps(there.book.recipes) == pickle.dumps(here.book.recipes)  # arrays among them: as bytes


@pytest.mark.parametrize("asked, portable, forms", [
    (None, True, []),  # no CUDA here: the portable graphs only
    (["portable"], True, []),
    (["cuda-fused-mixed"], False, ["cuda-fused-mixed"]),
    (["portable", "cuda-fused-fp16", "cuda-fp16"], True, ["cuda-fused-fp16", "cuda-fp16"]),
])
def test_export_writes_the_forms_asked_or_those_its_device_can_gate(d3_checkpoint, asked, portable, forms):
    from systemone.export.pipeline import plan_forms

    plan = plan_forms(_config(d3_checkpoint), asked, "cpu")
    assert (plan.portable, [form.name for form in plan.forms]) == (portable, forms)
    assert plan.why


def test_on_cuda_export_writes_the_cuda_forms_without_the_portable_graphs(d3_checkpoint):
    from systemone.export.pipeline import plan_forms

    plan = plan_forms(_config(d3_checkpoint), None, "cuda")
    assert not plan.portable and plan.forms[0].name == "cuda-fused-fp16"
    assert "portable" in plan.why  # says how to get them


def test_unknown_forms_and_an_empty_choice_are_refused(d3_checkpoint):
    from systemone.export.pipeline import plan_forms

    with pytest.raises(ValueError, match="cuda-nope are not among the family's: portable, cuda-fused-fp16"):
        plan_forms(_config(d3_checkpoint), ["cuda-nope"], "cpu")
    with pytest.raises(ValueError, match="no form to write"):
        plan_forms(_config(d3_checkpoint), [], "cpu")


def test_a_large_model_gets_no_portable_graphs_unless_asked(d3_checkpoint, monkeypatch):
    from systemone.export import pipeline

    config = _config(d3_checkpoint)
    monkeypatch.setattr(type(config.skeleton), "parameter_count", lambda self: 27_000_000_000)
    with pytest.raises(ValueError, match="27B-parameter model would hold 108 GB"):
        pipeline.plan_forms(config, None, "cpu")
    assert pipeline.plan_forms(config, ["portable"], "cpu").portable


def test_the_values_between_a_stacks_pieces_keep_their_types(d3_checkpoint):
    """The half-precision rewrite reads every float value's type: the stream passed from the front to the first
    block and from block to block is typed like any value inside a piece."""
    config = _config(d3_checkpoint)
    proto = traced(config, config.graphs(fused=True)[0], fused=True).proto()
    typed = {value.name: value.type.tensor_type.elem_type for value in proto.graph.value_info}
    layers = config.text_config.num_hidden_layers
    between = ["front/hidden", "front/update", *(f"layers.{i}/next_{name}" for i in range(layers - 1)
                                                 for name in ("hidden", "update"))]
    assert {name: typed.get(name) for name in between} == {name: onnx.TensorProto.FLOAT for name in between}


@pytest.mark.parametrize("fused", [False, True])
def test_no_weight_is_reshaped_when_the_graph_runs(d3_checkpoint, fused):
    """Every node that reads only weights and constants (a weight's transpose, slice or `1 + w`) is folded into a
    weight of its own at export, as the optimizer folds it, so that the form's weights are written in its dtype
    and nothing of them is computed again at each call."""
    config = _config(d3_checkpoint)
    for spec in config.graphs(fused=fused):
        graph = traced(config, spec, fused).proto().graph
        weights = {t.name for t in graph.initializer if recipe_of(t) is not None}
        constants = {t.name for t in graph.initializer} | {o for n in graph.node if n.op_type == "Constant"
                                                            for o in n.output}
        unfolded = [node.name for node in graph.node if node.op_type not in ("Constant", "Scan", "Loop", "If")
                    and any(name in weights for name in node.input)
                    and all(not name or name in constants for name in node.input)]
        assert unfolded == [], (spec.name, unfolded[:5])


def test_weights_are_rounded_to_fp16_bit_for_bit_as_onnxruntimes_converter_rounds_them():
    from onnxruntime.transformers.float16 import convert_np_to_float16

    from systemone.export.weights import _to_float16

    rng = np.random.default_rng(0)
    values = np.concatenate([
        rng.standard_normal(5000).astype(np.float32) * np.float32(10.0) ** rng.integers(-12, 7, 5000),
        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65505, 70000, -70000, 5.96e-8, 5e-8, -5e-8, 1e-30],
                 np.float32)]).reshape(-1, 3)
    assert np.array_equal(_to_float16(values).view(np.uint16), convert_np_to_float16(values).view(np.uint16))
    # A transposed recipe's view: written in its own order.
    assert np.array_equal(_to_float16(values.T).view(np.uint16), convert_np_to_float16(values.T).view(np.uint16))
