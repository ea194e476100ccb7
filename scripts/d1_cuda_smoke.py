"""d1's reads on CUDA against the CPU's, on one artifact: through `decide` (one question, 16 questions, 16 with an
image) and through the scheduler (one-question requests sharing calls, against each answered alone). The check
that the GPU's IO binding (reads fetched alone, the prefix state on the device) changes no answer; the tests run
the same paths on the CPU only.

    python scripts/d1_cuda_smoke.py ARTIFACT
"""

from __future__ import annotations

import sys
from typing import Any


def probabilities(response: dict[str, Any]) -> dict[tuple[str, str], float]:
    return {(q, k): p for q, a in response["answers"].items() for k, p in a["probabilities"].items()}


def max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    pa, pb = probabilities(a), probabilities(b)
    if pa.keys() != pb.keys():
        raise SystemExit("the two answers have different options")
    return max(abs(pa[k] - pb[k]) for k in pa)


def main() -> None:
    from systemone.export.d1.answer_parity import sixteen_questions
    from systemone.runtime.artifact import Artifact
    from systemone.runtime.deadline import Deadline
    from systemone.runtime.engine import EngineOptions
    from systemone.runtime.scheduler import Scheduler
    from systemone.runtime.service import DecisionService

    artifact = sys.argv[1]
    gpu = DecisionService(Artifact.load(artifact), EngineOptions(device="cuda"))
    cpu = DecisionService(Artifact.load(artifact), EngineOptions(device="cpu"))
    print("form", gpu.form, gpu.provider)
    text, image = sixteen_questions(False), sixteen_questions(True)
    questions = list(text["questions"].items())
    one = {**text, "questions": dict(questions[:1])}
    for name, body in (("one question", one), ("16 questions", text), ("16 questions + image", image)):
        print(f"{name}: max |dp| cuda vs cpu {max_diff(gpu.decide(body), cpu.decide(body)):.2e}")
    bodies = [{**text, "state": {**text["state"], "tier": f"t{i}"}, "questions": dict(questions[i:i + 1])}
              for i in range(8)]
    prepared = [gpu.prepare(body) for body in bodies]
    alone = [gpu.answer(p) for p in prepared]
    scheduler = Scheduler(gpu.engine, batch_rows=8, batch_wait_s=0.2)
    futures = [scheduler.submit(p, Deadline()) for p in prepared]
    shared = [gpu.respond(p, f.result(timeout=60)) for p, f in zip(prepared, futures, strict=True)]
    scheduler.close()
    print(f"8 one-question requests through the scheduler: max |dp| shared vs alone "
          f"{max(max_diff(a, s) for a, s in zip(alone, shared, strict=True)):.2e}")
    print("batch rows", gpu.batch_sizing().describe())


if __name__ == "__main__":
    main()
