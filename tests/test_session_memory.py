"""A session's memory does not grow with the shapes it has seen, and serving meets a new (rows, length, past) every
few requests. Each probe runs in a subprocess and reads its own RSS around 900 runs of distinct shapes. The control
is onnxruntime's CPU arena, which keeps what the largest shape grew it to: the probe must see that."""

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

if sys.argv[2] == "cpu-arena":  # the sessions with onnxruntime's default CPU arena
    opened = ort.InferenceSession

    def with_arena(path, sess_options, **kwargs):
        sess_options.enable_cpu_mem_arena = True
        return opened(path, sess_options=sess_options, **kwargs)
    ort.InferenceSession = with_arena
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
    kept = growth_mb(d1_artifact, "cpu-arena")
    # Tiny d1 on two cores: 0.8 MB served; 12.9 MB with the CPU arena on, every run.
    assert served < 8, served
    assert kept > 3 * served + 5, (served, kept)  # the probe sees memory a session keeps
