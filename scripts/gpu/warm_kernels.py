"""The torch reference's kernels compiled before the lease's first export: transformers runs d3's Gated DeltaNet
layers with flash-linear-attention's Triton kernels, which a fresh machine compiles on first use (the first
export's gate took 131 s where the same shape's took 41 s once they were cached). Run on a d3 checkpoint while the
onnxruntime-gpu parts are gathered: the reference in fp32 on CUDA, as the gate runs it, on prompts of a few
lengths."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from systemone.export.d3.config import D3ExportConfig
from systemone.runtime.d3.code_logits import text_positions


def main(checkpoint: str) -> None:
    began = time.monotonic()
    config = D3ExportConfig(Path(checkpoint))
    with config.reference_on("cuda"):
        loaded = time.monotonic()
        config.reference_logits_many([(list(range(100, 100 + length)), text_positions(length), None, None)
                                      for length in (37, 300, 1000)])
    print(f"loaded in {loaded - began:.1f} s, three prompts in {time.monotonic() - loaded:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1])
