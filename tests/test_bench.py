"""`systemone bench` measures the runtime and the torch model on the same token batches, and what it reports
holds: the runtime's numbers agree with fp32 torch on those batches, and every row and request kind is timed."""

from __future__ import annotations

import json

import pytest

from systemone.bench import run_bench
from systemone.cli import main as cli_main
from systemone.runtime.artifact import Artifact


@pytest.mark.parametrize("family", ["d3", "d1"])
def test_bench_compares_the_same_batches(family, request):
    checkpoint = request.getfixturevalue(f"{family}_checkpoint")
    artifact = request.getfixturevalue(f"{family}_artifact")
    half = Artifact.load(artifact).forms_for("cuda")[0]  # the form export wrote for CUDA
    report = run_bench(checkpoint, artifact, "cpu", batches=(1, 3), lengths=(17, 40), repeats=2, request_repeats=2,
                       torch_dtypes=("float32",), forms=("portable", half), log=lambda line: None)
    assert report["family"] == family and set(report["forms"]) == {"portable", half}
    assert [(r["batch"], r["length"]) for r in report["torch_float32"]["batches"]] == [(1, 17), (3, 17), (1, 40),
                                                                                      (3, 40)]
    for name, form in report["forms"].items():
        assert form["provider"] == "CPUExecutionProvider"
        assert [(r["batch"], r["length"]) for r in form["batches"]] == [(1, 17), (3, 17), (1, 40), (3, 40)]
        for row in form["batches"]:
            # The portable form is the fp32 graph; the half-precision one is gated on answers, not logits.
            assert row["max_abs_diff_vs_torch_float32"] <= (2e-3 if name == "portable" else 0.5), row
            assert row["runtime_ms"] > 0 and row["runtime_over_torch_float32"] > 0
        assert set(form["requests"]) >= {"one_question", "sixteen_questions"}
        for timing in form["requests"].values():
            assert 0 < timing["p50_ms"] <= timing["p99_ms"]
        assert form["gpu_memory_serving_mib"] is None  # no NVIDIA GPU here
        # Requests are timed as serve answers them: after the start-up measurement that groups their calls.
        assert "a call costs" in form["batch_sizing"]
    # d3's half-precision form is smaller on disk (its readout is tiny). d1's keeps its LM head fp32 beside the
    # fp16 embedding table it is tied to, which dominates a tiny model: there the form is larger (docs/gpu.md).
    if family == "d3":
        assert report["forms"][half]["graph_bytes"] < 0.75 * report["forms"]["portable"]["graph_bytes"]
    assert report["artifact_bytes"] > 0


def test_bench_command_writes_its_report(d3_checkpoint, d3_artifact, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert cli_main(["bench", str(d3_checkpoint), "--artifact", str(d3_artifact), "--batches", "2", "--lengths",
                     "9", "--repeats", "1", "--request-repeats", "1", "--torch-dtypes", "float32",
                     "--out", str(out)]) == 0
    assert json.loads(out.read_text())["forms"]["portable"]["batches"][0]["batch"] == 2
