"""Run as `python -m tests.memory_probe ARTIFACT BODY.json LIMIT_MB [ATTENTION_BUDGET]`: load the artifact, read the
body as the server does (server/body.py), prepare the request (media fetched, decoded and preprocessed; prompts
tokenized) and, when it is accepted, answer it; print one JSON line with the outcome, the seconds and the peak RSS
increase over the loaded server's. RSS is sampled every 5 ms and the process ends itself (exit 3) past LIMIT_MB, so
a test of a memory bomb cannot take the machine down. Tests call `probe`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from systemone.local_server import rss_mb


def probe(artifact: str | Path, body: dict, directory: Path, limit_mb: float,
          attention_budget: int | None = None) -> dict:
    """This probe in a subprocess on `body` (written to `directory`, where its local media may lie): its outcome."""
    path = directory / "body.json"
    path.write_text(json.dumps(body))
    command = [sys.executable, "-m", "tests.memory_probe", str(artifact), str(path), str(limit_mb)]
    done = subprocess.run(command + ([str(attention_budget)] if attention_budget else []), capture_output=True,
                          text=True, timeout=300)
    assert done.stdout.strip(), done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(artifact: str, body_path: str, limit_mb: float, attention_budget: int | None = None) -> None:
    from systemone.models.errors import DecisionError, SchemaError
    from systemone.runtime.artifact import Artifact
    from systemone.runtime.engine import EngineOptions
    from systemone.runtime.media_fetch import FetchPolicy
    from systemone.runtime.service import DecisionService
    from systemone.server.body import parse_json
    from systemone.server.errors import http_status

    options = EngineOptions(device="cpu", fetch_policy=FetchPolicy(allowed_local_path=Path(body_path).parent),
                            **({"attention_budget": attention_budget} if attention_budget else {}))
    service = DecisionService(Artifact.load(artifact), options)
    raw = Path(body_path).read_bytes()
    service.decide({"state": "warm", "questions": {"q": {"type": "noul", "instructions": "ok?"}}})
    base = rss_mb()
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], rss_mb())
            if peak[0] - base > limit_mb:
                print(json.dumps({"killed": True, "peak_increase_mb": peak[0] - base}), flush=True)
                os._exit(3)

    threading.Thread(target=sample, daemon=True).start()
    start = time.monotonic()
    try:
        service.decide(parse_json(raw))
        outcome = {"status": 200}
    except DecisionError as exc:
        outcome = {"status": http_status(exc)[0], "message": exc.message}
    except SchemaError as exc:
        outcome = {"status": 422, "message": str(exc)}
    outcome["seconds"] = time.monotonic() - start
    done.set()
    peak[0] = max(peak[0], rss_mb())
    outcome["peak_increase_mb"] = peak[0] - base
    print(json.dumps(outcome), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else None)
