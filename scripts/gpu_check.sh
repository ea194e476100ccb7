#!/usr/bin/env bash
# On the lent GPU machine (see ../shared/device/README.md): install the gathered onnxruntime-gpu parts and the
# carried wheels, then build, export and check a random-init d3 checkpoint with the CUDA provider, and time it.
#   bash scripts/gpu_check.sh SIZE MODE [MODE...]     e.g. bash scripts/gpu_check.sh d3-nano noncausal_full_attention
set -euo pipefail
size="$1"; shift
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import onnxruntime as o, torch, transformers; print('onnxruntime', o.__version__, o.get_available_providers()); print('torch', torch.__version__, 'transformers', transformers.__version__)"
mkdir -p "${OUT:-/tmp/out}"
python3 scripts/parity.py --device cuda --size "$size" --modes "$@" --time --work /tmp/work \
  --out "${OUT:-/tmp/out}/gpu_${size}_$1.json" 2>&1 | grep -v "falling back\|Writing model\|Loading weights\|torchvision"
