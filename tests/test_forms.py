"""The half-precision CUDA form (docs/decisions/cuda-form-ladder.md): export writes it beside the portable fp32 graphs
only when the whole runtime on it answers within the gate of the torch fp32 model on 200+ real questions; the
manifest records each form with its dtype, provider and gate figures; the runtime picks the form for its device."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest

from systemone.export.answer_gate import QuestionPair, gate_answers
from systemone.export.config import AnswerTolerance, ParityError
from systemone.export.pipeline import add_forms
from systemone.export.sample_media import image_url
from systemone.runtime.artifact import Artifact, ArtifactError
from systemone.runtime.engine import EngineOptions
from systemone.runtime.service import DecisionService

# The form each family's tiny artifact gets: the first of its ladder, its fused graphs in fp16 (d3: both graphs
# written with fused ops; d1: its vision graph, with its text graph the all-fp16 rewrite of the portable one).
FORM = {"d3": "cuda-fused-fp16", "d1": "cuda-fused-fp16"}
# The graphs each family's forms rewrite: the vision graph too (the gates ask questions with images, d3's videos too).
FORM_GRAPHS = {"d3": ("text", "vision"), "d1": ("text", "vision")}


def form_files(form: str, family: str = "d3") -> dict[str, str]:
    return {graph: f"{graph}.{form}.onnx" for graph in FORM_GRAPHS[family]}


@pytest.mark.parametrize("family", ["d3", "d1"])
def test_export_writes_a_gated_half_precision_form(family, request):
    artifact = request.getfixturevalue(f"{family}_artifact")
    manifest = json.loads((artifact / "manifest.json").read_text())
    form = manifest["forms"][FORM[family]]
    assert form["dtype"] == "float16" and form["providers"] == ["cuda"] and "refused" not in form
    assert form["graphs"] == form_files(FORM[family], family)
    # Which nodes each rewritten graph runs in fp16 (d3's vision graph: its matrix products only, on every rung).
    assert form["precisions"] == {"text": "float16", "vision": "float16-matmuls"}
    assert all((artifact / file).is_file() for file in form["graphs"].values())
    # The forms after it on the ladder are not needed: one form per provider set.
    assert [name for name in manifest["forms"] if name != FORM[family]] == []
    gate = form["gate"]
    assert gate["questions"] >= 200 and gate["max_abs_dp"] <= 0.02 and gate["median_abs_dp"] <= 0.003
    assert gate["clear_picks_differing"] == [] and gate["questions_with_clear_pick"] > 100
    assert gate["media_questions"] >= 40  # d3: images and short videos; d1: images
    assert gate["provider"] == "CPUExecutionProvider"  # no GPU here: the gate ran where export ran
    # Its requests' questions were grouped into calls as serve groups them, by the start-up measurement.
    assert "measured at" in gate["batch_rows"] and "a call costs" in gate["batch_rows"]
    # The portable graphs are untouched and still fp32.
    assert manifest["graphs"]["text"]["file"] == "text.onnx" and manifest["graphs"]["text"]["dtype"] == "float32"


@pytest.mark.parametrize("family", ["d3", "d1"])
def test_the_half_precision_graph_keeps_its_inputs_outputs_and_readout_in_fp32(family, request):
    artifact = request.getfixturevalue(f"{family}_artifact")
    half = onnx.load(str(artifact / f"text.{FORM[family]}.onnx"))
    portable = onnx.load(str(artifact / "text.onnx"), load_external_data=False)
    types = {v.name: v.type.tensor_type.elem_type for v in [*half.graph.input, *half.graph.output]}
    assert types == {v.name: v.type.tensor_type.elem_type for v in [*portable.graph.input, *portable.graph.output]}
    weights = [t for t in half.graph.initializer if t.dims and np.prod(t.dims) >= 1024]
    fp16 = [t for t in weights if t.data_type == onnx.TensorProto.FLOAT16]
    fp32 = [t for t in weights if t.data_type == onnx.TensorProto.FLOAT]
    assert len(fp16) > 10 * len(fp32)
    # The readout (d3: the code readout; d1: the LM head and log-softmax) runs in fp32 on fp32 weights.
    assert_output_product_in_fp32(half)


def assert_output_product_in_fp32(half) -> None:
    """The MatMul/Gemm that makes the graph's output reads fp32 weights, and its values reach the output unrounded:
    no fp16 cast between it and the output."""
    producer = {o: n for n in half.graph.node for o in n.output}
    node, path = producer[half.graph.output[0].name], []
    while node.op_type not in ("MatMul", "Gemm"):
        path.append(node)
        node = producer[node.input[0]]
    assert not any(n.op_type == "Cast" and n.attribute[0].i == onnx.TensorProto.FLOAT16 for n in path), path
    fp32_names = {t.name for t in half.graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    weight = node.input[1]
    while weight not in fp32_names:  # through the Identity (and, d1, the Transpose) that read it
        assert weight in producer and producer[weight].op_type in ("Identity", "Transpose"), weight
        weight = producer[weight].input[0]


def fp16_producers(half) -> set[str]:
    fp16_values = {v.name for v in half.graph.value_info if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16}
    return {n.op_type for n in half.graph.node if any(o in fp16_values for o in n.output)}


@pytest.mark.parametrize("family", ["d3", "d1"])
def test_the_form_rewrites_the_vision_graph_with_only_its_matrix_products_in_fp16(family, request):
    """Whatever the rung (the cuda-fused-fp16 form runs each family's text graph all fp16), the vision graph
    has only its matrix products (and d3's position-table lookup) in fp16, on fp16 weights; its inputs, norms,
    softmax and its output (the projector's last product, on its fp32 weight) stay fp32."""
    artifact = request.getfixturevalue(f"{family}_artifact")
    half = onnx.load(str(artifact / f"vision.{FORM[family]}.onnx"), load_external_data=False)
    portable = onnx.load(str(artifact / "vision.onnx"), load_external_data=False)
    types = {v.name: v.type.tensor_type.elem_type for v in [*half.graph.input, *half.graph.output]}
    assert types == {v.name: v.type.tensor_type.elem_type for v in [*portable.graph.input, *portable.graph.output]}
    # (The fused rungs also read each block's attention in fp16, as one MultiHeadAttention node: below.)
    assert fp16_producers(half) == {"MatMul", "Gemm", "Cast"} | ({"Gather"} if family == "d3" else set())
    # Every product on a weight reads it in fp16 (the output's reads its fp32 weight through an Identity).
    weights = {t.name: t.data_type for t in half.graph.initializer}
    read = [weights[n.input[1]] for n in half.graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in weights]
    assert len(read) >= 4 and set(read) == {onnx.TensorProto.FLOAT16}
    assert_output_product_in_fp32(half)


def test_the_runtime_picks_the_form_for_its_device(d3_artifact):
    artifact = Artifact.load(d3_artifact)
    assert artifact.forms_for("cuda") == [FORM["d3"], "portable"]
    assert artifact.forms_for("cpu") == ["portable"] and artifact.forms_for("rocm") == ["portable"]
    assert artifact.with_form("auto", "cuda").graph_path("text").name == "text.cuda-fused-fp16.onnx"
    assert artifact.with_form("auto", "cuda").graph_path("vision").name == "vision.cuda-fused-fp16.onnx"
    assert artifact.with_form("auto", "cpu").graph_path("vision").name == "vision.onnx"
    assert artifact.with_form("auto", "cpu").graph_path("text").name == "text.onnx"
    assert DecisionService(artifact, EngineOptions(device="cpu")).form == "portable"
    with pytest.raises(ArtifactError, match="has no form 'bf16'.*portable, cuda-fused-fp16"):
        artifact.with_form("bf16", "cuda")


@pytest.mark.parametrize("family", ["d3", "d1"])
def test_a_form_named_outright_runs_anywhere_and_answers_like_the_portable_one(family, request):
    """The half-precision form on the CPU (onnxruntime casts around what has no fp16 kernel there; its CPU
    GatedDeltaNet kernel runs d3's fused rule)."""
    artifact = request.getfixturevalue(f"{family}_artifact")
    body = {"state": {"ticket": "Refund not received", "tier": "gold"},
            "questions": {"urgent": {"type": "noul", "instructions": "Is it urgent?"},
                          "team": {"type": "choice", "criteria": {"billing": None, "support": None, "sales": None}}}}
    answers = {form: DecisionService(Artifact.load(artifact), EngineOptions(device="cpu", form=form))
               .decide(body)["answers"] for form in ("portable", FORM[family])}
    for qid, answer in answers["portable"].items():
        half = answers[FORM[family]][qid]["probabilities"]
        assert max(abs(p - half[k]) for k, p in answer["probabilities"].items()) <= 0.02


@pytest.mark.parametrize("family", ["d3", "d1"])
def test_the_form_answers_an_image_request_through_its_own_vision_graph_like_the_portable_one(family, request):
    artifact = request.getfixturevalue(f"{family}_artifact")
    body = {"state": {"ticket": "Parcel arrived crushed", "photo": "attached"}, "images": [image_url(640, 480, seed=5)],
            "questions": {"damaged": {"type": "noul", "instructions": "Is the parcel damaged?"},
                          "fault": {"type": "choice", "criteria": {"carrier": None, "sender": None, "nobody": None}}}}
    services = {form: DecisionService(Artifact.load(artifact), EngineOptions(device="cpu", form=form))
                for form in ("portable", FORM[family])}
    half = services[FORM[family]]
    assert half.artifact.graph_path("vision").name == f"vision.{FORM[family]}.onnx"
    answers = {form: service.decide(body)["answers"] for form, service in services.items()}
    assert half.engine.vision_session.runs >= 1
    for qid, answer in answers["portable"].items():
        got = answers[FORM[family]][qid]["probabilities"]
        assert max(abs(p - got[k]) for k, p in answer["probabilities"].items()) <= 0.02


def test_the_fused_form_runs_each_gated_deltanet_layer_as_fused_nodes_without_control_flow(d3_checkpoint,
                                                                                            d3_artifact):
    """No Scan (a CUDA graph can be captured); per Gated DeltaNet layer three CausalConvWithState (the short
    convolution and its SiLU, one each for query, key and value, so that no Split copies a joint output), one
    GatedDeltaNet reading fp16 query, key and value (the CUDA kernel's chunked engine) and fp32 decay, update rate,
    state and gate parameters (the op's contract), and one GatedRMSNorm. No layer splits a product's output."""
    half = onnx.load(str(d3_artifact / "text.cuda-fused-fp16.onnx"), load_external_data=False)
    op_types = [node.op_type for node in half.graph.node]
    assert not {"Scan", "Loop", "If", "Split"} & set(op_types)
    layer_types = json.loads((d3_checkpoint / "config.json").read_text())["text_config"]["layer_types"]
    layers = layer_types.count("linear_attention")
    assert layers > 0
    assert op_types.count("CausalConvWithState") == 3 * layers
    assert op_types.count("GatedRMSNorm") == layers
    rules = [node for node in half.graph.node if node.op_type == "GatedDeltaNet"]
    assert len(rules) == layers
    types = {v.name: v.type.tensor_type.elem_type for v in half.graph.value_info}
    types.update({t.name: t.data_type for t in half.graph.initializer})
    producer = {o: n for n in half.graph.node for o in n.output}

    def dtype(value: str) -> int:
        while value not in types and producer[value].op_type == "Identity":
            value = producer[value].input[0]
        return types[value]

    for rule in rules:
        assert rule.domain == "com.microsoft"
        query, key, value, seqlens, decay, beta, state, a_log, dt_bias = rule.input
        assert [dtype(v) for v in (query, key, value)] == [onnx.TensorProto.FLOAT16] * 3
        assert [dtype(v) for v in (decay, beta, state, a_log, dt_bias)] == [onnx.TensorProto.FLOAT] * 5
        assert seqlens == ""  # uniform packing: right-padded rows, each read at its own last token
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in rule.attribute}
        assert attributes["gate_activation"] == b"qwen" and attributes["beta_activation"] == b"sigmoid"
        assert attributes["qk_l2_norm"] == 1


@pytest.mark.parametrize("mode", ["noncausal", "causal"])
def test_the_fused_graph_in_torch_is_the_portable_one(mode, request):
    """The fused ops' eager bodies compute what the portable graph computes, in both attention modes: the torch
    module behind the fused export and the portable one agree on a padded batch (causal: after a past of 23
    tokens, on the code logits and on every state they return)."""
    import torch

    from systemone.export.d3.config import D3ExportConfig

    config = D3ExportConfig(request.getfixturevalue("d3_checkpoint" if mode == "noncausal" else "d3_causal_checkpoint"))
    inputs = config.example_inputs()
    with torch.no_grad():
        portable, fused = (config.graph(fused=fused, reference=True)(*inputs) for fused in (False, True))
    if mode == "noncausal":
        portable, fused = (portable,), (fused,)
    assert len(portable) == len(fused) == (1 if mode == "noncausal" else 1 + len(inputs[-1]))
    # The state after a row holds only where the row has no padding (a prefill's one row): the first row here.
    for index, (want, got) in enumerate(zip(portable, fused, strict=True)):
        want, got = (want, got) if index == 0 else (want[:1], got[:1])
        assert want.shape == got.shape and torch.allclose(want, got, atol=1e-5), (index, (want - got).abs().max())


def test_a_form_that_fails_its_gate_is_not_written_and_the_next_one_is_tried(d3_checkpoint, d3_artifact, tmp_path,
                                                                              monkeypatch, capsys):
    """`export --add-forms` on a copy of the artifact, two fused rungs held to an impossible bound: each is refused
    and removed in turn, and the next, the matmuls-only rewrite of the portable graph, is written. The fused graphs
    the two rungs convert are traced once."""
    from systemone.export.d3.config import D3ExportConfig

    real = D3ExportConfig.forms
    monkeypatch.setattr(D3ExportConfig, "forms", lambda self: [
        replace(form, tolerance=AnswerTolerance(max_dp=1e-9)) if form.name != "cuda-fp16-matmuls" else form
        for form in real(self)])
    from systemone.export.graph_export import GraphExports

    traces = []  # each trace the forms ask of their export's traces, the first time they ask for it
    real_wait = GraphExports.wait
    monkeypatch.setattr(GraphExports, "wait", lambda exports, key, spec: (
        key not in exports.done and traces.append(key)) or real_wait(exports, key, spec))
    out = tmp_path / "art"
    shutil.copytree(d3_artifact, out)
    refused_names = ["cuda-fused-fp16", "cuda-fused-mixed"]
    manifest = add_forms(str(d3_checkpoint), out, forms=[*refused_names, "cuda-fp16-matmuls"])
    err = capsys.readouterr().err
    assert list(manifest.forms) == [*refused_names, "cuda-fp16-matmuls"]
    for name in refused_names:
        assert f"the {name} form is not written: answers disagree with the torch fp32 model over 210 questions: " \
               "max |dp|" in err
        refused = manifest.forms[name]
        assert refused.refused.startswith("answers disagree") and refused.graphs == {}
        for file in form_files(name).values():
            assert not (out / file).exists() and not (out / f"{file}.data").exists()
    # The fused text and vision graphs once for two forms; the portable ones for the third.
    assert sorted(traces) == [("fused", "text"), ("fused", "vision"), ("portable", "text"), ("portable", "vision")]
    written = manifest.forms["cuda-fp16-matmuls"]
    assert written.refused is None and written.gate["max_abs_dp"] <= 0.02
    assert written.graphs == form_files("cuda-fp16-matmuls")
    artifact = Artifact.load(out)
    assert artifact.forms_for("cuda") == ["cuda-fp16-matmuls", "portable"]
    with pytest.raises(ArtifactError, match="export refused it: answers disagree"):
        artifact.with_form("cuda-fused-fp16", "cuda")
    # Only the matrix products and the embedding lookup are fp16: norms, softmax and the residual stream stay fp32.
    half = onnx.load(str(out / "text.cuda-fp16-matmuls.onnx"), load_external_data=False)
    assert fp16_producers(half) == {"MatMul", "Gather", "Cast"}


def _convert(source: Path, target: Path, outputs: list[str], precision) -> None:
    """A written fp32 graph converted as export converts it, saved with its weights."""
    from systemone.export.half_precision import convert_to_half

    half = convert_to_half(onnx.load(str(source)), outputs, precision)
    onnx.save(half, str(target), save_as_external_data=True, location=f"{target.name}.data")


def half_value_producers(graph) -> dict[str, str]:
    """Each value's producing node type, for the fp16 values of `graph`."""
    fp16_values = {v.name for v in graph.value_info if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16}
    return {o: n.op_type for n in graph.node for o in n.output if o in fp16_values}


@pytest.mark.parametrize("precision", ["float16", "float16-mixed", "float16-matmuls"])
def test_every_precision_keeps_the_rotary_angles_in_fp32(d3_artifact, tmp_path, precision):
    """Position times frequency is rounded to fp16 nowhere: at position 1000 fp16 is half a radian off."""
    from systemone.export import half_precision
    from systemone.export.half_precision import rotary_angles

    chosen = next(p for p in vars(half_precision).values()
                  if isinstance(p, half_precision.Precision) and p.name == precision)
    _convert(d3_artifact / "text.onnx", tmp_path / "half.onnx", ["code_logits"], chosen)
    half = onnx.load(str(tmp_path / "half.onnx"), load_external_data=False).graph
    angles = rotary_angles(half)
    assert len(angles) >= 3  # the positions' cast, the product with the frequencies, the channel pick
    fp16 = half_value_producers(half)
    assert not [n.name for n in half.node if n.name in angles and any(o in fp16 for o in n.output)]
    assert [n for n in half.node if n.op_type in ("Cos", "Sin") and any(o in fp16 for o in n.output)] == []


def test_the_mixed_precision_runs_as_torch_autocast(d3_artifact, tmp_path):
    """fp16 where autocast computes in fp16 (the matrix products, and what follows them on fp16 values alone: the
    MLP's SiLU gate and product), fp32 where it computes in fp32 (the norms, softmax) or promotes (the residual
    sums, which read the fp32 stream)."""
    from systemone.export.half_precision import FLOAT16_MIXED

    _convert(d3_artifact / "text.onnx", tmp_path / "half.onnx", ["code_logits"], FLOAT16_MIXED)
    half = onnx.load(str(tmp_path / "half.onnx"), load_external_data=False).graph
    fp16 = half_value_producers(half)
    producer = {o: n for n in half.node for o in n.output}
    assert {"MatMul", "Sigmoid", "Mul", "Reshape"} <= set(fp16.values())
    assert not {"Pow", "ReduceMean", "Sqrt", "Softmax", "ScatterND"} & set(fp16.values())
    # The MLP: down_proj(silu(gate_proj(x)) * up_proj(x)), every node from the two products to the third in fp16.
    products = [n for n in half.node if n.op_type == "Mul" and all(
        producer.get(i) is not None and producer[i].op_type in ("Mul", "MatMul") for i in n.input)
        and {producer[i].op_type for i in n.input} == {"Mul", "MatMul"}]
    assert products and all(n.output[0] in fp16 for n in products)
    # The residual stream: each norm's first op (x squared) reads an fp32 sum of the stream and a block's output.
    squares = [n for n in half.node if n.op_type == "Pow"]
    assert squares and all(n.input[0] not in fp16 for n in squares)

    def made_by(value: str) -> str:
        while producer[value].op_type == "Identity":  # the converter's renamed fp32 value, joined back
            value = producer[value].input[0]
        return producer[value].op_type

    assert sum(made_by(n.input[0]) == "Add" for n in squares) >= 4


@pytest.fixture(scope="module")
def mixed_fused_text(d3_checkpoint, d3_artifact, tmp_path_factory):
    """The text graph of the cuda-fused-mixed form, written (gated) into a copy of the tiny d3 artifact."""
    out = tmp_path_factory.mktemp("mixed") / "art"
    shutil.copytree(d3_artifact, out)
    manifest = add_forms(str(d3_checkpoint), out, forms=["cuda-fused-mixed"])
    assert manifest.forms["cuda-fused-mixed"].refused is None
    return onnx.load(str(out / "text.cuda-fused-mixed.onnx"), load_external_data=False).graph


def test_the_mixed_fused_form_keeps_the_delta_rules_output_in_fp16_through_the_gated_norm(mixed_fused_text):
    """The delta rule's fp16 output reaches the out projection without a round trip through fp32: `GatedRMSNorm`
    (fp32 arithmetic inside its kernel) reads it, its gate and its weight in fp16 and writes fp16."""
    half = mixed_fused_text
    types = {v.name: v.type.tensor_type.elem_type for v in half.value_info}
    types.update({t.name: t.data_type for t in half.initializer})
    producer = {o: n for n in half.node for o in n.output}
    norms = [n for n in half.node if n.op_type == "GatedRMSNorm"]
    assert norms
    for norm in norms:
        assert [types[name] for name in (*norm.input, norm.output[0])] == [onnx.TensorProto.FLOAT16] * 4
        value, path = norm.input[0], []
        while producer[value].op_type != "GatedDeltaNet":
            path.append(producer[value])
            value = producer[value].input[0]
        assert not any(n.op_type == "Cast" and n.attribute[0].i == onnx.TensorProto.FLOAT for n in path), path


def test_the_mixed_fused_form_adds_each_blocks_output_to_the_stream_inside_the_next_norm(mixed_fused_text,
                                                                                            d3_checkpoint):
    """Every norm of the residual stream is one `SkipSimplifiedLayerNormalization` node (the first sums in the
    front's zeros, so that every layer is the same block): it reads the fp32 stream and the block's output, writes
    the norm and the new stream in fp32, and its mean and deviation go unnamed; no separate sum of the stream is
    left."""
    from systemone.export.d3.config import D3ExportConfig

    half = mixed_fused_text
    layers = D3ExportConfig(d3_checkpoint).meta.config.text_config.num_hidden_layers
    types = {v.name: v.type.tensor_type.elem_type for v in [*half.value_info, *half.input, *half.output]}
    types.update({t.name: t.data_type for t in half.initializer})
    norms = [n for n in half.node if n.op_type == "SkipSimplifiedLayerNormalization"]
    assert len(norms) == 2 * layers + 1  # each layer's two norms, then the final one
    for norm in norms:
        assert norm.domain == "com.microsoft"
        assert [types[name] for name in (*norm.input, norm.output[0], norm.output[3])] == [onnx.TensorProto.FLOAT] * 5
        assert list(norm.output[1:3]) == ["", ""]
    streams = {norm.output[3] for norm in norms}
    producer = {o: n for n in half.node for o in n.output}

    def source(value: str) -> str:
        while value in producer and producer[value].op_type == "Identity":
            value = producer[value].input[0]
        return value

    assert [norm.input[0] for norm in norms[1:]] and all(source(norm.input[0]) in streams for norm in norms[1:])
    stream_sums = [n for n in half.node if n.op_type == "Add" and any(source(i) in streams for i in n.input)]
    assert stream_sums == []


def test_a_form_onnxruntime_cannot_run_is_refused_and_the_next_one_is_tried(d3_checkpoint, d3_artifact, tmp_path,
                                                                              monkeypatch):
    """E.g. a contrib op an older onnxruntime lacks: export records why and goes down the ladder."""
    import systemone.export.forms as forms_module

    real_gate = forms_module.gate_form

    def gate(config, staging, form, device, detail):
        if form.name == "cuda-fp16":
            raise RuntimeError("[ONNXRuntimeError] : 10 : INVALID_GRAPH : no kernel for this node\nmore detail")
        return real_gate(config, staging, form, device, detail)

    monkeypatch.setattr(forms_module, "gate_form", gate)
    out = tmp_path / "art"
    shutil.copytree(d3_artifact, out)
    manifest = add_forms(str(d3_checkpoint), out, forms=["cuda-fp16", "cuda-fp16-matmuls"])
    assert manifest.forms["cuda-fp16"].refused == ("onnxruntime could not run it on cpu: RuntimeError: "
                                                   "[ONNXRuntimeError] : 10 : INVALID_GRAPH : no kernel for this node")
    assert not any((out / file).exists() for file in form_files("cuda-fp16").values())
    assert manifest.forms["cuda-fp16-matmuls"].refused is None


def test_forms_are_added_only_to_an_export_of_the_same_checkpoint(d1_checkpoint, d3_artifact, tmp_path):
    out = tmp_path / "art"
    shutil.copytree(d3_artifact, out)
    with pytest.raises(ValueError, match="was not exported from .*: the checkpoint's files differ"):
        add_forms(str(d1_checkpoint), out)


# -- the gate's rule ---------------------------------------------------------------------------------------------
def pairs(count: int, got, want) -> list[QuestionPair]:
    return [QuestionPair(f"q{i}", got, want) for i in range(count)]


def test_the_gate_needs_200_questions():
    with pytest.raises(ParityError, match="at least 200 questions; it got 199"):
        gate_answers(pairs(199, [0.5, 0.5], [0.5, 0.5]))


def test_the_gate_holds_max_and_median():
    report = gate_answers(pairs(200, [0.702, 0.298], [0.7, 0.3]) + pairs(1, [0.715, 0.285], [0.7, 0.3]))
    assert report["max_abs_dp"] == pytest.approx(0.015) and report["median_abs_dp"] == pytest.approx(0.002)
    with pytest.raises(ParityError, match=r"max \|dp\| 0.0250 > 0.02"):
        gate_answers(pairs(200, [0.7, 0.3], [0.7, 0.3]) + pairs(1, [0.725, 0.275], [0.7, 0.3]))
    with pytest.raises(ParityError, match=r"median \|dp\| 0.0040 > 0.003"):
        gate_answers(pairs(200, [0.704, 0.296], [0.7, 0.3]))


def test_a_nan_probability_fails_the_gate_wherever_it_lies():
    nan_later = pairs(200, [0.7, 0.3], [0.7, 0.3]) + pairs(1, [float("nan"), 0.3], [0.7, 0.3])
    with pytest.raises(ParityError, match=r"max \|dp\| nan > 0.02"):
        gate_answers(nan_later)


def test_the_gate_counts_the_questions_whose_prompts_carry_media():
    with_media = [QuestionPair(f"m{i}", [0.7, 0.3], [0.7, 0.3], media=True) for i in range(3)]
    report = gate_answers(pairs(200, [0.7, 0.3], [0.7, 0.3]) + with_media)
    assert report["questions"] == 203 and report["media_questions"] == 3
    assert report["summary"].startswith("203 questions (3 with media): ")


def test_a_pick_may_differ_only_where_the_reference_is_undecided():
    close = pairs(200, [0.501, 0.499], [0.499, 0.501])  # top two 0.002 apart: fp16 may swap them
    assert gate_answers(close)["questions_with_clear_pick"] == 0
    clear = pairs(199, [0.5, 0.5], [0.5, 0.5]) + [QuestionPair("flip", [0.49, 0.51, 0.0], [0.5, 0.47, 0.03])]
    with pytest.raises(ParityError, match="1 clear picks differ \\(first: flip\\)"):
        gate_answers(clear)


# -- the conversion's repairs --------------------------------------------------------------------------------------
def test_twin_casts_the_converter_writes_for_a_value_listed_twice_are_made_one():
    """Seen on the d3-nano text graph (not the tiny one): the same Cast of the same value to the same name, twice,
    which onnxruntime refuses as a duplicate definition."""
    from onnx import TensorProto, helper

    from systemone.export.half_precision import drop_twin_casts

    def cast(name: str, to: int):
        return helper.make_node("Cast", ["y"], ["y_cast_to_fp32"], name, to=to)

    graph = helper.make_graph([cast("c", TensorProto.FLOAT), cast("c", TensorProto.FLOAT)], "g", [], [])
    drop_twin_casts(graph)
    assert len(graph.node) == 1
    graph = helper.make_graph([cast("c", TensorProto.FLOAT), cast("c", TensorProto.DOUBLE)], "g", [], [])
    with pytest.raises(ValueError, match="two different casts write 'y_cast_to_fp32'"):
        drop_twin_casts(graph)


def fused_attention_nodes(artifact: Path, graph: str, form: str) -> tuple[onnx.ModelProto, list]:
    """The form's `graph` and its MultiHeadAttention nodes: one for each attention of the portable graph (each of
    its Softmax nodes), with no Softmax (no scores held) left."""
    half = onnx.load(str(artifact / f"{graph}.{form}.onnx"), load_external_data=False)
    portable = onnx.load(str(artifact / f"{graph}.onnx"), load_external_data=False)
    attention = [n for n in half.graph.node if n.op_type == "MultiHeadAttention"]
    assert len(attention) == sum(n.op_type == "Softmax" for n in portable.graph.node) >= 1
    assert not any(n.op_type == "Softmax" for n in half.graph.node)
    return half, attention


@pytest.mark.parametrize("mode", ["noncausal", "causal"])
def test_the_fused_forms_text_attention_is_one_node_a_layer_that_never_holds_the_scores(mode, request):
    """Each full-attention layer of the fused text graph is one MultiHeadAttention node over fp16 query, key and
    value; no Softmax (no B x heads x L x L scores) is left. Causal: `unidirectional`, no mask (right padding is
    never seen). Bidirectional: the keys bounded by each row's length, as 3B + 2 int32 (lengths, query starts, key
    starts), the layout onnxruntime's CUDA memory-efficient kernel takes."""
    artifact = request.getfixturevalue("d3_artifact" if mode == "noncausal" else "d3_causal_artifact")
    _, attention = fused_attention_nodes(artifact, "text", Artifact.load(artifact).forms_for("cuda")[0])
    for node in attention:
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if mode == "causal":  # over the past: its keys and values as the node's past inputs, no mask
            assert attributes["unidirectional"] == 1 and node.input[3:6] == ["", "", ""] and all(node.input[6:8])
        else:
            assert attributes["unidirectional"] == 0 and node.input[3] == "" and node.input[4]


@pytest.mark.parametrize("mode", ["noncausal", "causal"])
def test_a_fused_form_question_answers_alike_alone_and_beside_longer_rows(mode, request):
    """Right padding changes no row's code logits through the fused attention (half precision: within 2e-3),
    the scheduler's promise that an answer does not depend on its batch mates."""
    from systemone.runtime.batch import BatchBudget, TextRow
    from systemone.runtime.d3.code_logits import CodeLogits, code_logits, text_positions
    from systemone.runtime.d3 import state as d3_state
    from systemone.runtime.session import GraphSession
    from systemone.runtime.text_runner import TextRunner

    artifact = request.getfixturevalue("d3_artifact" if mode == "noncausal" else "d3_causal_artifact")
    loaded = Artifact.load(artifact)
    form = loaded.forms_for("cuda")[0]
    fields = loaded.manifest.model
    runner = TextRunner(GraphSession(artifact / f"text.{form}.onnx", "cpu"), BatchBudget(),
                        CodeLogits(int(fields["hidden_size"])), d3_state.layout_of(fields))
    rng = np.random.default_rng(0)
    rows = [TextRow(rng.integers(0, 5000, n).tolist(), text_positions(n)) for n in (9, 41, 23)]
    together = code_logits(runner.run_batch(rows))  # one right-padded call of 41 tokens
    alone = np.concatenate([code_logits(runner.run_batch([row])) for row in rows])
    assert np.abs(together - alone).max() <= 2e-3


def test_the_fused_d1_text_graph_in_torch_is_the_portable_one(d1_checkpoint):
    """d1's fused ops' eager bodies (attention over the past and the call, the residual sum inside the next norm)
    are the portable text graph's: both modules agree on a batch of two rows after a past of 23 tokens, on the
    reads and on the state they return."""
    import torch

    from systemone.export.d1.config import D1ExportConfig

    config = D1ExportConfig(d1_checkpoint)
    inputs = config.example_inputs()
    with torch.no_grad():
        portable, fused = (config.graph(fused=fused, reference=True)(*inputs) for fused in (False, True))
    assert torch.equal(portable[1], fused[1])
    for want, got in zip(portable[:1] + portable[2:], fused[:1] + fused[2:], strict=True):
        assert torch.allclose(want, got, atol=1e-5), (want - got).abs().max()


@pytest.mark.parametrize("past", [0, 9])
def test_the_past_attention_node_reads_the_past_and_its_own_row_up_to_itself(past, tmp_path):
    """The causal fused forms' attention node (d1's, and d3's in causal mode), as exported and run by
    onnxruntime: every query of a call reads all of the past (batch 1, shared by the call's rows) and its own row's
    keys up to itself (query t after P past tokens: keys 0 .. P + t), query head h reading key head h // 4 at 8
    query and 2 key heads; an empty past is a prefill. Against attention written out in numpy (fp16 inputs: within
    2e-3)."""
    import torch

    from systemone.export.fused_ops import TRANSLATIONS, past_attention
    from systemone.runtime.session import GraphSession

    class Attention(torch.nn.Module):
        def forward(self, query, key, value, past_key, past_value):
            return past_attention(query, key, value, past_key, past_value, 8, 0.25)

    rng = np.random.default_rng(0)
    batch, length, dim = 3, 6, 16
    shapes = [(batch, 8, length, dim), (batch, 2, length, dim), (batch, 2, length, dim), (1, 2, past, dim),
              (1, 2, past, dim)]
    arrays = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
    names = ["query", "key", "value", "past_key", "past_value"]
    dynamic = torch.export.Dim.DYNAMIC
    program = torch.onnx.export(Attention(), tuple(torch.from_numpy(a) for a in arrays), dynamo=True,
                                custom_translation_table=TRANSLATIONS, input_names=names,
                                dynamic_shapes=({0: dynamic, 2: dynamic},) * 3 + ({2: dynamic},) * 2)
    program.save(str(tmp_path / "attention.onnx"))
    got = GraphSession(tmp_path / "attention.onnx", "cpu").run(dict(zip(names, arrays)))[0]

    query, key, value, past_key, past_value = (a.astype(np.float64) for a in arrays)
    keys = np.repeat(np.concatenate([np.repeat(past_key, batch, 0), key], axis=2), 4, axis=1)
    values = np.repeat(np.concatenate([np.repeat(past_value, batch, 0), value], axis=2), 4, axis=1)
    scores = 0.25 * query @ keys.transpose(0, 1, 3, 2)
    seen = np.arange(past + length)[None, :] <= np.arange(length)[:, None] + past
    scores = np.where(seen, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    want = (probs / probs.sum(-1, keepdims=True) @ values).transpose(0, 2, 1, 3).reshape(batch, length, 8 * dim)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 2e-3


def test_the_d1_fused_forms_text_attention_is_one_node_a_layer_reading_the_past(d1_artifact):
    """Each LFM2 attention layer of d1's fused text graph is one MultiHeadAttention node: fp16 query, key and value
    with the past as its past inputs, causal (`unidirectional`), no mask; no Softmax (no scores) is left. Each
    layer's residual sums run inside its norms (the first sums in the front's zeros)."""
    half, attention = fused_attention_nodes(d1_artifact, "text", "cuda-fused-fp16")
    for node in attention:
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attributes["unidirectional"] == 1
        assert node.input[3:6] == ["", "", ""] and node.input[6] and node.input[7]
    layers = len(Artifact.load(d1_artifact).manifest.model["layer_types"])
    assert sum(n.op_type == "SkipSimplifiedLayerNormalization" for n in half.graph.node) == 2 * layers


@pytest.mark.parametrize("graph", ["text.onnx", "text.cuda-fused-fp16.onnx"])
def test_d1_text_products_read_their_rows_untransposed(d1_artifact, graph):
    """Each LFM2 convolution layer runs channels last: no projection (a matrix product by a weight) of d1's text
    graphs reads a transposed tensor (on the H200 the transposed view of each convolution's output sent its out
    projection to an unaligned kernel), and in the fused form B, C and x are a product each, so no Split copies a
    joint output."""
    model = onnx.load(str(d1_artifact / graph), load_external_data=False)
    weights = {t.name for t in model.graph.initializer}
    producer = {out: node.op_type for node in model.graph.node for out in node.output}
    projections = [n for n in model.graph.node if n.op_type in ("MatMul", "Gemm") and weights & set(n.input)]
    layers = len(Artifact.load(d1_artifact).manifest.model["layer_types"])
    assert len(projections) >= 2 * layers
    assert not [n.name for n in projections if any(producer.get(name) == "Transpose" for name in n.input)]
    if "fused" in graph:
        assert not any(n.op_type == "Split" for n in model.graph.node)


def test_a_d1_fused_form_suffix_reads_alike_alone_and_beside_longer_rows(d1_artifact):
    """On a prefilled prefix, a question's suffix read through the fused form gives the same log-probabilities
    alone and in a right-padded call beside longer suffixes (half precision: within 2e-3): its answer does not
    depend on its batch mates."""
    from systemone.runtime.batch import BatchBudget, TextRow
    from systemone.runtime.d1.label_reads import LabelLogprobs, label_logprobs
    from systemone.runtime.d1.state import layout_of
    from systemone.runtime.session import GraphSession
    from systemone.runtime.text_runner import TextRunner

    fields = Artifact.load(d1_artifact).manifest.model
    runner = TextRunner(GraphSession(d1_artifact / "text.cuda-fused-fp16.onnx", "cpu"), BatchBudget(),
                        LabelLogprobs(int(fields["hidden_size"])), layout_of(fields))
    runner.cost = None  # calls filled as far as the budgets allow: the three suffixes in one call
    rng = np.random.default_rng(0)
    past = runner.prefill(runner.start(), TextRow(rng.integers(0, 5000, 57).tolist()))
    labels = [5, 17, 300]
    suffixes = [TextRow(rng.integers(0, 5000, n).tolist(), label_ids=tuple(labels)) for n in (4, 19, 11)]
    assert runner.budget.plan([s.length for s in suffixes], past.length) == [[1, 2, 0]]
    together = label_logprobs(runner.read_suffixes(past, suffixes), labels)[0]
    alone = np.concatenate([label_logprobs(runner.read_suffixes(past, [s]), labels)[0] for s in suffixes])
    assert np.abs(together - alone).max() <= 2e-3


@pytest.mark.parametrize("family", ["d3", "d1"])
def test_the_fused_vision_graph_in_torch_is_the_portable_one(family, request):
    """The fused ops' eager bodies (d3's rotary; attention, tanh GELU) are the portable vision graph's: both modules
    agree on a segment (d3) or on crops (d1)."""
    import torch

    from systemone.export.d1.config import D1ExportConfig
    from systemone.export.d3.config import D3ExportConfig

    config = {"d3": D3ExportConfig, "d1": D1ExportConfig}[family](request.getfixturevalue(f"{family}_checkpoint"))
    inputs = config.vision_example_inputs()
    with torch.no_grad():
        portable, fused = (config.vision_graph(fused=fused, reference=True)(*inputs) for fused in (False, True))
    assert torch.allclose(portable, fused, atol=1e-5), (portable - fused).abs().max()


@pytest.mark.parametrize("family", ["d3", "d1"])
def test_the_fused_forms_vision_graph_runs_each_blocks_attention_as_one_node(family, request):
    """No n x n scores: each vision block's attention is one MultiHeadAttention node (flash or memory-efficient
    attention on CUDA) reading fp16 query, key and value; no Softmax is left."""
    _, attention = fused_attention_nodes(request.getfixturevalue(f"{family}_artifact"), "vision", "cuda-fused-fp16")
    assert all(n.domain == "com.microsoft" for n in attention)


def test_the_fused_forms_vision_rotary_is_one_node_for_query_and_one_for_key(d3_artifact):
    """Each block's 2-D rotary is a RotaryEmbedding node for its query and one for its key (one cos/sin row a
    patch) in place of the portable graph's halves, negation and products."""
    half = onnx.load(str(d3_artifact / "vision.cuda-fused-fp16.onnx"), load_external_data=False)
    portable = onnx.load(str(d3_artifact / "vision.onnx"), load_external_data=False)
    rotary = [n for n in half.graph.node if n.op_type == "RotaryEmbedding"]
    assert len(rotary) == sum(n.op_type == "Neg" for n in portable.graph.node) == 2 * sum(
        n.op_type == "Softmax" for n in portable.graph.node)
    assert not any(n.op_type == "Neg" for n in half.graph.node)
    assert all(n.domain == "com.microsoft" for n in rotary)


@pytest.mark.parametrize("family", ["d3", "d1"])
def test_the_fused_forms_vision_mlp_runs_its_tanh_gelu_as_one_node(family, request):
    """Each vision block's MLP activation is one FastGelu node (one pass over its n x intermediate values) in place
    of the portable graph's Pow, Tanh and six more; the projector's (d1) or merger's (d3) exact GELU stays as
    exported."""
    artifact = request.getfixturevalue(f"{family}_artifact")
    half = onnx.load(str(artifact / "vision.cuda-fused-fp16.onnx"), load_external_data=False)
    portable = onnx.load(str(artifact / "vision.onnx"), load_external_data=False)
    gelus = [n for n in half.graph.node if n.op_type == "FastGelu"]
    assert len(gelus) == sum(n.op_type == "Tanh" for n in portable.graph.node) >= 1
    assert not any(n.op_type in ("Tanh", "Pow") for n in half.graph.node)
    assert all(n.domain == "com.microsoft" for n in gelus)
