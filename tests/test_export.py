"""The export: a self-contained artifact, symbolic axes asserted, parity gate before writing,
checkpoints from a local directory or a hub id."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest

from systemone.export.parity import check_parity, padded_groups
from systemone.export.pipeline import ParityError, export_checkpoint, symbolic_axes
from systemone.export.source import checkpoint_name, resolve_checkpoint
from systemone.runtime.session import GraphSession


def test_artifact_is_self_contained(d3_artifact, d3_checkpoint):
    files = {p.name for p in d3_artifact.iterdir()}
    assert {"manifest.json", "text.onnx", "text.onnx.data", "tokenizer.json", "chat_template.jinja",
            "decision_config.json"} <= files
    manifest = json.loads((d3_artifact / "manifest.json").read_text())
    assert manifest["family"] == "d3" and manifest["opset"] == 18
    assert manifest["attention_mode"] == "noncausal_full_attention"
    assert manifest["tokenizer_class"] == "Qwen3_5Tokenizer"
    assert set(manifest["source_files"]) >= {"config.json", "model.safetensors", "readout.safetensors",
                                             "decision_config.json", "tokenizer.json"}
    assert {"torch", "transformers", "onnx", "onnxruntime"} <= set(manifest["versions"])
    parity = manifest["parity"]
    assert [s["tokens"] for s in parity["samples"][:5]] == [1, 7, 77, 200, 1000]
    assert parity["samples"][5]["sample"] == "repeated-200"  # one token 200 times: the delta rule's hard case
    assert parity["samples"][-1]["sample"] == "media-embeds"
    assert parity["max_abs_prob_diff"] <= 1e-4
    # The graph reads its weights from external data next to it.
    model = onnx.load(str(d3_artifact / "text.onnx"), load_external_data=False)
    assert any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)


def test_the_tokenizer_is_written_unindented_with_its_longest_entry_in_the_manifest(d3_artifact):
    """A start reads tokenizer.json whole and parses it: it is written without indentation, and the characters of
    its longest entry (the bound on a prompt's characters per token) are recorded, not read off the vocabulary at
    every start; an artifact without the record reads them there."""
    from dataclasses import replace

    from tokenizers import Tokenizer

    from systemone.runtime.artifact import Artifact

    text = (d3_artifact / "tokenizer.json").read_text(encoding="utf-8")
    assert "\n" not in text
    longest = max(len(entry) for entry in Tokenizer.from_str(text).get_vocab(with_added_tokens=True))
    assert json.loads((d3_artifact / "manifest.json").read_text())["max_token_chars"] == longest
    artifact = Artifact.load(d3_artifact)
    assert artifact.max_token_chars == longest
    unrecorded = replace(artifact, manifest=replace(artifact.manifest, max_token_chars=0))
    assert unrecorded.max_token_chars == longest


def test_graph_axes_are_symbolic_and_run_at_any_length(d3_artifact):
    """The probe's trap: an export pinned to the trace length. Batch and sequence must be symbolic."""
    shapes = symbolic_axes(onnx.load(str(d3_artifact / "text.onnx"), load_external_data=False),
                           {"input_ids": {0: "batch", 1: "sequence"}})
    assert all(isinstance(d, str) for d in shapes["input_ids"])
    session = GraphSession(d3_artifact / "text.onnx", "cpu")
    for batch, length in ((1, 1), (4, 3), (2, 129)):
        feeds = {"input_ids": np.ones((batch, length), np.int64), "attention_mask": np.ones((batch, length), np.int64),
                 "position_ids": np.broadcast_to(np.arange(length), (3, batch, length)).astype(np.int64),
                 "media_embeds": np.zeros((0, 64), np.float32), "media_index": np.zeros((0,), np.int64)}
        assert session.run(feeds)[0].shape == (batch, 255)


def test_a_pinned_axis_is_refused(tmp_path):
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", 150])
    y = helper.make_tensor_value_info("y", TensorProto.INT64, ["batch", 150])
    graph = helper.make_graph([helper.make_node("Identity", ["input_ids"], ["y"])], "g", [x], [y])
    with pytest.raises(ParityError, match=r"pins input_ids\[1\] \(sequence\) to 150"):
        symbolic_axes(helper.make_model(graph), {"input_ids": {0: "batch", 1: "sequence"}})


def graph_of(logits: dict[tuple[int, ...], list[float]]):
    """A fake graph run: each prompt's logits by its ids, a batch of prompts at once."""
    return lambda batch, media=None: np.array([logits[tuple(ids)] for ids in batch], dtype=np.float32)


def test_parity_gate_reports_the_worst_sample():
    prompts = [("ok", [1, 2, 3]), ("off", [4, 5])]
    graph = graph_of({(1, 2, 3): [0.0, 1.0], (4, 5): [0.0, 1.0]})
    reference = {3: np.array([0.0, 1.0]), 2: np.array([0.0, 1.5])}
    with pytest.raises(ParityError, match="1 of 2 samples .*worst: off, 2 tokens"):
        check_parity(graph, lambda ids, media=None: reference[len(ids)], prompts, 1.0, 2e-3, 1e-4)
    report = check_parity(graph, lambda ids, media=None: reference[3], prompts[:1], 1.0, 2e-3, 1e-4)
    assert report["max_abs_logit_diff"] == 0.0


def test_parity_fails_on_a_nan_logit_wherever_it_lies():
    """Seen on a d3-nano export: NaN logits on some padded rows passed, since NaN > atol is false. The message
    names the NaN sample as the worst, even beside a finite sample that also fails."""
    prompts = [("fine", [1, 2, 3]), ("off", [7]), ("nan", [4, 5]), ("fine-too", [6])]
    graph = graph_of({(1, 2, 3): [0.0, 1.0], (7,): [0.5, 1.0], (4, 5): [np.nan, 1.0], (6,): [0.0, 1.0]})
    with pytest.raises(ParityError, match="2 of 4 samples .*worst: nan, 2 tokens, logit diff nan"):
        check_parity(graph, lambda ids, media=None: np.array([0.0, 1.0]), prompts, 1.0, 2e-3, 1e-4)


def test_the_gate_reads_prompts_in_padded_batches_of_similar_lengths():
    """Rows of different lengths share a right-padded batch while its padding stays within twice its tokens: the
    gate's prompts of 1 to 1,000 tokens are read in three batches, not one padded to 1,000 tokens each."""
    assert padded_groups([1, 7, 77, 200, 1000, 200, 150, 250, 120]) == [[0, 1], [2, 8, 6, 3, 5, 7], [4]]
    assert padded_groups([5]) == [[0]] and padded_groups([]) == []
    calls = []

    def graph(batch, media=None):
        calls.append([len(ids) for ids in batch])
        return np.zeros((len(batch), 2), np.float32)

    prompts = [(f"random-{n}", [0] * n) for n in (1, 7, 77, 200, 1000)]
    check_parity(graph, lambda ids, media=None: np.zeros(2), prompts, 1.0, 2e-3, 1e-4)
    assert calls == [[1, 7], [77, 200], [1000]]


def test_export_writes_nothing_when_parity_is_off(d3_checkpoint, tmp_path, monkeypatch):
    """Export refuses to write an artifact whose graph disagrees with the torch model."""
    from systemone.export.d3.config import D3ExportConfig

    real = D3ExportConfig.reference_logits
    monkeypatch.setattr(D3ExportConfig, "reference_logits", lambda self, *args: real(self, *args) + 0.01)
    out = tmp_path / "art"
    with pytest.raises(ParityError, match="no artifact written"):
        export_checkpoint(str(d3_checkpoint), out, lengths=(7,))
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no staging left behind


def test_export_refuses_a_non_d3_checkpoint(d3_checkpoint, tmp_path):
    source = tmp_path / "not-d3"
    shutil.copytree(d3_checkpoint, source, ignore=shutil.ignore_patterns("*.safetensors", "decision_config.json"))
    # Neither family's checkpoint: the refusal names what a d3 checkpoint needs (spec 4.1).
    with pytest.raises(ValueError, match=r"is not a checkpoint of a known family: d3: config.json architectures == "
                                         r"\['Qwen3_5Model'\] and a decision_config.json"):
        export_checkpoint(str(source), tmp_path / "out")


def test_hub_id_resolves_through_the_hub_cache(d3_checkpoint, tmp_path, monkeypatch):
    """A hub id goes through huggingface_hub's snapshot_download; offline it answers from the cache."""
    cache = tmp_path / "hub"
    snapshot = cache / "models--vllm-sr--d3-tiny" / "snapshots" / ("0" * 40)
    shutil.copytree(d3_checkpoint, snapshot)
    (cache / "models--vllm-sr--d3-tiny" / "refs").mkdir()
    (cache / "models--vllm-sr--d3-tiny" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    resolved = resolve_checkpoint("vllm-sr/d3-tiny")
    assert resolved == snapshot and (resolved / "decision_config.json").is_file()
    with pytest.raises(ValueError, match="could not fetch checkpoint 'vllm-sr/d3-missing'"):
        resolve_checkpoint("vllm-sr/d3-missing")


def test_the_manifest_names_a_local_checkpoint_by_its_directory(d3_artifact, d3_checkpoint):
    """The served name defaults to the manifest's `source`: the directory's name, not the exporting machine's path."""
    assert json.loads((d3_artifact / "manifest.json").read_text())["source"] == d3_checkpoint.name == "d3-tiny"


@pytest.mark.parametrize("source, name", [("vllm-sr/d3-edge", "vllm-sr/d3-edge"), ("LiquidAI/d1-3B", "LiquidAI/d1-3B")])
def test_a_hub_id_is_its_own_name(source, name):
    assert checkpoint_name(source) == name


def test_a_local_directory_is_named_by_its_last_part(tmp_path):
    (tmp_path / "ckpts" / "d3-edge").mkdir(parents=True)
    assert checkpoint_name(str(tmp_path / "ckpts" / "d3-edge")) == "d3-edge"
    assert checkpoint_name(str(tmp_path / "ckpts" / "d3-edge" / ".")) == "d3-edge"


@pytest.mark.parametrize("source", ["not a hub id", "/no/such/dir", "a/b/c"])
def test_bad_sources_are_named(source):
    with pytest.raises(ValueError, match="neither a local directory nor a hub id"):
        resolve_checkpoint(source)


def test_existing_output_needs_overwrite(d3_checkpoint, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(FileExistsError, match="--overwrite"):
        export_checkpoint(str(d3_checkpoint), out)
    assert (out / "keep").read_text() == "x"

