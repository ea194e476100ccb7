#!/usr/bin/env bash
# On the lent GPU machine (see ../shared/device/README.md), in steps of one warm lease (each under the 10-minute
# limit of one call; the checkpoint and artifact stay in ~/work between them):
#   bash scripts/gpu_bench.sh export SIZE MODE          build a random-init d3 checkpoint of SIZE, export it (portable)
#   bash scripts/gpu_bench.sh forms SIZE MODE [FORMS]   add the CUDA forms, their answer gates run on CUDA
#   bash scripts/gpu_bench.sh precision SIZE MODE       how far torch's own half precisions are from fp32, on the
#                                                       gate's questions
#   bash scripts/gpu_bench.sh bench SIZE MODE [FORMS]   `systemone bench` on CUDA and onnxruntime's profile
# FORMS: comma-separated form names (default: every one the family declares / the artifact has for CUDA).
set -euo pipefail
step="$1"; size="$2"; mode="$3"; forms="${4:-}"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
work=~/work/"$size-$mode"
out="${OUT:-/tmp/out}"; mkdir -p "$out"
repo="$PWD"
cd ~  # the repo's own systemone/ folder would shadow the package mapping gpu_env.sh puts on PYTHONPATH
quiet() { grep -v "falling back\|Writing model\|Loading weights\|torchvision\|UserWarning\|warnings.warn"; }
case "$step" in
export)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import onnxruntime as o, torch, transformers; print('onnxruntime', o.__version__, o.get_available_providers()); print('torch', torch.__version__, 'transformers', transformers.__version__)"
  [ -f "$work/checkpoint/config.json" ] || python3 "$repo/scripts/build_d3_checkpoint.py" "$work/checkpoint" --size "$size" --attention-mode "$mode"
  python3 -m systemone.cli export "$work/checkpoint" --out "$work/artifact" --overwrite --portable-only 2>&1 | quiet
  ;;
forms)
  python3 -m systemone.cli export "$work/checkpoint" --out "$work/artifact" --add-forms --gate-device cuda \
    ${forms:+--forms "$forms"} 2>&1 | quiet
  cp "$work/artifact/manifest.json" "$out/manifest_${size}_${mode}.json"
  ;;
precision)
  python3 "$repo/scripts/torch_precision.py" "$work/checkpoint" "$work/artifact" --device cuda \
    --out "$out/torch_precision_${size}_${mode}.json" 2>&1 | quiet
  ;;
bench)
  for batch in 1 8; do  # onnxruntime's profile of the form serve takes, uncaptured
    python3 "$repo/scripts/ort_profile.py" "$work/artifact" --device cuda --batch $batch --length 200 \
      --out "$out/profile_${size}_${mode}_b${batch}x200.json" 2>&1 | tail -12
  done
  python3 -m systemone.cli bench "$work/checkpoint" --artifact "$work/artifact" --device cuda \
    ${forms:+--forms ${forms//,/ }} --out "$out/bench_${size}_${mode}.json" 2>&1 | quiet | grep -v '^ \|^{\|^}'
  ;;
*) echo "unknown step $step" >&2; exit 2 ;;
esac
