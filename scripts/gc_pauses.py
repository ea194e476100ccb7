"""The garbage collector's pauses in the server process under load: the app (server/app.py) on ARTIFACT in a
thread of this process, text-only one-question requests from `systemone bench --serve` in another process (a
closed loop of CLIENTS), and every collection's duration by generation from `gc.callbacks`. Runs alternate (A B B A
...) between the app as it is (what start-up made frozen out of the collector) and the same app with `gc.freeze`
made a no-op (as before the freeze), so the two share the machine's state. Each collection holds the GIL: the engine thread,
the event loop and the media threads all wait for it.

    python scripts/gc_pauses.py ARTIFACT [--device cpu] [--clients 16] [--seconds 20] [--runs 2] [--out F]
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any


def main() -> None:
    sys.path.append(str(Path(__file__).resolve().parents[1]))
    import uvicorn

    from systemone.local_server import free_port
    from systemone.runtime.artifact import Artifact
    from systemone.runtime.engine import EngineOptions
    from systemone.runtime.service import DecisionService
    from systemone.server.app import create_app

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--runs", type=int, default=2, help="runs of each way, alternating")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    service = DecisionService(Artifact.load(args.artifact), EngineOptions(device=args.device))
    freeze, unfreeze = gc.freeze, gc.unfreeze
    report: dict[str, Any] = {"artifact": args.artifact, "device": args.device, "clients": args.clients,
                              "seconds": args.seconds, "runs": []}
    for run in range(2 * args.runs):
        way = ("frozen", "not frozen")[run % 2 ^ (run // 2) % 2]  # A B B A A B ...: neither way always goes first
        gc.freeze, gc.unfreeze = (freeze, unfreeze) if way == "frozen" else (lambda: None, lambda: None)
        pauses: list[tuple[int, float]] = []
        started: dict[int, float] = {}

        def record(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                started[info["generation"]] = time.perf_counter()
            else:
                pauses.append((info["generation"], time.perf_counter() - started[info["generation"]]))

        port = free_port()
        server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        gc.callbacks.append(record)
        out = Path(f"/tmp/gc_pauses_bench_{port}.json")
        subprocess.run([sys.executable, "-m", "systemone.cli", "bench", "--serve",
                        f"http://127.0.0.1:{port}/v1/systemone", "--family", service.artifact.manifest.family,
                        "--kinds", "text1", "--clients", str(args.clients), "--seconds", str(args.seconds),
                        "--out", str(out)], check=True, capture_output=True)
        gc.callbacks.remove(record)
        server.should_exit = True
        thread.join(timeout=60)
        load = next(iter(json.loads(out.read_text())["runs"].values()))
        out.unlink()
        row = {"way": way, "requests_per_s": load["requests_per_s"], "p50_ms": load["p50_ms"],
               "p99_ms": load["p99_ms"], "statuses": load["statuses"],
               "collections": {str(g): {"count": sum(1 for x, _ in pauses if x == g),
                                        "total_ms": 1000 * sum(s for x, s in pauses if x == g),
                                        "longest_ms": 1000 * max((s for x, s in pauses if x == g), default=0.0)}
                               for g in (0, 1, 2)}}
        report["runs"].append(row)
        full = row["collections"]["2"]
        print(f"{way:>10}: {row['requests_per_s']:.1f} requests/s, p50 {row['p50_ms']:.1f} ms, "
              f"p99 {row['p99_ms']:.1f} ms; full collections {full['count']}, {full['total_ms']:.1f} ms in all, "
              f"longest {full['longest_ms']:.1f} ms", flush=True)
    gc.freeze, gc.unfreeze = freeze, unfreeze
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
