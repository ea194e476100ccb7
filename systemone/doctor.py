"""`systemone doctor`: what this machine can run. The onnxruntime flavour and its providers, the GPUs, the CUDA and
cuDNN libraries the CUDA provider loads, and for an artifact, which graphs and provider `serve` would use.

Every probe of the machine is a parameter (the provider list, the GPU query, the library loader), so the report's
rules are tested without a GPU. It sits beside the CLI: it reads runtime/ but serves nothing."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .runtime.devices import EXTRAS, NO_ONNXRUNTIME, ProviderUnavailable, pick_providers

FLAVOURS = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-rocm", "onnxruntime-migraphx")
# What the CUDA provider of an onnxruntime built for CUDA MAJOR loads (cuDNN 9 is the only one it takes).
CUDA_LIBRARIES = ("libcudart.so.{major}", "libcublas.so.{major}", "libcublasLt.so.{major}", "libcurand.so.10",
                  "libcudnn.so.9")


@dataclass(frozen=True)
class Runtime:
    """The installed onnxruntime: which distributions (flavours), its version, providers and CUDA build."""

    flavours: tuple[str, ...]
    version: str
    providers: tuple[str, ...]
    cuda_version: str | None


def installed_flavours() -> tuple[str, ...]:
    found = []
    for name in FLAVOURS:
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            pass
    return tuple(found)


def read_runtime() -> Runtime | None:
    """None when no onnxruntime imports."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    try:
        from onnxruntime.capi import build_and_package_info as build
        cuda = getattr(build, "cuda_version", None)
    except ImportError:
        cuda = None
    return Runtime(installed_flavours(), ort.__version__, tuple(ort.get_available_providers()), cuda or None)


def query_gpus(which: Callable[[str], str | None] = shutil.which) -> list[str]:
    """`name, memory` per NVIDIA GPU from nvidia-smi; none when there is no nvidia-smi or it fails."""
    smi = which("nvidia-smi")
    if smi is None:
        return []
    try:
        done = subprocess.run([smi, "--query-gpu=name,memory.total", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []


def load_library(name: str) -> bool:
    try:
        ctypes.CDLL(name)
        return True
    except OSError:
        return False


def cuda_libraries(runtime: Runtime, load: Callable[[str], bool] = load_library) -> dict[str, bool]:
    """Each library the CUDA provider needs: found or not. NVIDIA's pip wheels are loaded first, as the server
    does (onnxruntime.preload_dlls), so a [gpu] install counts as found without a system CUDA."""
    if "CUDAExecutionProvider" not in runtime.providers or runtime.cuda_version is None:
        return {}
    try:
        import onnxruntime as ort
        if hasattr(ort, "preload_dlls"):
            ort.preload_dlls()
    except Exception:  # a failed preload is what the per-library lines below report
        pass
    major = runtime.cuda_version.split(".")[0]
    return {name.format(major=major): load(name.format(major=major)) for name in CUDA_LIBRARIES}


def serve_choice(artifact: str | Path, device: str, providers: Sequence[str]) -> list[str]:
    """The lines saying what `serve ARTIFACT --device DEVICE` would run: its graphs and the provider."""
    from .runtime.artifact import ArtifactError, Manifest

    try:
        manifest = Manifest.read(Path(artifact))
    except ArtifactError as exc:
        return [f"artifact: {exc}"]
    graphs = ", ".join(f"{g.file} ({g.dtype})" for g in manifest.graphs.values())
    lines = [f"artifact: {artifact} (family {manifest.family}, source {manifest.source})", f"graphs: {graphs}"]
    try:
        chosen = pick_providers(device, providers)[0]
        lines.append(f"serve --device {device} would use: {chosen}")
    except ProviderUnavailable as exc:
        lines.append(f"serve --device {device} would fail: {exc}")
    return lines


def report(runtime: Runtime | None, gpus: list[str], libraries: dict[str, bool], artifact: str | None = None,
           device: str = "auto") -> list[str]:
    """The doctor's lines, from what was probed."""
    if runtime is None:
        return [f"onnxruntime: {NO_ONNXRUNTIME}", f"gpu: {'; '.join(gpus) or 'none'}"]
    flavours = ", ".join(runtime.flavours) or "unknown distribution"
    lines = [f"onnxruntime: {runtime.version} ({flavours})"]
    if len(runtime.flavours) > 1:
        lines.append("warning: several onnxruntime flavours share one `onnxruntime` module; keep one "
                     f"(pip uninstall the others, then reinstall systemone-onnx[{'|'.join(EXTRAS.values())}])")
    lines.append(f"providers: {', '.join(runtime.providers)}")
    lines.append(f"gpu: {'; '.join(gpus) or 'none'}")
    if runtime.cuda_version:
        lines.append(f"cuda build: {runtime.cuda_version}")
    if libraries:
        missing = [name for name, found in libraries.items() if not found]
        lines.append(f"cuda libraries: {', '.join(f'{n} ' + ('found' if f else 'MISSING') for n, f in libraries.items())}")
        if missing:
            lines.append("the CUDA provider will not start: install systemone-onnx[gpu] (it brings NVIDIA's CUDA "
                         "and cuDNN wheels) or the system CUDA and cuDNN 9 matching the cuda build above")
    else:
        lines.append("cuda libraries: not used (this onnxruntime has no CUDA provider)")
    if artifact is not None:
        lines.extend(serve_choice(artifact, device, runtime.providers))
    return lines


def run_doctor(artifact: str | None, device: str) -> list[str]:
    runtime = read_runtime()
    libraries = cuda_libraries(runtime) if runtime is not None else {}
    return report(runtime, query_gpus(), libraries, artifact, device)
