# Sourced by demo.sh and test.sh: a project virtualenv with the export and test extras.
# torch==2.13.0 is the CPU wheel; transformers is pinned to the release the reference behaviour was read from.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
mkdir -p .cache
if ! .venv/bin/python -m pip install -q -e ".[${EXTRAS:-test}]" > .cache/pip-install.log 2>&1; then
  cat .cache/pip-install.log >&2
  exit 1
fi
.venv/bin/python -c "import systemone.runtime, torch, transformers" >/dev/null
