"""The ladder's last CUDA rung, `cuda-fp32` (docs/decisions/cuda-form-ladder.md): the portable graphs computing in
fp32 from fp16 weights, each weight cast as a run reaches it, for a model whose fp16 rounding the gate refuses."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from systemone.export.half_precision import FLOAT32_FP16_WEIGHTS, convert_to_half
from systemone.export.pipeline import add_forms, export_checkpoint
from systemone.runtime.artifact import Artifact
from systemone.runtime.engine import EngineOptions
from systemone.runtime.service import DecisionService
from systemone.runtime.session import GraphSession
from tests.answer_helpers import max_probability_diff


def _products_graph(layers: int = 3, width: int = 8) -> tuple[onnx.ModelProto, list[np.ndarray]]:
    """An fp32 graph: a table lookup, `layers` products, then a readout product; weights fp16-exact."""
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal((width, width)).astype(np.float16).astype(np.float32) for _ in range(layers + 2)]
    nodes = [helper.make_node("Gather", ["table", "ids"], ["h0"], "lookup")]
    for i in range(layers):
        nodes.append(helper.make_node("MatMul", [f"h{i}", f"w{i}"], [f"h{i + 1}"], f"product{i}"))
    nodes.append(helper.make_node("MatMul", [f"h{layers}", "readout"], ["logits"], "readout_product"))
    names = ["table", *(f"w{i}" for i in range(layers)), "readout"]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [None])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, width])],
                              [numpy_helper.from_array(w, name) for w, name in zip(weights, names)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), weights


def test_products_read_fp16_weights_cast_to_fp32_just_before_them():
    model, _ = _products_graph()
    out = convert_to_half(model, ["logits"], FLOAT32_FP16_WEIGHTS)
    stored = {t.name: t.data_type for t in out.graph.initializer}
    assert stored == {"table": TensorProto.FLOAT16, "w0": TensorProto.FLOAT16, "w1": TensorProto.FLOAT16,
                      "w2": TensorProto.FLOAT16, "readout": TensorProto.FLOAT}  # the readout keeps fp32
    # Halved weights are overridable initializers too, so that onnxruntime never folds their casts away.
    assert [i.name for i in out.graph.input] == ["ids", "table", "w0", "w1", "w2"]
    order = [(n.op_type, list(n.input)) for n in out.graph.node]
    assert order == [("Gather", ["table", "ids"]), ("Cast", ["h0_fp16"]),  # the rows gathered in fp16, then cast
                     ("Cast", ["w0"]), ("MatMul", ["h0", "w0_fp32"]),
                     ("Cast", ["w1"]), ("MatMul", ["h1", "w1_fp32"]),
                     ("Cast", ["w2"]), ("MatMul", ["h2", "w2_fp32"]),
                     ("MatMul", ["h3", "readout"])]
    onnx.checker.check_model(out)


def test_the_fp16_weight_graph_answers_as_the_fp32_one_and_its_session_runs_it_in_order(tmp_path):
    model, _ = _products_graph()
    onnx.save(model, str(tmp_path / "fp32.onnx"))
    onnx.save(convert_to_half(model, ["logits"], FLOAT32_FP16_WEIGHTS), str(tmp_path / "half.onnx"))
    ids = np.array([3, 0, 7], dtype=np.int64)
    full = GraphSession(tmp_path / "fp32.onnx", "cpu").run({"ids": ids})[0]
    session = GraphSession(tmp_path / "half.onnx", "cpu", in_graph_order=True)
    assert session.input_names == ["ids"]  # the weights are not inputs a run must feed
    np.testing.assert_array_equal(session.run({"ids": ids})[0], full)  # fp16-exact weights: the same bits
    # In the default order onnxruntime runs every cast first, and every fp32 weight is alive at once; the graph
    # optimizer's rewritten nodes would take indices after the casts that priority order runs by.
    options = session.session.get_session_options()
    assert options.execution_order == ort.ExecutionOrder.PRIORITY_BASED
    assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    assert GraphSession(tmp_path / "fp32.onnx", "cpu").session.get_session_options().execution_order == \
        ort.ExecutionOrder.DEFAULT


@pytest.fixture(scope="module")
def fp32_form_artifact(d3_checkpoint, d3_artifact, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp32-form") / "art"
    shutil.copytree(d3_artifact, out)
    add_forms(str(d3_checkpoint), out, forms=["cuda-fp32"])
    return out


def test_the_fp32_form_is_written_gated_and_computes_every_node_in_fp32(fp32_form_artifact):
    artifact = Artifact.load(fp32_form_artifact)
    form = artifact.manifest.forms["cuda-fp32"]
    assert form.refused is None and form.providers == ["cuda"]
    assert form.precisions == {"text": "float32-fp16-weights", "vision": "float32-fp16-weights"}
    # The portable graphs' fp32 computation: its answers within rounding of the torch fp32 model's.
    assert form.gate["questions"] >= 200 and form.gate["median_abs_dp"] <= 1e-4
    assert form.gate["clear_picks_differing"] == []
    for graph, file in form.graphs.items():
        half = onnx.load(str(fp32_form_artifact / file), load_external_data=False)
        assert not any(n.op_type in ("GatedDeltaNet", "MultiHeadAttention") for n in half.graph.node)  # portable
        halved = {t.name for t in half.graph.initializer if t.data_type == TensorProto.FLOAT16}
        assert halved and halved <= {i.name for i in half.graph.input}
        fp16_readers = {n.op_type for n in half.graph.node if set(n.input) & halved}
        assert fp16_readers <= {"Cast", "Gather"}, graph  # nothing computes on an fp16 value but the casts


def test_the_fp32_form_answers_as_the_portable_graphs(fp32_form_artifact):
    artifact = Artifact.load(fp32_form_artifact)
    assert artifact.with_form("cuda-fp32", "cuda").casts_weights_per_run("text")
    assert not artifact.with_form("portable", "cpu").casts_weights_per_run("text")
    body = {"state": {"ticket": "Refund not received", "tier": "gold"},
            "questions": {"urgent": {"type": "noul", "instructions": "Is it urgent?"},
                          "team": {"type": "choice", "criteria": {"billing": None, "support": None, "sales": None}}}}
    answers = {}
    for form in ("portable", "cuda-fp32"):
        service = DecisionService(Artifact.load(fp32_form_artifact), EngineOptions(device="cpu", form=form))
        answers[form] = service.decide(body)["answers"]
        service.close()
    assert max_probability_diff(answers["cuda-fp32"], answers["portable"]) <= 1e-4


def test_a_linked_fp32_form_reads_the_checkpoints_bf16_rows_and_keeps_none_in_host_memory(d3_checkpoint, tmp_path,
                                                                                          fp32_form_artifact,
                                                                                          monkeypatch):
    """`--weights link` on the cuda-fp32 rung: each weight a product casts is onnxruntime's own external data, the
    checkpoint's bf16 rows in the hard-linked file, read as the checkpoint stores them (transposed in the product,
    not in memory): the session keeps no linked arrays of its own, and the answers are the copied form's (the
    module's, written with copied weights)."""
    from functools import partial

    from systemone.export import pipeline
    from systemone.export.weights import Linker
    from systemone.runtime.linked_weights import read_links

    monkeypatch.setattr(pipeline, "Linker", partial(Linker, min_bytes=0))  # link every weight of the tiny model
    body = {"state": "The parcel arrived crushed.", "questions": {
        "refund": {"type": "noul", "instructions": "Does the customer want a refund?"},
        "mood": {"type": "score", "criteria": ["calm", "annoyed", "furious"]}}}
    answers = {}
    out = export_checkpoint(str(d3_checkpoint), tmp_path / "link", forms=["cuda-fp32"], gate_device="cpu",
                            weights="link")
    for weights, artifact in (("link", out), ("copy", fp32_form_artifact)):
        service = DecisionService(Artifact.load(artifact), EngineOptions(device="cpu", form="cuda-fp32"))
        answers[weights] = service.decide(body)["answers"]
        if weights == "link":
            text = onnx.load(str(out / "text.cuda-fp32.onnx"), load_external_data=False)
            stored = {t.name: t for t in text.graph.initializer if t.data_type == TensorProto.BFLOAT16}
            assert stored and all({e.key: e.value for e in t.external_data}["location"]
                                  == "linked/model.safetensors" for t in stored.values())
            assert {n.op_type for n in text.graph.node if n.domain == "com.microsoft"} == {"FusedMatMul"}
            # Only what no cast reads (the readout, the norms) is made by the runtime.
            assert not set(stored) & {link.name for link in read_links(out / "text.cuda-fp32.onnx")}
            assert len(service.engine.session.linked_weights) == len(read_links(out / "text.cuda-fp32.onnx"))
        service.close()
    assert max_probability_diff(answers["link"], answers["copy"]) <= 1e-5
