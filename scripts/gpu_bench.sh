#!/usr/bin/env bash
# On the lent GPU machine (see ../shared/device/README.md), in two steps of one warm lease:
#   bash scripts/gpu_bench.sh export SIZE MODE   build a random-init d3 checkpoint of SIZE and export it (~/work)
#   bash scripts/gpu_bench.sh bench SIZE MODE    `systemone bench` on it (CUDA) and onnxruntime's profile
set -euo pipefail
step="$1"; size="$2"; mode="$3"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
work=~/work/"$size-$mode"
out="${OUT:-/tmp/out}"; mkdir -p "$out"
repo="$PWD"
cd ~  # the repo's own systemone/ folder would shadow the package mapping gpu_env.sh puts on PYTHONPATH
quiet() { grep -v "falling back\|Writing model\|Loading weights\|torchvision\|UserWarning\|warnings.warn"; }
if [ "$step" = export ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import onnxruntime as o, torch, transformers; print('onnxruntime', o.__version__, o.get_available_providers()); print('torch', torch.__version__, 'transformers', transformers.__version__)"
  [ -f "$work/checkpoint/config.json" ] || python3 "$repo/scripts/build_d3_checkpoint.py" "$work/checkpoint" --size "$size" --attention-mode "$mode"
  python3 -m systemone.cli export "$work/checkpoint" --out "$work/artifact" --overwrite 2>&1 | quiet
else
  python3 "$repo/scripts/ort_profile.py" "$work/artifact" --device cuda --batch 8 --length 200 \
    --out "$out/profile_${size}_${mode}.json" 2>&1 | tail -40
  python3 -m systemone.cli bench "$work/checkpoint" --artifact "$work/artifact" --device cuda \
    --out "$out/bench_${size}_${mode}.json" 2>&1 | quiet | grep -v '^ \|^{\|^}'
fi
