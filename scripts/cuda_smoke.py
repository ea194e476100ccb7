"""An artifact's answers on CUDA against the CPU's, and the server's scheduling paths on CUDA: the seeds' mix (text,
JSON, 40-option, image, video and one-question requests; d1: no video) answered by `decide` on CUDA (the artifact's
CUDA form) and on the CPU (portable), then submitted together to a scheduler on CUDA as `serve` runs it there
(media lane on, calls shared across requests; its engine thread replays CUDA graphs where the form allows) against
each answered alone on CUDA (uncaptured). The tests run these paths on
the CPU only; this is their check on a GPU (IO binding, device-resident state, the media lane's second thread).

    python scripts/cuda_smoke.py ARTIFACT [--requests 12] [--device cuda]
"""

from __future__ import annotations

import argparse
from typing import Any


def probabilities(response: dict[str, Any]) -> dict[tuple[str, str], float]:
    return {(q, k): p for q, a in response["answers"].items() for k, p in a["probabilities"].items()}


def max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    pa, pb = probabilities(a), probabilities(b)
    if pa.keys() != pb.keys():
        raise SystemExit("the two answers have different options")
    return max(abs(pa[k] - pb[k]) for k in pa)


def main() -> None:
    from systemone.loadgen import ALL_KINDS, RequestMix
    from systemone.runtime.artifact import Artifact
    from systemone.runtime.deadline import Deadline
    from systemone.runtime.engine import EngineOptions
    from systemone.runtime.scheduler import Scheduler
    from systemone.runtime.service import DecisionService

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact")
    parser.add_argument("--requests", type=int, default=12, help="requests of the mix, in its rotation of kinds")
    parser.add_argument("--device", default="cuda", help="the device checked against the CPU (cpu: a dry run)")
    args = parser.parse_args()

    gpu = DecisionService(Artifact.load(args.artifact), EngineOptions(device=args.device))
    cpu = DecisionService(Artifact.load(args.artifact), EngineOptions(device="cpu"))
    print("family", gpu.artifact.manifest.family, "form", gpu.form, gpu.provider, "cuda graphs", gpu.cuda_graphs)
    mix = RequestMix(gpu.artifact.manifest.family, seed=0, kinds=ALL_KINDS)
    bodies = [mix.body(i) for i in range(args.requests)]
    for kind, body in bodies:
        print(f"{kind:8s} {len(body['questions'])} question(s): max |dp| {args.device} vs cpu "
              f"{max_diff(gpu.decide(body), cpu.decide(body)):.2e}")
    prepared = [gpu.prepare(body) for _, body in bodies]
    alone = [gpu.answer(p) for p in prepared]
    scheduler = Scheduler(gpu.engine, batch_rows=16, batch_wait_s=0.2, media_lane=True)
    print("scheduler lanes", scheduler.lanes)
    futures = [scheduler.submit(p, Deadline()) for p in prepared]
    shared = [gpu.respond(p, f.result(timeout=120)) for p, f in zip(prepared, futures, strict=True)]
    scheduler.close()
    print(f"{len(prepared)} requests submitted together: max |dp| shared vs alone "
          f"{max(max_diff(a, s) for a, s in zip(alone, shared, strict=True)):.2e}")
    print("batch rows", gpu.batch_sizing().describe())
    print("cuda graphs after the scheduler's engine thread warmed up:", gpu.cuda_graphs)


if __name__ == "__main__":
    main()
