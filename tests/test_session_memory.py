"""A session's memory does not grow with the shapes it has seen, and serving meets a new (rows, length, past) every
few requests. Each probe runs in a subprocess and reads the bytes glibc's malloc has handed out and not had back
(mallinfo2: in use in every arena, and mapped on their own) around 900 runs of distinct shapes, after runs of the
largest shape. Not the RSS: freed heap memory stays resident and is reused, so RSS moved from -5 to +14 MB between
processes with nothing kept, and hid 14 MB that a control kept in small blocks. The control is a session that keeps
16 KiB for every shape it meets, as a per-shape plan cache would: the probe must see that."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import ctypes, gc, sys
from systemone.runtime.artifact import Artifact
from systemone.runtime.engine import EngineOptions
from systemone.runtime.service import DecisionService

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MallInfo2


def in_use_mb():
    info = mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20


engine = DecisionService(Artifact.load(sys.argv[1]), EngineOptions(device="cpu", threads=1)).engine
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
before = in_use_mb()
for rows in (1, 2, 3):
    for length in range(40, 340):
        engine.run_rows([engine.probe_row(length)] * rows)
gc.collect()
print(in_use_mb() - before)
"""


def growth_mb(artifact, sessions: str) -> float:
    done = subprocess.run([sys.executable, "-c", PROBE, str(artifact), sessions], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return float(done.stdout.strip().splitlines()[-1])


def test_900_new_shapes_leave_no_memory_behind(d1_artifact):
    served = growth_mb(d1_artifact, "served")
    kept = growth_mb(d1_artifact, "keeps-per-shape")
    # Tiny d1 on one thread: 0.12 MB served, 14.23 MB with the control (0.11 and 14.23 on two).
    assert served < 2, served
    assert kept > served + 10, (served, kept)  # the probe sees 14 MB kept 16 KiB at a time
