#!/usr/bin/env bash
# export_checkpoint.sh HUB_ID [systemone export options...]: export one released checkpoint to artifacts/NAME.
set -euo pipefail
source="$1"; shift
name="${source##*/}"
exec systemone export "$source" --out "${OUT:-artifacts/$name}" "$@"
