"""A session's memory does not grow with the shapes it has seen, and serving meets a new (rows, length, past) every
few requests. Each probe runs in a subprocess and reads its own RSS around 900 runs of distinct shapes, after runs of
the largest shape (what a run needs at its largest is not growth). The control is a session that keeps 16 KiB for
every shape it meets, as a per-shape plan cache would: the probe must see that. (onnxruntime's own caches made poor
controls: with its memory patterns on, tiny d1 kept 19 MB over 900 shapes in one process and nothing in the next.)"""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import gc, sys
from systemone.local_server import rss_mb
from systemone.runtime.artifact import Artifact
from systemone.runtime.engine import EngineOptions
from systemone.runtime.service import DecisionService

engine = DecisionService(Artifact.load(sys.argv[1]), EngineOptions(device="cpu")).engine
if sys.argv[2] == "keeps-per-shape":
    kept, run_rows = [], engine.run_rows

    def keeping(rows, *args, **kwargs):
        kept.append(b"k" * 16384)
        return run_rows(rows, *args, **kwargs)
    engine.run_rows = keeping
for _ in range(3):
    engine.run_rows([engine.probe_row(340)] * 3)
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
    kept = growth_mb(d1_artifact, "keeps-per-shape")
    # Tiny d1 on two cores: -4.5 to +0.7 MB served (glibc's heap moves a few MB either way).
    assert served < 8, served
    assert kept > served + 8, (served, kept)  # the probe sees 14 MB kept a few KiB at a time
