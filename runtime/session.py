"""onnxruntime sessions: execution-provider choice and a thin run wrapper (no torch at serve time)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from .devices import CPU, DEVICES, ProviderUnavailable, device_of, pick_providers

__all__ = ["DEVICES", "GraphSession", "ProviderUnavailable", "resolve_device", "resolve_providers"]
CUDA = "CUDAExecutionProvider"


def resolve_providers(device: str) -> list[str]:
    """The providers for `device` in this onnxruntime (see devices.pick_providers)."""
    return pick_providers(device, ort.get_available_providers())


def resolve_device(device: str) -> str:
    """The device (cuda, rocm, cpu) that `device` ("auto" included) runs on in this onnxruntime."""
    return device_of(resolve_providers(device)[0])


def provider_options(provider: str, gpu_memory: int | None) -> dict[str, str]:
    if provider != CUDA:
        return {}
    # fp32 graphs stay fp32 on NVIDIA GPUs: no TF32 matmuls, whose 10-bit mantissa would move probabilities.
    # The arena grows by what a run asks, not by doubling, and never past --gpu-memory: the default doubling kept
    # what the longest batch once took, and more (44 GB for a 1.9B-parameter model).
    options = {"use_tf32": "0", "arena_extend_strategy": "kSameAsRequested"}
    if gpu_memory:
        options["gpu_mem_limit"] = str(gpu_memory)
    return options


class GraphSession:
    """One ONNX graph on one device."""

    def __init__(self, path: str | Path, device: str = "auto", threads: int | None = None,
                 gpu_memory: int | None = None):
        providers = resolve_providers(device)
        if providers[0] != CPU and hasattr(ort, "preload_dlls"):
            ort.preload_dlls()
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            options.intra_op_num_threads = threads
        # Without the CPU arena a run's memory goes back when it ends: with it, each new prompt length grew the
        # arena, and two long d3 prompts held twice the attention budget.
        options.enable_cpu_mem_arena = False
        self.session = ort.InferenceSession(
            str(path), sess_options=options,
            providers=[(name, provider_options(name, gpu_memory)) for name in providers])
        self.provider = self.session.get_providers()[0]
        if self.provider != providers[0]:
            raise ProviderUnavailable(f"onnxruntime could not start {providers[0]} for {Path(path).name} "
                                      f"(it started {self.provider})")
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.runs = 0

    def run(self, feeds: dict[str, np.ndarray], run_options: ort.RunOptions | None = None) -> list[np.ndarray]:
        """Run the graph; `run_options.terminate = True` from another thread stops a run in flight."""
        self.runs += 1
        return self.session.run(None, feeds, run_options)
