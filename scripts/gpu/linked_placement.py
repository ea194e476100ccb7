"""Where a linked artifact's weights live once its CUDA form is open: the GPU memory and host memory a session
takes with its linked weights put on the GPU as they are made (`runtime/session.py`, LINKED_ON_DEVICE) and with
them kept in host memory. If onnxruntime copies a device value rather than using it in place, the first takes the
weights twice on the GPU. Each way in its own process; prints one JSON line a way.

    python3 scripts/gpu/linked_placement.py ARTIFACT FORM
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys


def measure(artifact: str, form: str, on_device: bool) -> dict:
    import time

    import onnxruntime as ort

    from systemone.runtime import session as session_module
    from systemone.runtime.artifact import Artifact

    session_module.LINKED_ON_DEVICE = on_device
    path = Artifact.load(artifact).with_form(form, "cuda").graph_path("text")
    used = lambda: int(subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                      capture_output=True, text=True).stdout.split()[0])
    before, began = used(), time.monotonic()
    graph = session_module.GraphSession(path, "cuda")
    return {"linked_on_device": on_device, "open_s": round(time.monotonic() - began, 1),
            "gpu_mib": used() - before, "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2),
            "linked": len(graph.linked_weights), "onnxruntime": ort.__version__}


if __name__ == "__main__":
    if len(sys.argv) == 4:
        print(json.dumps(measure(sys.argv[1], sys.argv[2], sys.argv[3] == "device")))
    else:
        for way in ("device", "host"):
            subprocess.run([sys.executable, __file__, sys.argv[1], sys.argv[2], way], check=False)
