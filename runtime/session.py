"""onnxruntime sessions: execution-provider choice and a thin run wrapper (no torch at serve time)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from .devices import CPU, DEVICES, ProviderUnavailable, pick_providers

__all__ = ["DEVICES", "GraphSession", "ProviderUnavailable", "resolve_providers"]
# fp32 graphs stay fp32 on NVIDIA GPUs: no TF32 matmuls, whose 10-bit mantissa would move probabilities.
PROVIDER_OPTIONS = {"CUDAExecutionProvider": {"use_tf32": "0"}}


def resolve_providers(device: str) -> list[str]:
    """The providers for `device` in this onnxruntime (see devices.pick_providers)."""
    return pick_providers(device, ort.get_available_providers())


class GraphSession:
    """One ONNX graph on one device."""

    def __init__(self, path: str | Path, device: str = "auto", threads: int | None = None):
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
            providers=[(name, PROVIDER_OPTIONS[name]) if name in PROVIDER_OPTIONS else name for name in providers])
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
