#!/usr/bin/env bash
# export_checkpoint.sh HUB_ID [systemone export options...]: export one released checkpoint to artifacts/NAME.
# Runs from the repository root with or without an activated venv: it uses .venv/bin/systemone when there is one.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source="$1"; shift
name="${source##*/}"
if [ -x "$ROOT/.venv/bin/systemone" ]; then
  SYSTEMONE="$ROOT/.venv/bin/systemone"
elif command -v systemone >/dev/null 2>&1 && [ -f "$(command -v systemone)" ]; then
  SYSTEMONE="$(command -v systemone)"
else
  echo "no systemone command: run \`bash scripts/env.sh\` (creates .venv) or \`pip install -e \".[export,cpu]\"\`" >&2
  exit 2
fi
exec "$SYSTEMONE" export "$source" --out "${OUT:-artifacts/$name}" "$@"
