"""A session's memory does not grow with the shapes it has seen: onnxruntime's memory patterns (one kept per distinct
set of input shapes, for the session's life) are off, and serving meets a new (rows, length, past) every few
requests. Each probe runs in a subprocess and reads its own RSS around 900 runs of distinct shapes."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import gc, sys
import onnxruntime as ort
from systemone.local_server import rss_mb
from systemone.runtime.artifact import Artifact
from systemone.runtime.engine import EngineOptions
from systemone.runtime.service import DecisionService

if sys.argv[2] == "onnxruntime-default":  # the sessions as onnxruntime makes them unless told otherwise
    opened = ort.InferenceSession

    def with_memory_patterns(path, sess_options, **kwargs):
        sess_options.enable_mem_pattern = True
        return opened(path, sess_options=sess_options, **kwargs)
    ort.InferenceSession = with_memory_patterns
engine = DecisionService(Artifact.load(sys.argv[1]), EngineOptions(device="cpu")).engine
for length in range(8, 40):
    engine.run_rows([engine.probe_row(length)])
gc.collect()
before = rss_mb()
for rows in (1, 2, 3):
    for length in range(40, 340):
        engine.run_rows([engine.probe_row(length)] * rows)
gc.collect()
print(rss_mb() - before)
"""


def growth_mb(artifact, sessions: str) -> float:
    done = subprocess.run([sys.executable, "-c", PROBE, str(artifact), sessions], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return float(done.stdout.strip().splitlines()[-1])


def test_900_new_shapes_leave_no_memory_behind(d1_artifact):
    served = growth_mb(d1_artifact, "served")
    default = growth_mb(d1_artifact, "onnxruntime-default")
    # Tiny d1 on two cores: 2.8 MB served against 28.7 MB with onnxruntime's default over 1,200 shapes.
    assert served < 8, served
    assert default > 3 * served + 5, (served, default)  # the probe sees the growth it guards against
