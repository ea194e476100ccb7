"""Devices, the onnxruntime execution providers that run them, and the install extra each needs.

No onnxruntime import here: the CLI names devices, and says which extra to install (systemone/install.py), on an
install without one."""

from __future__ import annotations

from collections.abc import Sequence

CPU = "CPUExecutionProvider"
# Each device's providers, preferred first. AMD: the ROCm provider ends with onnxruntime-rocm 1.22; newer AMD builds
# (onnxruntime-migraphx) ship the MIGraphX provider instead, so `rocm` takes whichever is installed.
PROVIDERS: dict[str, tuple[str, ...]] = {
    "cuda": ("CUDAExecutionProvider",),
    "rocm": ("ROCMExecutionProvider", "MIGraphXExecutionProvider"),
    "cpu": (CPU,),
}
DEVICES = ("auto", *PROVIDERS)
# The pip extra that installs each device's onnxruntime flavour (pyproject.toml); one flavour per environment, since
# they all install the same `onnxruntime` module.
EXTRAS = {"cuda": "gpu", "rocm": "rocm", "cpu": "cpu"}


class ProviderUnavailable(RuntimeError):
    pass


def pick_providers(device: str, available: Sequence[str]) -> list[str]:
    """The providers for `device` among `available`. Asking for one that is absent is an error, never a silent
    fallback; `auto` takes an accelerator when there is one, else the CPU."""
    if device == "auto":
        for name in ("cuda", "rocm"):
            found = [p for p in PROVIDERS[name] if p in available]
            if found:
                return [found[0], CPU]
        return [CPU]
    if device not in PROVIDERS:
        raise ProviderUnavailable(f"device must be one of {', '.join(DEVICES)}; got {device!r}")
    found = [p for p in PROVIDERS[device] if p in available]
    if not found:
        raise ProviderUnavailable(
            f"device {device!r} needs {' or '.join(PROVIDERS[device])}, which this onnxruntime does not have "
            f"(available: {', '.join(available)}; install systemone-onnx[{EXTRAS[device]}] in place of the current "
            "flavour)")
    return [found[0]] if device == "cpu" else [found[0], CPU]


def device_of(provider: str) -> str:
    """The device name (cuda, rocm, cpu) a provider runs."""
    for device, providers in PROVIDERS.items():
        if provider in providers:
            return device
    raise ProviderUnavailable(f"no device runs provider {provider!r}")
