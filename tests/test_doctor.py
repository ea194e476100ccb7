"""`systemone doctor`: what this machine can run. The machine's probes are parameters, so each rule is checked here
with stubbed provider lists, GPU queries and library loaders (no GPU is lent to the tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from systemone import cli
from systemone.doctor import Runtime, cuda_libraries, query_gpus, read_runtime, report, serve_choice
from systemone.runtime.artifact import GraphEntry, Manifest

CPU_ONLY = Runtime(("onnxruntime 1.32.0",), "1.32.0", ("CPUExecutionProvider",), None)
CUDA = Runtime(("onnxruntime-gpu 1.31.1",), "1.31.1", ("CUDAExecutionProvider", "CPUExecutionProvider"), "13.0")
MIGRAPHX = Runtime(("onnxruntime-migraphx 1.27.1",), "1.27.1", ("MIGraphXExecutionProvider", "CPUExecutionProvider"),
                   None)


@pytest.fixture()
def artifact(tmp_path) -> Path:
    Manifest(family="d3", source="vllm-sr/d3-edge", checkpoint="", max_model_len=512,
             graphs={"text": GraphEntry("text.onnx", {"input_ids": ["batch", "sequence"]}, ["code_logits"]),
                     "vision": GraphEntry("vision.onnx", {"pixels": ["patches", 1536]}, ["embeds"])},
             parity={}, special_tokens={}, tokenizer_class="TokenizersBackend").write(tmp_path)
    return tmp_path


def line(lines: list[str], key: str) -> str:
    return next(item for item in lines if item.startswith(f"{key}: ")).split(": ", 1)[1]


def test_this_machine_reports_its_cpu_runtime_and_no_gpu():
    runtime = read_runtime()
    assert runtime is not None and "CPUExecutionProvider" in runtime.providers
    assert any(flavour.startswith("onnxruntime ") for flavour in runtime.flavours)
    lines = report(runtime, query_gpus(lambda name: None), {})
    assert line(lines, "gpu") == "none"
    assert line(lines, "cuda libraries") == "not used (this onnxruntime has no CUDA provider)"


def test_no_onnxruntime_names_the_extras():
    lines = report(None, [], {})
    assert "onnxruntime is not installed" in line(lines, "onnxruntime") and "systemone-onnx[gpu]" in lines[0]


def test_several_flavours_are_a_warning():
    both = Runtime(("onnxruntime 1.32.0", "onnxruntime-gpu 1.31.1"), "1.31.1", CUDA.providers, "13.0")
    assert "several onnxruntime flavours share one `onnxruntime` module" in line(report(both, [], {}), "warning")


def test_gpu_and_cuda_libraries_are_listed():
    libraries = cuda_libraries(CUDA, load=lambda name: name != "libcudnn.so.9")
    assert list(libraries) == ["libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13", "libcurand.so.10",
                               "libcudnn.so.9"]
    lines = report(CUDA, ["NVIDIA H200, 143771 MiB"], libraries)
    assert line(lines, "gpu") == "NVIDIA H200, 143771 MiB" and line(lines, "cuda build") == "13.0"
    assert "libcudart.so.13 found" in line(lines, "cuda libraries")
    assert "libcudnn.so.9 MISSING" in line(lines, "cuda libraries")
    assert any(item.startswith("the CUDA provider will not start") for item in lines)


def test_no_cuda_provider_needs_no_cuda_libraries():
    assert cuda_libraries(CPU_ONLY, load=lambda name: pytest.fail("nothing to load")) == {}


@pytest.mark.parametrize("runtime, device, expected", [
    (CUDA, "auto", "serve --device auto would use: CUDAExecutionProvider"),
    (CPU_ONLY, "auto", "serve --device auto would use: CPUExecutionProvider"),
    (MIGRAPHX, "rocm", "serve --device rocm would use: MIGraphXExecutionProvider"),
    (CPU_ONLY, "cuda", "serve --device cuda would fail: device 'cuda' needs CUDAExecutionProvider")])
def test_the_artifact_line_says_what_serve_would_use(artifact, runtime, device, expected):
    lines = serve_choice(artifact, device, runtime.providers)
    assert lines[0] == f"artifact: {artifact} (family d3, source vllm-sr/d3-edge)"
    assert lines[1] == "graphs: text.onnx (float32), vision.onnx (float32)"
    assert lines[2].startswith(expected)


def test_a_missing_artifact_is_named(tmp_path):
    assert serve_choice(tmp_path, "auto", CPU_ONLY.providers) == [
        f"artifact: {tmp_path} is not an exported artifact: it has no manifest.json "
        "(run `systemone export SRC --out DIR` first)"]


def test_the_command(capsys, artifact):
    assert cli.main(["doctor", str(artifact), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "providers: " in out and "serve --device cpu would use: CPUExecutionProvider" in out
