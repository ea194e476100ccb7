"""The checkpoint's own runtime at its best, as `systemone bench` and the reference server run it: the family's
transformers model loaded with transformers' default attention (not the export reference's forced `eager`), the
Gated DeltaNet and short-convolution kernels of flash-linear-attention and causal-conv1d where they import
(transformers picks them itself when its modeling module is first imported), and a record of what actually ran.

Needs the export extra (torch, transformers).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable

# The distributions whose versions decide what the torch side runs (fla-core holds flash-linear-attention's kernels).
DISTRIBUTIONS = ("torch", "transformers", "triton", "flash-linear-attention", "fla-core", "causal-conv1d", "kernels")
# Import name -> what it provides, for the importability record.
KERNEL_PACKAGES = {"fla": "Gated DeltaNet (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)",
                   "causal_conv1d": "short convolution (causal_conv1d_fn, causal_conv1d_update)"}


def load_model(model_class: type, checkpoint: Path, dtype: str, device: str) -> Any:
    """The family's own model class (the export reference's), fresh from `checkpoint` in `dtype` on `device`, with
    transformers' default attention implementation."""
    import torch

    model = model_class.from_pretrained(checkpoint, dtype=getattr(torch, dtype))
    return model.to(device).eval()


def distribution_versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in DISTRIBUTIONS:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def importable(package: str) -> dict[str, Any]:
    """Whether `package` imports here, and why not."""
    try:
        importlib.import_module(package)
    except Exception as exc:  # an ImportError, or a kernel package that fails on this machine's torch or Triton
        return {"importable": False, "why_not": f"{type(exc).__name__}: {exc}"[:300]}
    return {"importable": True}


def attention_implementations(model: Any) -> dict[str, str | None]:
    """The attention implementation of the model's config and of each sub-config (text, vision) that has one."""
    config = model.config
    found = {"model": getattr(config, "_attn_implementation", None)}
    for name in ("text_config", "vision_config"):
        sub = getattr(config, name, None)
        if sub is not None:
            found[name] = getattr(sub, "_attn_implementation", None)
    return found


def chosen_implementation(function: Callable[..., Any]) -> Callable[..., Any] | None:
    """What a transformers function decorated with `use_kernel_func_from_hub_with_fallback` calls: the kernel
    package's function it resolved at import, or its own torch body (`__wrapped__`). None for other functions."""
    wrapped = getattr(function, "__wrapped__", None)
    if wrapped is None or not getattr(function, "__closure__", None):
        return None
    return inspect.getclosurevars(function).nonlocals.get("implementation")


def kernel_choices(model: Any) -> dict[str, dict[str, Any]]:
    """Every kernel-or-fallback function of the model's modeling modules: the implementation transformers chose,
    read from the loaded modules (not from what is installed)."""
    modules = sorted({type(m).__module__ for m in model.modules() if type(m).__module__.startswith("transformers.")})
    choices: dict[str, dict[str, Any]] = {}
    for name in modules:
        for attribute, value in vars(sys.modules[name]).items():
            implementation = chosen_implementation(value) if callable(value) else None
            if implementation is None:
                continue
            fallback = implementation is value.__wrapped__
            choices[attribute] = {"implementation": f"{implementation.__module__}.{implementation.__qualname__}",
                                  "torch_fallback": fallback}
    return choices


def describe(model: Any) -> dict[str, Any]:
    """Versions, the attention implementation, the kernel packages' importability and the kernels transformers
    chose for `model`."""
    described: dict[str, Any] = {"versions": distribution_versions(),
                                 "attention_implementation": attention_implementations(model),
                                 "kernel_packages": {package: {"provides": provides, **importable(package)}
                                                     for package, provides in KERNEL_PACKAGES.items()},
                                 "kernels": kernel_choices(model)}
    try:
        from transformers.utils import import_utils

        described["transformers_sees"] = {
            check: bool(getattr(import_utils, check)())
            for check in ("is_flash_linear_attention_available", "is_causal_conv1d_available")
            if hasattr(import_utils, check)}
    except ImportError:
        pass
    return described


def summary(described: dict[str, Any]) -> str:
    """One line of `describe`'s record."""
    versions = ", ".join(f"{k} {v}" for k, v in described["versions"].items() if v)
    kernels = ", ".join(f"{name} -> {'torch fallback' if c['torch_fallback'] else c['implementation']}"
                        for name, c in described["kernels"].items())
    attention = ", ".join(f"{k} {v}" for k, v in described["attention_implementation"].items())
    return f"{versions}; attention: {attention}; kernels: {kernels or 'none declared'}"


def profile_ops(run: Callable[[], Any], cuda: bool, top: int = 15) -> list[dict[str, Any]] | dict[str, str]:
    """The ops and kernels one call of `run` launched, by their own time (device time on CUDA), most first: which
    kernels ran, as the profiler saw them. An error record where the profiler is not usable here."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        with profile(activities=activities) as prof:
            run()
            if cuda:
                torch.cuda.synchronize()
        events = prof.key_averages()
    except Exception as exc:  # CUPTI missing or refused: the record says so rather than the bench failing
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}

    def own_us(event: Any) -> float:
        if cuda:
            return float(getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0)))
        return float(event.self_cpu_time_total)

    ranked = sorted((e for e in events if own_us(e) > 0), key=own_us, reverse=True)[:top]
    return [{"name": e.key[:160], "ms": own_us(e) / 1000.0, "calls": int(e.count)} for e in ranked]
