"""What `pip install` gives is what is tested: the wheel built from this checkout, installed with the [cpu] extra into
a fresh virtual environment (no torch, no checkout on its path), imports every registered family and answers the
sample request against an artifact. Its dependencies come from pip's configured package index (the test
environment's own install, by uv, fills only uv's cache)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from systemone.local_server import free_port, start_server

ROOT = Path(__file__).resolve().parent.parent
REQUEST = ROOT / "scripts" / "demo_request.json"
# What a source distribution of the checkout holds: what the wheel is built from (not .venv, caches, results).
LEFT_OUT = shutil.ignore_patterns(".git", ".venv", ".cache", "build", "*.egg-info", "__pycache__", ".pytest_cache",
                                  "results", "artifacts", "checkpoints")


def run(command: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": "", "SYSTEMONE_CACHE_DIR": str(cwd / "cache")})
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def test_the_wheel_installed_with_the_cpu_extra_serves_the_sample_request(d3_artifact, tmp_path):
    started = time.monotonic()
    source = Path(shutil.copytree(ROOT, tmp_path / "source", symlinks=True, ignore=LEFT_OUT))
    # The test environment's setuptools builds it where it has one (no download of a build environment).
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-w", str(tmp_path / "dist"), str(source)],
        cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("systemone_onnx-*.whl")
    # This pip installs into the bare environment (no pip of its own to set up: 6 s), and leaves the byte-code to
    # the first import (8 s of compiling every dependency).
    run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], cwd=tmp_path)
    python = tmp_path / "venv" / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-compile",
         f"systemone-onnx[cpu] @ {wheel.as_uri()}"], cwd=tmp_path)
    installed = time.monotonic()

    families = run([str(python), "-c", """
import importlib, importlib.util, json, sys
from systemone.models.registry import FAMILIES
found = {}
for entry in FAMILIES:
    entry.load_engine()  # the runtime engine imports with no torch
    module, _, name = entry.export_config.partition(":")
    found[entry.name] = importlib.util.find_spec(module) is not None  # the exporter ships, torch or not
print(json.dumps({"families": found, "torch": importlib.util.find_spec("torch") is not None,
                  "package": importlib.import_module("systemone").__file__}))
"""], cwd=tmp_path)
    shipped = json.loads(families.stdout)
    assert shipped["families"] == {"d3": True, "d1": True} and shipped["torch"] is False
    assert shipped["package"].startswith(str(tmp_path / "venv"))

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = start_server([str(tmp_path / "venv" / "bin" / "systemone"), "serve", str(d3_artifact), "--device",
                           "cpu", "--port", str(port), "--max-batch-rows", "8"], base, within_s=120, cwd=tmp_path,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "PYTHONPATH": "", "SYSTEMONE_CACHE_DIR": str(tmp_path / "cache")})
    try:
        done = subprocess.run(["curl", "-s", "-f", f"{base}/v1/systemone", "-H", "Content-Type: application/json",
                               "-d", f"@{REQUEST}"], capture_output=True, text=True, timeout=120)
        docs = subprocess.run(["curl", "-s", "-f", "-o", "/dev/null", f"{base}/docs-assets/swagger-ui-bundle.js"],
                              timeout=60)
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["model"] == "d3-tiny" and list(answer["answers"]) == ["urgent", "team", "anger"]
    assert docs.returncode == 0  # the /docs assets are in what the wheel installs
    print(f"wheel built and installed with [cpu] in {installed - started:.0f} s; "
          f"whole check {time.monotonic() - started:.0f} s")
