"""Runtime pieces: execution-provider choice (never a silent fallback), batching, no torch at serve time."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest

from systemone.runtime.batch import BatchBudget, MediaRows, TextRow
from systemone.runtime.d3.code_logits import CodeLogits, code_logits, row_feeds, text_positions
from systemone.runtime.devices import ProviderUnavailable, pick_providers
from systemone.runtime.session import GEMM_OPTIONS, GraphSession, reduce_products_in_fp32, resolve_providers
from systemone.runtime.text_runner import TextRunner


def test_cpu_is_always_available():
    assert resolve_providers("cpu") == ["CPUExecutionProvider"]


@pytest.mark.parametrize("device, needs, extra", [
    ("cuda", "CUDAExecutionProvider", "gpu"),
    ("rocm", "ROCMExecutionProvider or MIGraphXExecutionProvider", "rocm")])
def test_an_absent_provider_is_an_error(device, needs, extra):
    with pytest.raises(ProviderUnavailable, match=rf"device '{device}' needs {needs}, .*"
                                                  rf"install systemone-onnx\[{extra}\]"):
        pick_providers(device, ["CPUExecutionProvider"])


def test_this_onnxruntime_is_asked(monkeypatch):
    # The same rule on the installed onnxruntime's own list (a GPU machine has CUDAExecutionProvider).
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    with pytest.raises(ProviderUnavailable, match="device 'cuda' needs CUDAExecutionProvider"):
        resolve_providers("cuda")


@pytest.mark.parametrize("available, picked", [
    (["ROCMExecutionProvider", "CPUExecutionProvider"], "ROCMExecutionProvider"),  # onnxruntime-rocm <= 1.22
    (["MIGraphXExecutionProvider", "CPUExecutionProvider"], "MIGraphXExecutionProvider"),  # onnxruntime-migraphx
    (["MIGraphXExecutionProvider", "ROCMExecutionProvider", "CPUExecutionProvider"], "ROCMExecutionProvider")])
def test_rocm_takes_whichever_amd_provider_is_installed(available, picked):
    assert pick_providers("rocm", available) == [picked, "CPUExecutionProvider"]
    assert pick_providers("auto", available) == [picked, "CPUExecutionProvider"]


def test_auto_picks_an_accelerator_first():
    assert pick_providers("auto", ["CUDAExecutionProvider", "CPUExecutionProvider"]) == \
        ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert pick_providers("auto", ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]


def test_unknown_device_is_named():
    with pytest.raises(ProviderUnavailable, match="device must be one of auto, cuda, rocm, cpu; got 'tpu'"):
        pick_providers("tpu", ["CPUExecutionProvider"])


def test_cuda_sessions_reduce_half_products_in_fp32_unless_the_user_says_otherwise():
    environ: dict[str, str] = {}
    reduce_products_in_fp32(environ)
    assert environ == {GEMM_OPTIONS: "2"}
    environ = {GEMM_OPTIONS: "0"}
    reduce_products_in_fp32(environ)
    assert environ == {GEMM_OPTIONS: "0"}


def test_a_cuda_session_sets_the_reduction_before_onnxruntime_opens_it(monkeypatch, tmp_path):
    # onnxruntime reads the variable at its first fp16 product: it must be set before the session exists.
    import systemone.runtime.session as session

    seen = []
    monkeypatch.delenv(GEMM_OPTIONS, raising=False)
    monkeypatch.setattr(session, "resolve_providers", lambda device: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(ort, "preload_dlls", lambda: None, raising=False)

    def opened(*args, **kwargs):
        seen.append(session.os.environ.get(GEMM_OPTIONS))
        raise RuntimeError("no CUDA here")

    monkeypatch.setattr(GraphSession, "_open", staticmethod(opened))
    with pytest.raises(RuntimeError, match="no CUDA here"):
        GraphSession(tmp_path / "text.onnx", "cuda")
    assert seen == ["2"]


def test_pad_batch_right_pads_with_mask_and_positions():
    feeds = row_feeds([TextRow([5, 6, 7], text_positions(3)), TextRow([8], text_positions(1))], 0)
    assert feeds["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert feeds["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert feeds["position_ids"].shape == (3, 2, 3)
    assert feeds["position_ids"][:, 0].tolist() == [[0, 1, 2]] * 3


def test_batches_respect_the_token_budget():
    groups = BatchBudget(max_batch_tokens=100).plan([10, 60, 30, 50, 5])
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 3, 4]
    lengths = [10, 60, 30, 50, 5]
    for group in groups:
        assert len(group) == 1 or max(lengths[i] for i in group) * len(group) <= 100


def test_runner_returns_rows_in_prompt_order():
    class Echo:
        def capture_shape(self, batch, length):
            return None  # no CUDA graphs

        def run(self, feeds, run_options=None, fetch=None):
            return [np.stack([feeds["input_ids"][:, 0], feeds["attention_mask"].sum(1)], axis=1).astype(np.float32)]

    runner = TextRunner(Echo(), BatchBudget(max_batch_tokens=8), CodeLogits(hidden=0), layout=None)
    out = code_logits(runner.run_rows([TextRow(ids) for ids in ([1, 1], [2], [3, 3, 3, 3, 3], [4, 4])]))
    assert out.tolist() == [[1, 2], [2, 1], [3, 5], [4, 2]]


def test_serving_never_imports_torch_or_transformers(d3_artifact, tmp_path):
    """Issue 2: the runtime and server answer a request without torch or transformers."""
    request = tmp_path / "req.json"
    request.write_text(json.dumps({"state": "x", "questions": {"q": {"type": "noul"}}}))
    code = (
        "import sys, json\n"
        "from systemone.cli import main\n"
        "import systemone.server.app\n"
        f"rc = main(['ask', {str(d3_artifact)!r}, '--request', {str(request)!r}, '--device', 'cpu'])\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "sys.exit(rc)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["answers"]["q"]["type"] == "noul"


def test_attention_memory_bounds_the_prompt_length(d3_artifact):
    """The graph materialises O(L^2) attention scores: the service derives its longest prompt from the attention
    budget, so a long prompt gets the spec's 400 (spec 4.12), never an out-of-memory failure."""
    from systemone.models.errors import DecisionError
    from systemone.runtime.artifact import Artifact
    from systemone.runtime.batch import attention_bytes
    from systemone.runtime.engine import EngineOptions
    from systemone.runtime.service import DecisionService

    heads = 4  # the tiny checkpoint's attention heads
    budget = attention_bytes(3, 120, 0, heads)
    service = DecisionService(Artifact.load(d3_artifact), EngineOptions(device="cpu", attention_budget=budget))
    assert service.max_model_len == int(3**0.5 * 120)
    assert service.engine.runner.budget.plan([120, 120, 120, 120]) == [[0, 1, 2], [3]]
    assert service.decide({"state": "short", "questions": {"q": {"type": "noul"}}})["usage"]["input_tokens"] < 120
    with pytest.raises(DecisionError, match=r"more than max_model_len=207; nothing is truncated"):
        service.decide({"state": "word " * 300, "questions": {"q": {"type": "noul"}}})


def test_render_shows_the_prompt_text_and_token_ids(d3_artifact, d3_service, tmp_path, capsys):
    """`systemone render`: a user sees exactly what the model reads, per question."""
    from systemone.cli import main

    body = {"state": {"a": 1}, "questions": {"q1": {"type": "noul"}, "q2": {"type": "score", "criteria": ["a", "b"]}}}
    request = tmp_path / "req.json"
    request.write_text(json.dumps(body))
    assert main(["render", str(d3_artifact), "--request", str(request), "--device", "cpu", "--format", "json"]) == 0
    shown = json.loads(capsys.readouterr().out)["questions"]
    expected = d3_service.render(body)
    assert [q["id"] for q in shown] == ["q1", "q2"]
    assert [(q["text"], q["token_ids"], q["tokens"]) for q in shown] == [
        (p.text, p.token_ids, len(p.token_ids)) for p in expected]


def test_ask_prints_the_error_body_and_fails_on_a_bad_request(d3_artifact, tmp_path, capsys):
    from systemone.cli import main

    request = tmp_path / "bad.json"
    request.write_text(json.dumps({"state": 1, "questions": {}}))
    assert main(["ask", str(d3_artifact), "--request", str(request), "--device", "cpu"]) == 1
    assert json.loads(capsys.readouterr().out)["error"]["message"] == "questions: needs at least one question"


def test_ask_prints_the_message_the_server_would_send(d3_artifact, tmp_path, capsys):
    """Sanitized as over HTTP (spec 1.4): Pillow's message names the buffer by a memory address, which is dropped."""
    from systemone.cli import main

    request = tmp_path / "bad.json"
    request.write_text(json.dumps({"state": 1, "questions": {"q": {"type": "noul", }},
                                   "images": ["data:image/png;base64,aGVsbG8="]}))
    assert main(["ask", str(d3_artifact), "--request", str(request), "--device", "cpu"]) == 1
    assert json.loads(capsys.readouterr().out)["error"]["message"] == (
        "media: images[0]: Failed to load image: cannot identify image file <_io.BytesIO object>")


def test_each_row_carries_its_own_media_rows():
    """Rows of different requests share a batch: each row's vision rows land at its own positions (flat index
    row * width + position), and a text-only row gets none."""
    a = MediaRows(np.full((2, 3), 1.0, np.float32), np.array([1, 2]))
    b = MediaRows(np.full((1, 3), 2.0, np.float32), np.array([0]))
    feeds = row_feeds([TextRow([1] * 4, text_positions(4), a), TextRow([2] * 2), TextRow([3] * 3, None, b)], 3)
    assert feeds["media_index"].tolist() == [1, 2, 2 * 4 + 0]
    assert feeds["media_embeds"][:, 0].tolist() == [1.0, 1.0, 2.0]
    none = row_feeds([TextRow([1])], 3)
    assert none["media_embeds"].shape == (0, 3) and none["media_index"].shape == (0,)
