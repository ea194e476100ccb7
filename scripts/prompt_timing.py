"""A request's prompts, from its body to its token ids (`DecisionService.prepare`: validation, templates, the
tokenizer; media loaded where the request has them), and the whole request (`decide`), timed with the prompts'
shared start tokenized once (runtime/tokenizer.py `encode_sharing`) and with every prompt tokenized whole, the two
alternating, on the requests `systemone bench` sends for ARTIFACT's family. Median (min) of --repeats, ms.

    python scripts/prompt_timing.py ARTIFACT [--device cpu] [--repeats 30]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import numpy as np
from timing import alternating_ms

from systemone.models.registry import FAMILIES
from systemone.runtime.artifact import Artifact
from systemone.runtime.engine import EngineOptions
from systemone.runtime.service import DecisionService


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    service = DecisionService(Artifact.load(args.artifact), EngineOptions(device=args.device))
    tokenizer = service.artifact.tokenizer
    if not tokenizer.share_starts:
        raise SystemExit("this artifact's tokenizer is always encoded whole: nothing to compare")
    print(f"{args.artifact} ({service.artifact.manifest.family}) on {service.provider}")
    try:
        workload = FAMILIES.get(service.artifact.manifest.family).load_export_config().workload
        for name, body in workload.requests().items():
            for stage, run in (("prepare", service.prepare), ("decide", service.decide)):

                def call(share: bool, i: int, run=run, body=body) -> Callable[[], object]:
                    tokenizer.share_starts = share
                    return partial(run, body(i))

                times = alternating_ms((True, False), call, args.repeats)
                shared, whole = times[True], times[False]
                print(f"{name} {stage}: whole prompts {np.median(whole):.2f} (min {whole.min():.2f}) | shared start "
                      f"{np.median(shared):.2f} (min {shared.min():.2f}) | {np.median(whole) / np.median(shared):.2f}x",
                      flush=True)
    finally:
        service.close()


if __name__ == "__main__":
    main()
