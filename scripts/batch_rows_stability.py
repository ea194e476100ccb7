"""How stable start-up's choice of rows a call is: the text graph measured N times, each in a fresh service as a
`serve` start would measure it (no kept choice), printing the rows each chose and its timings.

    python scripts/batch_rows_stability.py ARTIFACT [--starts 5] [--device cpu]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from systemone.runtime.artifact import Artifact  # noqa: E402
from systemone.runtime.engine import EngineOptions  # noqa: E402
from systemone.runtime.service import DecisionService  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact")
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    chosen = []
    for start in range(args.starts):
        service = DecisionService(Artifact.load(args.artifact), EngineOptions(device=args.device))
        sizing = service.batch_sizing()
        service.close()
        chosen.append(sizing.rows)
        print(f"start {start + 1}: {sizing.describe()}", flush=True)
    print(f"rows chosen: {chosen} ({len(Counter(chosen))} distinct)")


if __name__ == "__main__":
    main()
