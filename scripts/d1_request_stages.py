"""Where a d1 request with an image spends its time: the bench's 16-question request with a 1024x1024 image, stage
by stage, and inside its image, the decode, the LFM2-VL processor and the vision graph.

Stages, in the order a request runs them: validate; load_media (fetch, decode, cap and the processor, in the media
pool); prepare_loaded (prompts rendered and tokenized, labels); prepare (validate, load_media and prepare_loaded
as `decide` runs them: the prompts tokenized while the image loads); encode_media (the vision graph over every crop);
prefill (the shared prefix, images included, on an empty state); suffix_reads (the 16 questions on that state);
whole_run (encode, prefill and reads as `Engine.run` does them). Medians leave out the first two requests. Then the
last request's reads grouped by start-up's cost model and, side by side, in one call.

With --gpu-kernels (CUDA, torch installed: a profiling tool, not the runtime), the last request's prefill, suffix
reads and whole run again under CUPTI (scripts/ort_profile.py's `gpu_kernel_times`): the GPU's own time and kernel
launches a run, by kernel family. Set beside the stage's wall time, it says whether that stage waits on the GPU or
on the host's launches.

With --vision-baseline, each crop grid's vision run is also timed, on the same crops, through the portable vision
graph rewritten with only its matrix products in fp16 (the vision graph of the rungs without fused ops, written
again here into a temporary folder), and both are compared with the portable fp32 graph: the fused vision graph's
gain side by side, in one run.

    python scripts/d1_request_stages.py ARTIFACT [--device cuda] [--requests 12] [--vision-baseline] [--gpu-kernels]
"""

from __future__ import annotations

import argparse
import base64
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from systemone.bench import percentile_ms, timed
from systemone.export.d1.answer_parity import sixteen_questions
from systemone.export.sample_media import image_url
from systemone.runtime.artifact import Artifact
from systemone.runtime.batch import CallCost
from systemone.runtime.tokenizer import shared_prefix
from systemone.runtime.d1 import image_processor
from systemone.runtime.d1.image_processor import cap_pixels, lfm2_image
from systemone.runtime.d1.images import media_rows
from systemone.runtime.d1.state import D1TextRunner, Snapshot
from systemone.runtime.engine import EngineOptions
from systemone.runtime.media_decode import decode_image
from systemone.runtime.service import DecisionService


def median_ms(fn: Callable[[], Any], repeats: int = 7) -> str:
    return f"{percentile_ms(timed(fn, repeats), 50):.2f} ms"  # after one untimed call, as `systemone bench` times


def request_stages(service: DecisionService, requests: int) -> dict[str, Callable[[], Any]]:
    """Times the stages of `requests` image requests; the last request's GPU stages, to run again."""
    engine = service.engine
    image = image_url(1024, 1024, seed=7)
    stages: dict[str, list[float]] = {}

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        result = fn()
        stages.setdefault(name, []).append((time.perf_counter() - start) * 1000)
        return result

    for i in range(requests):
        body = sixteen_questions(with_image=False)
        body["state"]["tier"] = f"gold-{i}"  # a new prompt each time, as the bench sends
        body["images"] = [image]
        request, questions = timed("validate", lambda: service.validate(body))
        media = timed("load_media", lambda: service.load_media(request))
        prepared = timed("prepare_loaded", lambda: service.prepare_loaded(request, questions, media))
        timed("prepare", lambda: service.prepare(body))
        encoded = timed("encode_media", lambda: engine.encode_media(prepared))
        ids = [p.token_ids for p in prepared.prompts]
        split = shared_prefix(ids)
        rows = media_rows(ids[0], engine.image_token_id, encoded)
        snapshot = timed("prefill", lambda: engine.runner.extend(engine.runner.empty(), ids[0][:split], rows))
        label_ids = sorted({x for labels in prepared.labels for x in labels.ids})
        timed("suffix_reads", lambda: engine.runner.suffix_logprobs(snapshot, [p[split:] for p in ids], label_ids))
        timed("whole_run", lambda: engine.run(prepared))
    print(f"prefix {split} tokens, vision rows {encoded.shape}")
    for name, times in stages.items():
        print(f"{name:15s} median {np.median(times[2:]):8.2f} ms  min {min(times[2:]):8.2f}")
    suffixes = [p[split:] for p in ids]
    read_plans(engine.runner, snapshot, suffixes, label_ids)
    return {"prefill": lambda: engine.runner.extend(engine.runner.empty(), ids[0][:split], rows),
            "suffix_reads": lambda: engine.runner.suffix_logprobs(snapshot, suffixes, label_ids),
            "whole_run": lambda: engine.run(prepared)}


def read_plans(runner: D1TextRunner, snapshot: Snapshot, suffixes: list[list[int]], label_ids: list[int]) -> None:
    """The suffix reads grouped by start-up's cost model, and side by side all in one call (what a straight line
    fitted through a GPU's launch-bound small calls chose): each grouping's calls, padded tokens and time."""
    measured = runner.cost
    try:
        for name, cost in (("start-up's cost model", measured), ("one call", CallCost(fixed_s=1.0, token_s=0.0))):
            runner.cost = cost
            plan = runner.budget.plan([len(s) for s in suffixes], snapshot.length, cost)
            padded = sum(len(call) * max(len(suffixes[i]) for i in call) for call in plan)
            print(f"suffix reads, {name}: {len(plan)} calls, {padded} padded tokens "
                  f"({sum(len(s) for s in suffixes)} real),",
                  median_ms(lambda: runner.suffix_logprobs(snapshot, suffixes, label_ids)))
    finally:
        runner.cost = measured


def gpu_stages(stages: dict[str, Callable[[], Any]], runs: int = 5) -> None:
    """Each stage's GPU kernel time a run against its wall time: a stage whose kernels take far less than its wall
    time is bound by the host (launches, copies, Python), not the GPU."""
    from ort_profile import gpu_kernel_times  # beside this script

    for name, fn in stages.items():
        wall = percentile_ms(timed(fn, runs), 50)
        report = gpu_kernel_times(fn, runs)
        families = ", ".join(f"{family} {entry['ms']:.2f}" for family, entry in report["by_family"].items())
        print(f"{name:15s} wall {wall:7.2f} ms, GPU {report['gpu_ms_per_run']:7.2f} ms in "
              f"{report['kernels_per_run']:.0f} kernels ({families})")
        for kernel in report["top_kernels"][:6]:
            print(f"    {kernel['ms']:6.2f} ms  {kernel['launches_per_run']:5.0f}x  {kernel['name'][:110]}")


def image_stages(service: DecisionService) -> None:
    encoder = service.engine.media
    # The same pixels as a PNG and a JPEG; the request above sends the PNG, whose pixels the stages below take.
    files = {fmt: base64.b64decode(image_url(1024, 1024, seed=7, fmt=fmt).split(",", 1)[1]) for fmt in ("PNG", "JPEG")}
    for fmt, data in files.items():
        print(f"decode ({fmt}, {len(data) / 1e6:.2f} MB)", median_ms(lambda: decode_image(data, "image")))
    rgb = decode_image(files["PNG"], "image")
    capped = cap_pixels(rgb)
    print("cap", median_ms(lambda: cap_pixels(rgb)))
    image = lfm2_image(capped, encoder.config)
    print("lfm2_image", median_ms(lambda: lfm2_image(capped, encoder.config)), [c.grid for c in image.crops])
    # As a request runs it (a lone image: the pixel workers' threads), in parts of PART_ROWS rows and, side by side,
    # in one part a row of tiles or the thumbnail (PART_ROWS unbounded), as before parts were cut finer.
    workers = service.media_pool.pixels
    for rows in (image_processor.PART_ROWS, 1 << 30):
        part_rows, image_processor.PART_ROWS = image_processor.PART_ROWS, rows
        try:
            print(f"lfm2_image in the pixel workers' threads, parts of at most {rows} rows",
                  median_ms(lambda: lfm2_image(capped, encoder.config, workers), repeats=21))
        finally:
            image_processor.PART_ROWS = part_rows
    print("vision rows, all crops", median_ms(lambda: encoder.rows(image, None)))
    for grid in sorted({c.grid for c in image.crops}):
        crops = [c for c in image.crops if c.grid == grid]
        patches = np.stack([c.patches for c in crops])  # in the graph's order, as the processor writes them
        positions = encoder.positions(*grid)
        feeds = {"patches": patches, "positions": positions}
        print(f"grid {grid}: {len(crops)} crops, patches {patches.shape}, vision graph run",
              median_ms(lambda: encoder.session.run(feeds)))
        print("  position table resized (uncached)", median_ms(lambda: encoder._positions(*grid)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--gpu-kernels", action="store_true",
                        help="also the GPU's kernel time of the prefill, the reads and the whole run (CUDA, torch)")
    args = parser.parse_args()
    service = DecisionService(Artifact.load(args.artifact), EngineOptions(device=args.device))
    print(f"{args.artifact} on {service.provider}, form {service.form}")
    print("batch rows", service.batch_sizing().describe())
    stages = request_stages(service, args.requests)
    image_stages(service)
    if args.gpu_kernels:
        gpu_stages(stages)


if __name__ == "__main__":
    main()
