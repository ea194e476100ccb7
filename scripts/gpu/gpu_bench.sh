#!/usr/bin/env bash
# On the lent GPU machine (see ../shared/device/README.md), in steps of one warm lease (each under the 10-minute
# limit of one call; the checkpoint and artifact stay in ~/work between them). The runtime needs pybase64, which
# the machine lacks: carry its wheel in .device/wheels (the list in gpu_serve_bench.sh). The torch side of `bench`
# is the checkpoint's own runtime at its best: carry flash-linear-attention's wheels there too (pure Python, Triton
# kernels; einops is fla-core's import):
#   ../shared/device/prepare.sh flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.2
# causal-conv1d has no wheel (a CUDA extension built from source): the short convolution runs transformers' torch
# path, and the bench's report says so. Warnings are shown, never filtered.
#   bash scripts/gpu/gpu_bench.sh checkpoint SIZE MODE     build a random-init checkpoint of SIZE (d3-* or d1-3B;
#                                                          MODE, the d3 attention mode, is ignored for d1) and say
#                                                          what the machine has
#   bash scripts/gpu/gpu_bench.sh export SIZE MODE         the same checkpoint (built if missing), exported (portable)
#   bash scripts/gpu/gpu_bench.sh forms SIZE MODE [FORMS]  add the CUDA forms, their answer gates run on CUDA
#   bash scripts/gpu/gpu_bench.sh bench SIZE MODE [FORMS]  `systemone bench` on CUDA, onnxruntime's and the GPU's
#                                                          profile of the text graph and (d3) the media requests' stages
#   bash scripts/gpu/gpu_bench.sh graphs SIZE MODE [FORMS] `systemone bench` alone, at 1 / 8 / 32 x 200 and 8 x 1000
#                                                          (its report: bench_SIZE_MODE.json)
#   bash scripts/gpu/gpu_bench.sh media SIZE MODE          (d3) the media requests' stages alone; on the tiny model
#                                                          the fetch, decode and preprocessing rows are d3-nano's
#   bash scripts/gpu/gpu_bench.sh vision SIZE MODE         (d3) the vision graphs' segments one run each against one
#                                                          run of all, and the served form's profile on the seeds'
#                                                          photo, one of its video's frame groups and all ten
# FORMS: comma-separated form names (default: every one the family declares / the artifact has for CUDA).
# BENCH_ARGS: more `systemone bench` flags (e.g. "--repeats 5 --request-repeats 20" where the lease is short).
set -euo pipefail
step="$1"; size="$2"; mode="$3"; forms="${4:-}"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
work=~/work/"$size-$mode"
out="${OUT:-/tmp/out}"; mkdir -p "$out"
repo="$PWD"
cd ~  # the repo's own systemone/ folder would shadow the package mapping gpu_env.sh puts on PYTHONPATH
checkpoint() {  # a random-init checkpoint of $size, once per warm machine
  if [ ! -f "$work/checkpoint/config.json" ]; then
    case "$size" in
      d1*) python3 "$repo/scripts/build_d1_checkpoint.py" "$work/checkpoint" --size "$size" ;;
      *) python3 "$repo/scripts/build_d3_checkpoint.py" "$work/checkpoint" --size "$size" --attention-mode "$mode" ;;
    esac
  fi
}
media_timing() {  # where one image and one video request of the seeds' mix spend their time
  python3 "$repo/scripts/media_timing.py" "$work/artifact" --device cuda --repeats 5 --mp4 --throughput 1 4 8 16 \
    > "$out/media_timing_${size}_${mode}.txt" 2> "$out/media_timing.log" && cat "$out/media_timing_${size}_${mode}.txt" \
    || { echo "media timing failed"; tail -5 "$out/media_timing.log"; }
}
case "$step" in
checkpoint)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import onnxruntime as o, torch, transformers; print('onnxruntime', o.__version__, o.get_available_providers()); print('torch', torch.__version__, 'transformers', transformers.__version__)"
  python3 -c "import triton, fla; print('triton', triton.__version__, 'fla', fla.__version__)" \
    || echo "flash-linear-attention does not import: the torch side runs transformers' fallback kernels"
  checkpoint
  ;;
export)
  checkpoint
  python3 -m systemone.cli export "$work/checkpoint" --out "$work/artifact" --overwrite --portable-only
  ;;
forms)
  python3 -m systemone.cli export "$work/checkpoint" --out "$work/artifact" --add-forms --gate-device cuda \
    ${forms:+--forms "$forms"}
  cp "$work/artifact/manifest.json" "$out/manifest_${size}_${mode}.json"
  ;;
bench)
  # onnxruntime's and the GPU's own profile of the form serve takes (a failed profile does not stop the bench)
  for shape in 1x200 32x200 8x1000; do
    python3 "$repo/scripts/ort_profile.py" "$work/artifact" --device cuda --batch ${shape%x*} --length ${shape#*x} \
      --gpu-kernels --out "$out/profile_${size}_${mode}_b${shape}.json" > /dev/null 2> "$out/profile_${shape}.log" \
      || tail -3 "$out/profile_${shape}.log"
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); k=r.get('gpu_kernels',{}); \
print(sys.argv[2], r['form'], 'gpu ms/run', round(k.get('gpu_ms_per_run',0),2), 'kernels/run', k.get('kernels_per_run'), \
{f: round(v['ms'],2) for f,v in k.get('by_family',{}).items()})" "$out/profile_${size}_${mode}_b${shape}.json" $shape || true
  done
  case "$size" in d1*) ;; *) media_timing ;; esac
  python3 -m systemone.cli bench "$work/checkpoint" --artifact "$work/artifact" --device cuda \
    ${forms:+--forms ${forms//,/ }} ${BENCH_ARGS:-} --out "$out/bench_${size}_${mode}.json" 2>&1
  ;;
graphs)
  python3 -m systemone.cli bench "$work/checkpoint" --artifact "$work/artifact" --device cuda \
    --shapes 1x200 8x200 32x200 8x1000 ${forms:+--forms ${forms//,/ }} ${BENCH_ARGS:-} \
    --out "$out/bench_${size}_${mode}.json" 2>&1
  ;;
media)
  media_timing
  ;;
vision)
  python3 "$repo/scripts/vision_runs.py" "$work/artifact" --device cuda 2>&1 | tee "$out/vision_runs_${size}_${mode}.txt"
  for shape in 60x80x1 20x36x1 20x36x10; do
    grid=${shape%x*}
    python3 "$repo/scripts/ort_profile.py" "$work/artifact" --device cuda --graph vision --grid $grid \
      --segments ${shape##*x} --gpu-kernels --out "$out/profile_vision_${size}_${mode}_${shape}.json" > /dev/null \
      2> "$out/profile_vision_${shape}.log" || tail -3 "$out/profile_vision_${shape}.log"
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); k=r.get('gpu_kernels',{}); \
print(sys.argv[2], r['form'], 'host ms/run', round(r['kernel_ms_per_run'],2), 'gpu ms/run', round(k.get('gpu_ms_per_run',0),2), \
'kernels/run', k.get('kernels_per_run'), {f: round(v['ms'],2) for f,v in k.get('by_family',{}).items()})" \
      "$out/profile_vision_${size}_${mode}_${shape}.json" $shape || true
  done
  ;;
*) echo "unknown step $step" >&2; exit 2 ;;
esac
