"""`systemone doctor`: what this machine can run. The machine's probes are parameters, so each rule is checked here
with stubbed provider lists, GPU queries and library loaders (no GPU is lent to the tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from systemone import cli
from systemone.doctor import Runtime, cuda_libraries, query_gpus, read_runtime, report, serve_choice
from systemone.runtime.artifact import FormEntry, GraphEntry, Manifest

CPU_ONLY = Runtime(("onnxruntime 1.32.0",), "1.32.0", ("CPUExecutionProvider",), None)
CUDA = Runtime(("onnxruntime-gpu 1.31.1",), "1.31.1", ("CUDAExecutionProvider", "CPUExecutionProvider"), "13.0")
MIGRAPHX = Runtime(("onnxruntime-migraphx 1.27.1",), "1.27.1", ("MIGraphXExecutionProvider", "CPUExecutionProvider"),
                   None)


@pytest.fixture()
def artifact(tmp_path) -> Path:
    Manifest(family="d3", source="vllm-sr/d3-edge", checkpoint="", max_model_len=512,
             graphs={"text": GraphEntry("text.onnx", {"input_ids": ["batch", "sequence"]}, ["code_logits"]),
                     "vision": GraphEntry("vision.onnx", {"pixels": ["patches", 1536]}, ["embeds"])},
             parity={}, special_tokens={}, tokenizer_class="TokenizersBackend",
             forms={"cuda-fused": FormEntry("float16", ["cuda"], {"text": "text.cuda-fused.onnx"},
                                            {"summary": "210 questions, all equal"}, precisions={"text": "float16"}),
                    "cuda-mixed": FormEntry("float16", ["cuda"], refused="over the gate")}).write(tmp_path)
    return tmp_path


def line(lines: list[str], key: str) -> str:
    return next(item for item in lines if item.startswith(f"{key}: ")).split(": ", 1)[1]


def test_this_machine_reports_its_cpu_runtime_and_no_gpu():
    runtime = read_runtime()
    assert runtime is not None and "CPUExecutionProvider" in runtime.providers
    assert any(flavour.startswith("onnxruntime ") for flavour in runtime.flavours)
    lines = report(runtime, query_gpus(lambda name: None), {}).lines
    assert line(lines, "gpu") == "none"
    assert line(lines, "cuda libraries") == "not used (this onnxruntime has no CUDA provider)"


def test_no_onnxruntime_names_the_extras_and_serve_would_fail():
    findings = report(None, [], {})
    assert "onnxruntime is not installed" in line(findings.lines, "onnxruntime")
    assert "[gpu]" in findings.lines[0] and findings.serve_fails


def test_the_onnxruntime_version_is_said_once():
    assert line(report(CPU_ONLY, [], {}).lines, "onnxruntime") == "1.32.0 (onnxruntime)"


def test_several_flavours_are_a_warning():
    both = Runtime(("onnxruntime 1.32.0", "onnxruntime-gpu 1.31.1"), "1.31.1", CUDA.providers, "13.0")
    assert "several onnxruntime flavours share one `onnxruntime` module" in line(report(both, [], {}).lines,
                                                                                 "warning")


def test_gpu_and_cuda_libraries_are_listed():
    libraries = cuda_libraries(CUDA, load=lambda name: name != "libcudnn.so.9")
    assert list(libraries) == ["libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13", "libcurand.so.10",
                               "libcudnn.so.9"]
    findings = report(CUDA, ["NVIDIA H200, 143771 MiB"], libraries)
    lines = findings.lines
    assert line(lines, "gpu") == "NVIDIA H200, 143771 MiB" and line(lines, "cuda build") == "13.0"
    assert "libcudart.so.13 found" in line(lines, "cuda libraries")
    assert "libcudnn.so.9 MISSING" in line(lines, "cuda libraries")
    assert any(item.startswith("the CUDA provider will not start") for item in lines)
    assert findings.serve_fails


def test_no_cuda_provider_needs_no_cuda_libraries():
    assert cuda_libraries(CPU_ONLY, load=lambda name: pytest.fail("nothing to load")) == {}


@pytest.mark.parametrize("runtime, device, expected, fails", [
    (CUDA, "auto", "serve --device auto would use: CUDAExecutionProvider, the cuda-fused form", False),
    (CPU_ONLY, "auto", "serve --device auto would use: CPUExecutionProvider, the portable form", False),
    (MIGRAPHX, "rocm", "serve --device rocm would use: MIGraphXExecutionProvider, the portable form", False),
    (CPU_ONLY, "cuda", "serve --device cuda would fail: device 'cuda' needs CUDAExecutionProvider", True)])
def test_the_artifact_line_says_what_serve_would_use(artifact, runtime, device, expected, fails):
    findings = serve_choice(artifact, device, runtime.providers)
    lines = findings.lines
    assert lines[0] == f"artifact: {artifact} (family d3, source vllm-sr/d3-edge)"
    assert lines[1] == "graphs: text.onnx (float32), vision.onnx (float32)"
    assert lines[2].startswith(expected)
    assert findings.serve_fails is fails


def test_the_forms_are_listed(artifact):
    assert line(serve_choice(artifact, "auto", CPU_ONLY.providers).lines, "forms") == (
        "portable (float32, any device); cuda-fused (for cuda: text float16; gate: 210 questions, all equal); "
        "cuda-mixed (refused at export: over the gate)")


def test_a_missing_artifact_is_named_and_serve_would_fail(tmp_path):
    findings = serve_choice(tmp_path, "auto", CPU_ONLY.providers)
    assert findings.lines == [
        f"artifact: {tmp_path} is not an exported artifact: it has no manifest.json "
        "(run `systemone export SRC --out DIR` first)"]
    assert findings.serve_fails


def test_the_command_shows_the_rows_a_call_serve_would_keep_and_exits_0(capsys, d3_artifact, tmp_path):
    assert cli.main(["doctor", str(d3_artifact), "--device", "cpu", "--cache-dir", str(tmp_path)]) == 0
    first = capsys.readouterr().out
    assert "providers: " in first and "serve --device cpu would use: CPUExecutionProvider, the portable form" in first
    assert line(first.splitlines(), "batch rows").endswith("measured now, kept in " + str(
        next((tmp_path / "batch-rows").iterdir())))
    assert cli.main(["doctor", str(d3_artifact), "--device", "cpu", "--cache-dir", str(tmp_path)]) == 0
    again = line(capsys.readouterr().out.splitlines(), "batch rows")
    assert again.split(";")[0] == line(first.splitlines(), "batch rows").split(";")[0]
    assert "kept from an earlier start" in again


@pytest.mark.parametrize(("case", "said"), [
    ("missing artifact", "is not an exported artifact: it has no manifest.json"),
    ("absent device", "serve --device cuda would fail: device 'cuda' needs CUDAExecutionProvider"),
    ("artifact whose files are gone", "serve --device cpu would fail: ")])
def test_the_command_exits_1_where_serve_would_fail(capsys, d3_artifact, tmp_path, case, said):
    import shutil

    device = "cpu"
    if case == "missing artifact":
        target = tmp_path / "nothing"
    elif case == "absent device":
        target, device = d3_artifact, "cuda"
    else:
        target = tmp_path / "broken"
        shutil.copytree(d3_artifact, target, ignore=shutil.ignore_patterns("text.onnx*"))
    assert cli.main(["doctor", str(target), "--device", device, "--cache-dir", str(tmp_path / "cache")]) == 1
    assert said in capsys.readouterr().out.splitlines()[-1]
