"""How this copy of systemone was installed, so that a hint to install more names a command that works here: in a
source checkout (an editable install, or the checkout on the path) `pip install -e '.[EXTRA]'` from its root,
from a package `pip install 'systemone-onnx[EXTRA]'`."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE = "systemone-onnx"
# The modules each extra brings that a command imports: a missing one names its extra (pyproject.toml).
EXPORT_MODULES = frozenset({"torch", "transformers", "safetensors", "onnx", "onnxscript"})
ONNXRUNTIME = "onnxruntime"


def source_checkout() -> Path | None:
    """The checkout this package runs from, or None when it was installed from a package."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() and (root / "scripts" / "env.sh").is_file() else None


def pip_install(extras: str) -> str:
    """The command that adds `extras` (e.g. "export,cpu") to this install."""
    root = source_checkout()
    if root is None:
        return f"pip install '{PACKAGE}[{extras}]'"
    where = "." if Path.cwd().resolve() == root else os.path.relpath(root)
    return f"pip install -e '{where}[{extras}]'"


def no_onnxruntime() -> str:
    """What to do when no onnxruntime flavour imports."""
    return ("onnxruntime is not installed: install exactly one flavour, " + pip_install("cpu") + " (CPU), "
            + pip_install("gpu") + " (NVIDIA, CUDA) or " + pip_install("rocm") + " (AMD)")


def require_export_extra() -> None:
    """Import what `systemone export` needs before it starts, so that a missing extra is its first and only line
    (ModuleNotFoundError names the module; the CLI turns it into a hint)."""
    import importlib

    for module in sorted(EXPORT_MODULES):
        importlib.import_module(module)


def missing_module_hint(module: str | None, command: str) -> str | None:
    """One line saying which extra `systemone COMMAND` needs when `module` is missing; None for a module no extra
    brings."""
    top = (module or "").split(".")[0]
    if top == ONNXRUNTIME:
        return no_onnxruntime()
    if top in EXPORT_MODULES:
        return (f"`systemone {command}` needs the [export] extra ({top} is not installed): "
                + pip_install("export,cpu") + (" (in this checkout, `bash scripts/env.sh` installs it into .venv)"
                                              if source_checkout() is not None else ""))
    return None
