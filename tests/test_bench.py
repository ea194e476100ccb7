"""`systemone bench` measures the runtime and the checkpoint's own runtime on the same token batches, and what it
reports holds: the torch side is configured as the report says (transformers' default attention, the kernels
transformers chose), both sides are timed the same number of times in turn, the ratio is torch's time over ours,
the runtime's numbers agree with fp32 torch on those batches, and every row and request kind is timed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import warnings

import pytest

from systemone import cli
from systemone.bench import alternated, run_bench
from systemone.cli import build_parser, main as cli_main
from systemone.runtime.artifact import Artifact

# The kernel-or-fallback function of each family's modeling that its hot path calls, and the package it comes from.
HOT_KERNEL = {"d3": "torch_chunk_gated_delta_rule", "d1": "causal_conv1d_fn"}


@pytest.mark.parametrize("family", ["d3", "d1"])
def test_bench_compares_the_same_batches(family, request):
    checkpoint = request.getfixturevalue(f"{family}_checkpoint")
    artifact = request.getfixturevalue(f"{family}_artifact")
    half = Artifact.load(artifact).forms_for("cuda")[0]  # the form export wrote for CUDA
    report = run_bench(checkpoint, artifact, "cpu", batches=(1, 3), lengths=(17, 40), repeats=3, request_repeats=2,
                       torch_dtypes=("float32",), forms=("portable", half), log=lambda line: None)
    assert report["family"] == family and set(report["forms"]) == {"portable", half}
    torch_side = report["torch"]
    # The torch side as a user runs it: transformers' default attention.
    assert torch_side["attention_implementation"]["model"] == "sdpa"
    assert torch_side["versions"]["torch"] and torch_side["versions"]["transformers"]
    assert torch_side["timed_runs"] == 3 and torch_side["dtypes"] == ["float32"]
    # Neither kernel package is installed here: the report says so, and that the torch fallback is what ran.
    assert torch_side["kernel_packages"]["fla"]["importable"] is (importlib.util.find_spec("fla") is not None)
    assert torch_side["kernels"][HOT_KERNEL[family]]["torch_fallback"] is True
    assert torch_side["profile"] and all(isinstance(ops, list) and ops for ops in torch_side["profile"].values())
    for name, form in report["forms"].items():
        assert form["provider"] == "CPUExecutionProvider"
        assert [(r["batch"], r["length"]) for r in form["batches"]] == [(1, 17), (3, 17), (1, 40), (3, 40)]
        for row in form["batches"]:
            # The portable form is the fp32 graph; the half-precision one is gated on answers, not logits.
            assert row["max_abs_diff_vs_torch_float32"] <= (2e-3 if name == "portable" else 0.5), row
            # Both sides timed as often, each with its spread; above 1 the runtime is faster.
            torch_row = row["torch"]["float32"]
            assert row["runs"] == torch_row["runs"] == 3
            assert row["runtime_ms_spread"]["min"] <= row["runtime_ms"] <= row["runtime_ms_spread"]["max"]
            assert torch_row["spread"]["min"] <= torch_row["ms"] <= torch_row["spread"]["max"]
            assert row["speedup_over_torch_float32"] == pytest.approx(torch_row["ms"] / row["runtime_ms"])
            assert "torch_against" not in row  # no CUDA graphs to compare with on the CPU
        assert set(form["requests"]) >= {"one_question", "sixteen_questions"}
        for timing in form["requests"].values():
            assert 0 < timing["p50_ms"] <= timing["p99_ms"]
        assert form["gpu_memory_serving_mib"] is None  # no NVIDIA GPU here
        # Requests are timed as serve answers them: after the start-up measurement that groups their calls.
        assert "a call costs" in form["batch_sizing"]
    # d3's half-precision form is smaller on disk (its readout is tiny). d1's keeps its LM head fp32 beside the
    # fp16 embedding table it is tied to, which dominates a tiny model: there the form is larger
    # (docs/decisions/cuda-form-ladder.md).
    if family == "d3":
        assert report["forms"][half]["graph_bytes"] < 0.75 * report["forms"]["portable"]["graph_bytes"]
    assert report["artifact_bytes"] > 0


def test_the_sides_are_timed_in_turn_after_a_warm_up_of_each():
    calls: list[str] = []
    times = alternated({"ours": lambda: calls.append("ours"), "torch": lambda: calls.append("torch")}, repeats=3)
    assert calls == ["ours", "torch"] * 4  # the warm-up round, then three timed rounds
    assert {name: len(t) for name, t in times.items()} == {"ours": 3, "torch": 3}


def test_the_bench_times_ten_runs_a_side_in_bf16_by_default():
    args = build_parser().parse_args(["bench", "ckpt", "--artifact", "art"])
    assert args.repeats >= 10 and args.torch_dtypes == ["bfloat16"] and args.shapes is None
    args = build_parser().parse_args(["bench", "ckpt", "--artifact", "art", "--shapes", "1x200", "8x1000"])
    assert args.shapes == [(1, 200), (8, 1000)]


def test_the_report_names_the_kernel_package_transformers_chose(tmp_path):
    # A stand-in flash-linear-attention on the path when transformers' Qwen3.5 modeling is first imported: the
    # record says its function is what the Gated DeltaNet calls, read from the loaded module.
    ops = tmp_path / "fla" / "ops" / "gated_delta_rule"
    ops.mkdir(parents=True)
    for folder in (tmp_path / "fla", tmp_path / "fla" / "ops"):
        (folder / "__init__.py").write_text("")
    (ops / "__init__.py").write_text("def chunk_gated_delta_rule(q, k, v, g, beta, **kwargs):\n    pass\n\n"
                                     "def fused_recurrent_gated_delta_rule(q, k, v, g, beta, **kwargs):\n    pass\n")
    script = ("import json\n"
              "from transformers.models.qwen3_5 import modeling_qwen3_5 as m\n"
              "from systemone.torch_runtime import chosen_implementation\n"
              "f = chosen_implementation(m.torch_chunk_gated_delta_rule)\n"
              "print(json.dumps([f.__module__, f is m.torch_chunk_gated_delta_rule.__wrapped__]))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.getcwd()])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == ["fla.ops.gated_delta_rule", False]


def test_the_bench_shows_third_party_warnings(monkeypatch, recwarn):
    seen = {}

    def bench(*args, **kwargs):
        seen["verbosity"] = os.environ.get("TRANSFORMERS_VERBOSITY")
        warnings.warn("`chunk_gated_delta_rule` is falling back", UserWarning)
        return {}

    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    monkeypatch.setattr("systemone.bench.run_bench", bench)
    assert cli.main(["bench", "ckpt", "--artifact", "art"]) == 0
    assert seen["verbosity"] is None and any("falling back" in str(w.message) for w in recwarn)


def test_bench_command_writes_its_report(d3_checkpoint, d3_artifact, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert cli_main(["bench", str(d3_checkpoint), "--artifact", str(d3_artifact), "--batches", "2", "--lengths",
                     "9", "--repeats", "1", "--request-repeats", "1", "--torch-dtypes", "float32",
                     "--out", str(out)]) == 0
    assert json.loads(out.read_text())["forms"]["portable"]["batches"][0]["batch"] == 2
