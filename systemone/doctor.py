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

from .install import no_onnxruntime, pip_install
from .runtime.devices import EXTRAS, ProviderUnavailable, device_of, pick_providers

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


@dataclass(frozen=True)
class Findings:
    """The doctor's lines, and whether `serve` would fail as things stand (the command's exit status)."""

    lines: list[str]
    serve_fails: bool = False


def serve_choice(artifact: str | Path, device: str, providers: Sequence[str]) -> Findings:
    """What `serve ARTIFACT --device DEVICE` would run: the artifact's graphs and forms, the provider and the form
    it would take; or why it would fail."""
    from .runtime.artifact import PORTABLE, ArtifactError, Manifest

    try:
        manifest = Manifest.read(Path(artifact))
    except (ArtifactError, OSError, ValueError) as exc:
        return Findings([f"artifact: {exc}"], serve_fails=True)
    graphs = ", ".join(f"{g.file} ({g.dtype})" for g in manifest.graphs.values())
    lines = [f"artifact: {artifact} (family {manifest.family}, source {manifest.source})", f"graphs: {graphs}"]
    try:
        chosen = pick_providers(device, providers)[0]
    except ProviderUnavailable as exc:
        return Findings([*lines, f"serve --device {device} would fail: {exc}"], serve_fails=True)
    on = device_of(chosen)
    written = {name: form for name, form in manifest.forms.items() if form.refused is None}
    form = next((name for name, entry in written.items() if on in entry.providers), PORTABLE)
    lines.append(f"serve --device {device} would use: {chosen}, the {form} form")
    forms = [f"{PORTABLE} (float32, any device)"]
    for name, entry in manifest.forms.items():
        if entry.refused is not None:
            forms.append(f"{name} (refused at export: {entry.refused})")
        else:
            precision = ", ".join(f"{g} {p}" for g, p in entry.precisions.items()) or entry.dtype
            forms.append(f"{name} (for {', '.join(entry.providers)}: {precision}; gate: "
                         f"{entry.gate.get('summary', '-')})")
    lines.append(f"forms: {'; '.join(forms)}")
    return Findings(lines)


def report(runtime: Runtime | None, gpus: list[str], libraries: dict[str, bool], artifact: str | None = None,
           device: str = "auto") -> Findings:
    """The doctor's findings, from what was probed."""
    if runtime is None:
        return Findings([f"onnxruntime: {no_onnxruntime()}", f"gpu: {'; '.join(gpus) or 'none'}"], serve_fails=True)
    # The version once; a flavour's own version only where several are installed (and may differ).
    flavours = (", ".join(runtime.flavours) if len(runtime.flavours) > 1
                else " ".join(runtime.flavours).split(" ")[0] or "unknown distribution")
    lines = [f"onnxruntime: {runtime.version} ({flavours})"]
    if len(runtime.flavours) > 1:
        lines.append("warning: several onnxruntime flavours share one `onnxruntime` module; keep one "
                     f"(pip uninstall the others, then {pip_install('|'.join(EXTRAS.values()))})")
    lines.append(f"providers: {', '.join(runtime.providers)}")
    lines.append(f"gpu: {'; '.join(gpus) or 'none'}")
    if runtime.cuda_version:
        lines.append(f"cuda build: {runtime.cuda_version}")
    if libraries:
        missing = [name for name, found in libraries.items() if not found]
        lines.append(f"cuda libraries: {', '.join(f'{n} ' + ('found' if f else 'MISSING') for n, f in libraries.items())}")
        if missing:
            lines.append(f"the CUDA provider will not start: {pip_install('gpu')} (it brings NVIDIA's CUDA and "
                         "cuDNN wheels) or install the system CUDA and cuDNN 9 matching the cuda build above")
    else:
        lines.append("cuda libraries: not used (this onnxruntime has no CUDA provider)")
    cuda_fails = any(not found for found in libraries.values()) and device in ("auto", "cuda")
    if artifact is None:
        return Findings(lines, serve_fails=cuda_fails)
    choice = serve_choice(artifact, device, runtime.providers)
    return Findings(lines + choice.lines, serve_fails=cuda_fails or choice.serve_fails)


def batch_rows(artifact: str, device: str, cache_dir: Path) -> Findings:
    """Load the artifact as `serve --device DEVICE` would, and say the rows a call it would choose (kept for this
    machine, else measured now and kept); a load that fails is what serve would meet."""
    from .batch_rows import kept_batch_sizing
    from .runtime.artifact import Artifact
    from .runtime.engine import EngineOptions
    from .runtime.service import DecisionService

    try:
        service = DecisionService(Artifact.load(artifact), EngineOptions(device=device))
        try:
            sizing, path, measured = kept_batch_sizing(service, cache_dir)
        finally:
            service.close()
    except Exception as exc:  # whatever stops the load stops serve too
        return Findings([f"serve --device {device} would fail: {' '.join(str(exc).split()) or type(exc).__name__}"],
                        serve_fails=True)
    kept = f"measured now, kept in {path}" if measured else f"kept from an earlier start: {path}"
    return Findings([f"batch rows: {sizing.describe()}; {kept}"])


def run_doctor(artifact: str | None, device: str, cache_dir: Path) -> Findings:
    runtime = read_runtime()
    libraries = cuda_libraries(runtime) if runtime is not None else {}
    findings = report(runtime, query_gpus(), libraries, artifact, device)
    if artifact is None or findings.serve_fails:
        return findings
    rows = batch_rows(artifact, device, cache_dir)
    return Findings(findings.lines + rows.lines, rows.serve_fails)
