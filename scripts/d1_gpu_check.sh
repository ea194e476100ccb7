#!/usr/bin/env bash
# On the lent GPU machine (see ../shared/device/README.md): install the gathered onnxruntime-gpu parts and the
# carried wheels, then build and export a random-init d1-3B-sized checkpoint (step "export"), or check it with the
# CUDA provider against the torch model on CUDA and time prefix reuse (step "check"). Two steps, so that each
# stays within one call's time limit; the work folder survives between calls while the machine is warm.
#   bash scripts/d1_gpu_check.sh export|check [SIZE]
set -euo pipefail
step="$1"; size="${2:-d1-3B}"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
mkdir -p "${OUT:-/tmp/out}"
if [ "$step" = export ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import onnxruntime as o, torch, transformers; print('onnxruntime', o.__version__, o.get_available_providers()); print('torch', torch.__version__, 'transformers', transformers.__version__)"
  python3 scripts/d1_parity.py --device cuda --size "$size" --work ~/work --export-only 2>&1 \
    | grep -v "falling back\|Writing model\|Loading weights\|torchvision\|Warning\|warn("
  cp ~/work/"$size"-onnx/manifest.json "${OUT:-/tmp/out}/gpu_${size}_manifest.json"
else
  python3 scripts/d1_parity.py --device cuda --size "$size" --work ~/work --reuse-artifact --time \
    --out "${OUT:-/tmp/out}/gpu_${size}.json" 2>&1 | grep -v "falling back\|Loading weights\|torchvision"
fi
