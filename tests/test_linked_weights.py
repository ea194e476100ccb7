"""`systemone export --weights link`: weights used as the checkpoint stores them are read from its files, hard-linked
into the artifact, and made in the graph's dtype when a session opens (runtime/linked_weights.py); the artifact
answers exactly as one that copies them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from safetensors.torch import save_file

from systemone.export.pipeline import export_checkpoint
from systemone.export.weights import (CheckpointTensors, Constant, Derived, Linker, Stored, WeightBook, _to_float16,
                                      virtual_tensor, write_graph)
from systemone.runtime.artifact import Artifact, ArtifactError
from systemone.runtime.engine import EngineOptions
from systemone.runtime.linked_weights import FP16_MAX, links_path, read_links, to_float16
from systemone.runtime.service import DecisionService
from systemone.runtime.session import GraphSession


def test_linked_fp16_weights_are_the_values_the_copying_writer_writes():
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.standard_normal(10_000).astype(np.float32) * 3,
                             np.array([0.0, -0.0, 1e-9, -1e-9, 3e-8, 7e5, -7e5, FP16_MAX, 65519.0, 65520.0,
                                       np.inf, -np.inf, np.nan, 1e-30], np.float32)])
    ours, theirs = to_float16(values.copy()), _to_float16(values.copy())
    assert ours.dtype == theirs.dtype == np.float16
    assert ours.view(np.uint16).tolist() == theirs.view(np.uint16).tolist()


def _checkpoint(root: Path) -> Path:
    torch.manual_seed(0)
    tensors = {"proj": torch.randn(48, 32), "qkv": torch.randn(96, 32), "norm": torch.randn(32)}
    save_file({name: t.to(torch.bfloat16) for name, t in tensors.items()}, str(root / "model.safetensors"))
    return root


def _graph_and_book():
    """x [2, 32] -> x @ proj.T, x @ q.T, x @ k.T (q and k: the first two thirds of a split of qkv), x * norm; every
    weight virtual, fp16, as export's half-precision forms declare them."""
    book = WeightBook({"proj": Stored("model.safetensors", "proj"), "qkv": Stored("model.safetensors", "qkv"),
                       "norm": Stored("model.safetensors", "norm"), "sizes": Constant(np.array([32, 32, 32]))})
    transpose = helper.make_node("Transpose", ["a"], ["b"], perm=[1, 0]).SerializeToString()
    split = helper.make_node("Split", ["a", "s"], ["q", "k", "v"], axis=0).SerializeToString()
    book.add("proj_t", Derived(transpose, ("proj",)))
    for index, name in enumerate(("q", "k")):
        book.add(name, Derived(split, ("qkv", "sizes"), index))
        book.add(f"{name}_t", Derived(transpose, (name,)))
    weights = [virtual_tensor("proj_t", TensorProto.FLOAT16, (32, 48)), virtual_tensor("q_t", TensorProto.FLOAT16, (32, 32)),
               virtual_tensor("k_t", TensorProto.FLOAT16, (32, 32)), virtual_tensor("norm", TensorProto.FLOAT16, (32,))]
    nodes = [helper.make_node("MatMul", ["x", "proj_t"], ["y0"]), helper.make_node("MatMul", ["x", "q_t"], ["y1"]),
             helper.make_node("MatMul", ["x", "k_t"], ["y2"]), helper.make_node("Mul", ["x", "norm"], ["y3"])]
    outputs = [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT16, None) for i in range(4)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 32])],
                              outputs, weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), book


def test_a_linked_graph_answers_as_the_copied_one_from_the_checkpoints_own_file(tmp_path):
    (tmp_path / "ckpt").mkdir()
    checkpoint = _checkpoint(tmp_path / "ckpt")
    tensors = CheckpointTensors(checkpoint)
    (tmp_path / "copy").mkdir()
    (tmp_path / "link").mkdir()
    model, book = _graph_and_book()
    copied = write_graph(onnx.ModelProto.FromString(model.SerializeToString()), tmp_path / "copy" / "g.onnx", book,
                         tensors)
    linker = Linker(tmp_path / "link", tensors, min_bytes=0)
    linked = write_graph(model, tmp_path / "link" / "g.onnx", book, tensors, linker=linker)

    links = {link.name: link for link in read_links(linked)}
    assert set(links) == {"proj_t", "q_t", "k_t", "norm"}
    assert links["proj_t"].transpose and links["k_t"].shape == (32, 32) and not links["norm"].transpose
    assert links["k_t"].offset - links["q_t"].offset == 32 * 32 * 2  # the split's second piece: 32 rows further
    assert os.stat(tmp_path / "link" / "linked" / "model.safetensors").st_ino == \
        os.stat(checkpoint / "model.safetensors").st_ino  # a hard link: no second copy on disk
    assert linker.files == {"linked/model.safetensors": (checkpoint / "model.safetensors").stat().st_size}
    x = {"x": np.random.default_rng(1).standard_normal((2, 32)).astype(np.float16)}
    want, got = GraphSession(copied, "cpu").run(x), GraphSession(linked, "cpu").run(x)
    for a, b in zip(want, got):
        assert a.tobytes() == b.tobytes()


def test_a_weight_that_is_not_a_view_of_one_stored_tensor_is_written(tmp_path):
    """1 + w is computed, not stored: the artifact holds it."""
    checkpoint = _checkpoint(tmp_path)
    book = WeightBook({"norm": Stored("model.safetensors", "norm"), "one": Constant(np.array(1.0, np.float32))})
    book.add("shifted", Derived(helper.make_node("Add", ["a", "b"], ["c"]).SerializeToString(), ("norm", "one")))
    tensors = CheckpointTensors(checkpoint)
    assert Linker(tmp_path, tensors, min_bytes=0).link(virtual_tensor("shifted", TensorProto.FLOAT, (32,)),
                                                       "shifted", book) is None
    assert Linker(tmp_path, tensors, min_bytes=0).link(virtual_tensor("norm", TensorProto.FLOAT, (32,)),
                                                       "norm", book) is not None


def test_a_linked_export_answers_as_a_copied_one_and_needs_its_linked_files(d3_checkpoint, d3_artifact, tmp_path):
    out = export_checkpoint(str(d3_checkpoint), tmp_path / "linked", forms=["cuda-fused-fp16"], gate_device="cpu",
                            weights="link")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format_version"] == 3 and manifest["linked"] == {
        "linked/model.safetensors": (d3_checkpoint / "model.safetensors").stat().st_size}
    assert read_links(out / "text.cuda-fused-fp16.onnx")  # the embedding table, at the tiny size
    body = {"state": "The parcel arrived crushed.", "questions": {
        "refund": {"type": "noul", "instructions": "Does the customer want a refund?"},
        "mood": {"type": "score", "criteria": ["calm", "annoyed", "furious"]}}}
    answers = []
    for artifact in (out, d3_artifact):
        service = DecisionService(Artifact.load(artifact), EngineOptions(device="cpu", form="cuda-fused-fp16"))
        answers.append(service.decide(body)["answers"])
        service.close()
    assert answers[0] == answers[1]

    (out / "linked" / "model.safetensors").unlink()
    with pytest.raises(ArtifactError, match="linked/model.safetensors, which is missing: export the checkpoint again"):
        Artifact.load(out)


def test_a_links_file_this_runtime_cannot_make_is_refused_with_export_again(tmp_path):
    graph = tmp_path / "g.onnx"
    links_path(graph).write_text(json.dumps([{"name": "w", "file": "linked/m.safetensors", "offset": 0,
                                              "stored": "I8", "shape": [4], "dtype": "float16"}]))
    with pytest.raises(ValueError, match="export again"):
        read_links(graph)


def test_a_weight_only_a_cast_reads_is_the_checkpoints_own_rows_read_by_onnxruntime(tmp_path):
    """The cuda-fp32 rung's weights (fp16 at rest, cast to fp32, overridable): linked, each is declared as the
    checkpoint's bf16 rows at their offset in the hard-linked file, no runtime array; a transposed one is read
    transposed by its product (FusedMatMul), or through a Transpose by anything else; the graph answers as the
    copied one."""
    (tmp_path / "ckpt").mkdir()
    checkpoint = _checkpoint(tmp_path / "ckpt")
    tensors = CheckpointTensors(checkpoint)
    model, book = _graph_and_book()
    graph = model.graph
    graph.input[0].CopyFrom(helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 32]))
    del graph.node[:], graph.output[:]
    for name in ("proj_t", "q_t", "k_t"):  # overridable, each read by a cast to fp32
        graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT16, None))
        graph.node.append(helper.make_node("Cast", [name], [f"{name}_fp32"], f"{name}_cast", to=TensorProto.FLOAT))
    graph.node.extend([helper.make_node("MatMul", ["x", "proj_t_fp32"], ["y0"]),
                       helper.make_node("MatMul", ["x", "q_t_fp32"], ["y1"]),
                       helper.make_node("Add", ["k_t_fp32", "k_t_fp32"], ["y2"])])  # not a product: a Transpose
    graph.output.extend(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None) for i in range(3))
    for tensor in graph.initializer:
        if tensor.name == "norm":
            graph.initializer.remove(tensor)
            break
    (tmp_path / "copy").mkdir()
    (tmp_path / "link").mkdir()
    copied = write_graph(onnx.ModelProto.FromString(model.SerializeToString()), tmp_path / "copy" / "g.onnx", book,
                         tensors)
    linked = write_graph(model, tmp_path / "link" / "g.onnx", book, tensors,
                         linker=Linker(tmp_path / "link", tensors, min_bytes=0))

    assert read_links(linked) == []  # nothing for the runtime to make
    written = onnx.load(str(linked), load_external_data=False)
    stored = {t.name: (t.data_type, list(t.dims), {e.key: e.value for e in t.external_data})
              for t in written.graph.initializer}
    offsets = {key: value.start for key, value in tensors.files["model.safetensors"].items()}
    assert stored["proj_t"] == (TensorProto.BFLOAT16, [48, 32], {
        "location": "linked/model.safetensors", "offset": str(offsets["proj"]), "length": str(48 * 32 * 2)})
    assert stored["k_t"][:2] == (TensorProto.BFLOAT16, [32, 32])
    assert stored["k_t"][2]["offset"] == str(offsets["qkv"] + 32 * 32 * 2)  # the split's second piece
    assert [n.op_type for n in written.graph.node] == ["Cast", "Cast", "Cast", "Transpose", "FusedMatMul",
                                                      "FusedMatMul", "Add"]
    x = {"x": np.random.default_rng(1).standard_normal((2, 32)).astype(np.float32)}
    session = GraphSession(linked, "cpu", in_graph_order=True)
    assert session.linked_weights == []
    for want, got in zip(GraphSession(copied, "cpu", in_graph_order=True).run(x), session.run(x)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
