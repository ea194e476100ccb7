"""Write a seeded random-init d3 checkpoint in the released on-disk format (the builder lives beside the tests,
which build their checkpoints with it: tests/d3_checkpoint.py says what it writes).

    python scripts/build_d3_checkpoint.py OUT [--size SIZE] [--seed 0] [--attention-mode MODE]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.d3_checkpoint import main  # noqa: E402

if __name__ == "__main__":
    main()
