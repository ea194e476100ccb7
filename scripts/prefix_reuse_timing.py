"""A request's graphs run with its questions' shared prefix read once (the default for d1 and causal d3) against every
question's whole prompt read as a row (`Engine.run(prepared, reuse_prefix=False)`), alternating, on the seeds' mix
requests of four questions (`systemone bench --serve`'s kinds: text and JSON states, the 40-option choice, the
photo-sized JPEG, the 10 s 720p video; media loaded once, before the timing). Median (min) of --repeats, ms, and
the text-graph tokens each way, and the way serve takes: the call cost measured as at start-up
(`DecisionService.batch_sizing`) weighs the tokens the prefix saves against the call it adds
(`CallCost.prefix_pays`). Both ways are timed whatever serve would take, uncaptured (no CUDA graphs), as serve runs
a request read on its prefix.

    python scripts/prefix_reuse_timing.py ARTIFACT [--device cpu] [--repeats 10]
"""

from __future__ import annotations

import argparse
from functools import partial

import numpy as np
from timing import alternating_ms

from systemone.loadgen import RequestMix
from systemone.runtime.artifact import Artifact
from systemone.runtime.batch import UNMEASURED_COST
from systemone.runtime.engine import EngineOptions
from systemone.runtime.service import DecisionService
from systemone.runtime.tokenizer import shared_prefix

QUESTIONS = 4  # the mix's most: the case prefix reuse is for


def four_question_bodies(family: str) -> dict[str, dict]:
    """One body of four questions of each kind of the mix, as `systemone bench --serve` sends them."""
    mix = RequestMix(family)
    bodies: dict[str, dict] = {}
    i = 0
    while len(bodies) < len(mix.kinds):
        kind, body = mix.body(i)
        if len(body["questions"]) == QUESTIONS:
            bodies.setdefault(kind, body)
        i += 1
    return bodies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    service = DecisionService(Artifact.load(args.artifact), EngineOptions(device=args.device))
    engine = service.engine
    family = service.artifact.manifest.family
    cost = service.batch_sizing().cost or UNMEASURED_COST
    engine.use_call_cost(UNMEASURED_COST)  # a prefix of a few tokens pays: both ways are timed for every kind
    print(f"{args.artifact} ({family}) on {service.provider}; a call costs {cost.describe()}")
    try:
        for kind, body in four_question_bodies(family).items():
            prepared = service.prepare(body)
            if not engine.runs_whole(prepared):
                print(f"{kind}: the engine reads every whole prompt (no state, or a prefix too short to pay)")
                continue
            ids = [p.token_ids for p in prepared.prompts]
            split = shared_prefix(ids)
            whole_tokens, reused_tokens = sum(map(len, ids)), split + sum(len(i) - split for i in ids)
            times = alternating_ms((True, False), lambda reuse, i: partial(engine.run, prepared, reuse_prefix=reuse),
                                   args.repeats)
            reused, whole = times[True], times[False]
            served = "prefix once" if cost.prefix_pays(len(ids), split) else "whole prompts"
            print(f"{kind}: whole prompts {np.median(whole):.2f} (min {whole.min():.2f}) ms, {whole_tokens} tokens | "
                  f"prefix once {np.median(reused):.2f} (min {reused.min():.2f}) ms, {reused_tokens} tokens | "
                  f"{np.median(whole) / np.median(reused):.2f}x | serve: {served}", flush=True)
    finally:
        service.close()


if __name__ == "__main__":
    main()
