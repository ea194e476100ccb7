"""Shared fixtures: tiny random d1 and d3 checkpoints in the released on-disk formats, exported once per test run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.build_d1_checkpoint import build_d1_checkpoint
from scripts.build_d3_checkpoint import build_d3_checkpoint
from systemone.export.pipeline import export_checkpoint
from systemone.runtime.artifact import Artifact
from systemone.runtime.engine import EngineOptions
from systemone.runtime.pixel_workers import PixelWorkers
from systemone.runtime.service import DecisionService


# The portable graphs and the CUDA forms' ladder, gated here on the CPU: the tests read both (a CPU export writes the
# portable graphs only unless asked).
EVERY_FORM = ["portable", "cuda-fused-fp16", "cuda-fused-mixed", "cuda-fused", "cuda-fp16", "cuda-mixed",
              "cuda-fp16-matmuls"]


@pytest.fixture(scope="session")
def d3_checkpoint(tmp_path_factory) -> Path:
    return build_d3_checkpoint(tmp_path_factory.mktemp("ckpt") / "d3-tiny", attention_mode="noncausal_full_attention")


@pytest.fixture(scope="session")
def d3_causal_checkpoint(tmp_path_factory) -> Path:
    return build_d3_checkpoint(tmp_path_factory.mktemp("ckpt") / "d3-tiny-causal", attention_mode="causal", seed=1)


@pytest.fixture(scope="session")
def d3_artifact(d3_checkpoint, tmp_path_factory) -> Path:
    return export_checkpoint(str(d3_checkpoint), tmp_path_factory.mktemp("art") / "d3-tiny", forms=EVERY_FORM)


@pytest.fixture(scope="session")
def d3_causal_artifact(d3_causal_checkpoint, tmp_path_factory) -> Path:
    return export_checkpoint(str(d3_causal_checkpoint), tmp_path_factory.mktemp("art") / "d3-tiny-causal",
                             forms=EVERY_FORM)


@pytest.fixture(scope="session")
def d3_service(d3_artifact) -> Iterator[DecisionService]:
    """As `systemone serve` runs it: pixel rows made in a worker process (--media-processes)."""
    service = DecisionService(Artifact.load(d3_artifact), EngineOptions(device="cpu"),
                              served_model_names=["vllm-sr/d3-tiny"], media_processes=1)
    yield service
    service.close()


@pytest.fixture(scope="session")
def pixel_processes() -> Iterator[PixelWorkers]:
    workers = PixelWorkers(processes=2)
    yield workers
    workers.close()


@pytest.fixture(scope="session")
def reference_tokenizer(d3_checkpoint):
    """What vLLM tokenizes with: transformers' AutoTokenizer on the checkpoint (Qwen3_5Tokenizer, spec 4.7)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(d3_checkpoint)


@pytest.fixture(scope="session")
def d1_checkpoint(tmp_path_factory) -> Path:
    return build_d1_checkpoint(tmp_path_factory.mktemp("ckpt") / "d1-tiny")


@pytest.fixture(scope="session")
def d1_artifact(d1_checkpoint, tmp_path_factory) -> Path:
    return export_checkpoint(str(d1_checkpoint), tmp_path_factory.mktemp("art") / "d1-tiny", forms=EVERY_FORM)


@pytest.fixture(scope="session")
def d1_service(d1_artifact) -> DecisionService:
    return DecisionService(Artifact.load(d1_artifact), EngineOptions(device="cpu"),
                           served_model_names=["LiquidAI/d1-tiny"])


@pytest.fixture(scope="session")
def d1_reference_tokenizer(d1_checkpoint):
    """What vLLM renders and tokenizes d1 prompts with: transformers' AutoTokenizer on the checkpoint (spec 3.4)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(d1_checkpoint)


@pytest.fixture(scope="session", autouse=True)
def artifact_cache(tmp_path_factory) -> Iterator[Path]:
    """The cache `serve` exports checkpoints into and keeps its start-up choices in: the run's own, never the
    user's ~/.cache."""
    import os

    from systemone.artifact_cache import CACHE_ENV

    saved = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("systemone-cache"))
    yield Path(os.environ[CACHE_ENV])
    if saved is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = saved
