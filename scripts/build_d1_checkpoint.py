"""Write a seeded random-init d1 checkpoint in the released on-disk format (the builder lives beside the tests,
which build their checkpoints with it: tests/d1_checkpoint.py says what it writes).

    python scripts/build_d1_checkpoint.py OUT [--size SIZE] [--seed 0]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.d1_checkpoint import main  # noqa: E402

if __name__ == "__main__":
    main()
