#!/usr/bin/env bash
# One lease of the lent GPU machine (scripts/gpu/README.md): every released shape exported with its CUDA form and
# measured, then the benches, in as few calls as the onnxruntime-gpu wheel's seven parts allow.
#   call 0      bash scripts/gpu/lease.sh start        carry .device/ort/part00 .device/w0
#   calls 1-6   bash scripts/gpu/lease.sh gather K     carry .device/ort/part0K (+ .device/wK where it exists;
#                                                      .device/ort/SHA256 with K = 6, which installs the wheels)
#   then        bash scripts/gpu/lease.sh wait SECONDS until every export is done (prints the table so far)
#   then        bash scripts/gpu/lease.sh bench STEP...  graphs (d3-nano vs torch), mix[:SIZE] (d3-nano unless named,
#                                                      ours and the reference), serve:SIZE (one request and the
#                                                      mix's five kinds)
#   and         bash scripts/gpu/lease.sh drop SIZE...   frees the disk of sizes already measured
#               bash scripts/gpu/lease.sh more SIZE...   builds and exports more sizes (those too large to sit on the
#                                                      64 GB disk beside the first), then `wait` with SIZES set
# `start` copies the tree to ~/repo and starts one chain in the background: the first size's random-init checkpoint
# is built and the torch reference's kernels compiled on it while the parts are gathered (the others' checkpoints
# built beside, niced), then each size exported as soon as onnxruntime-gpu is in and its checkpoint built, one
# after another, each timed apart from the others' exports: wall time, peak host memory (GNU time), peak GPU memory and disk written (sampled every
# half second), gate figures. SIZES (default "d3-nano d3-mini d1-3B d3-edge") and D3_MODE
# (noncausal_full_attention) choose; `tiny` runs the steps on a CPU machine up to the CUDA gates.
# Between calls the machine stays warm for 30 s: make them back to back. Results go to ~/res and come back as
# $OUT/results.tgz.
set -uo pipefail
step="$1"; shift
GPU_ENV_DEFINE_ONLY=1 source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"  # gpu_install, gpu_package
sizes=${SIZES:-d3-nano d3-mini d1-3B d3-edge}
mode=${D3_MODE:-noncausal_full_attention}
work_of() { case $1 in d1*) echo ~/work/"$1--" ;; *) echo ~/work/"$1-$mode" ;; esac; }
# d3 (27B): the fp16 rungs' rounding fails the gate on random weights (2026-12-06), so the exact rung; FORMS_<size>
# (dashes as underscores) overrides.
form_of() { local o="FORMS_${1//-/_}"; [ -n "${!o:-}" ] && { echo "${!o}"; return; }
  case $1 in d1*) echo cuda-fused ;; d3) echo cuda-fp32 ;; *) echo cuda-fused-mixed ;; esac; }
# d3 (27B): its 52 GB checkpoint and a copy of its weights do not fit the 64 GB disk together.
weights_of() { case $1 in d3) echo link ;; *) echo "${WEIGHTS:-copy}" ;; esac; }
init_device() { command -v nvidia-smi > /dev/null && echo cuda || echo cpu; }

build() {  # SIZE: its checkpoint, in the background's first stage
  local size=$1 work
  work=$(work_of "$size")
  if [[ $size == d1* ]]; then  # d1-tiny: the tests' tiny d1
    python3 ~/repo/scripts/build_d1_checkpoint.py "$work/checkpoint" --size "${size/#d1-tiny/tiny}" > /dev/null
  else
    python3 ~/repo/scripts/build_d3_checkpoint.py "$work/checkpoint" --size "$size" --attention-mode "$mode" \
      --device "$( [ "$size" = tiny ] && echo cpu || init_device)" > /dev/null
  fi
}

sample() {  # FILE: the most GPU memory used (MiB) and disk used (KiB), every half second until killed
  local gpu=0 disk=0 g d
  while true; do
    g=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1 || echo 0)
    d=$(df -k --output=used ~ | tail -1)
    (( ${g:-0} > gpu )) && gpu=$g
    (( d > disk )) && disk=$d
    echo "$gpu $disk" > "$1"
    sleep 0.5
  done
}

export_one() {  # SIZE: exported with its CUDA form, timed alone
  local size=$1 work t0 gpu0 disk0 pid
  work=$(work_of "$size")
  gpu0=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1 || echo 0)
  disk0=$(df -k --output=used ~ | tail -1)
  sample ~/res/"sample_$size" & pid=$!
  t0=$(date +%s.%N)
  /usr/bin/time -v -o ~/res/"time_$size.txt" python3 -m systemone.cli export "$work/checkpoint" --out "$work/artifact" \
    --overwrite --gate-device "${GATE:-cuda}" --forms "$(form_of "$size")" --jobs "${JOBS:-4}" \
    --weights "$(weights_of "$size")" > ~/logs/"export_$size.log" 2>&1
  local rc=$?
  kill $pid 2>/dev/null; wait $pid 2>/dev/null
  python3 - "$size" "$work" "$t0" "$gpu0" "$disk0" "$rc" <<'PY'
import json, pathlib, re, sys, time
size, work, t0, gpu0, disk0, rc = sys.argv[1], pathlib.Path(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4] or 0), int(sys.argv[5]), int(sys.argv[6])
res = pathlib.Path.home() / "res"
timing = (res / f"time_{size}.txt").read_text() if (res / f"time_{size}.txt").exists() else ""
rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", timing)
gpu, disk = map(int, (res / f"sample_{size}").read_text().split()) if (res / f"sample_{size}").exists() else (0, 0)
size_of = lambda p, linked=False: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()
                                     and (f.relative_to(p).parts[0] == "linked") == linked) if p.exists() else 0
row = {"size": size, "exit": rc, "export_s": round(time.time() - t0, 1),
       "peak_rss_gb": round(int(rss.group(1)) / 1e6, 2) if rss else None,
       "peak_gpu_mib": gpu - gpu0, "peak_disk_written_gb": round((disk - disk0) / 1e6, 2),
       "artifact_gb": round(size_of(work / "artifact") / 1e9, 2),
       "linked_gb": round(size_of(work / "artifact", linked=True) / 1e9, 2),  # hard links: no disk of their own
       "checkpoint_bf16_gb": round(size_of(work / "checkpoint") / 1e9, 2)}
manifest = work / "artifact" / "manifest.json"
if manifest.exists():
    forms = json.loads(manifest.read_text())["forms"]
    row["gates"] = {name: form.get("gate", {}).get("summary") or form.get("refused") for name, form in forms.items()}
with open(res / "exports.jsonl", "a") as f:
    f.write(json.dumps(row) + "\n")
print(json.dumps(row))
PY
  [ $rc = 0 ] && touch "$work.done" || touch "$work.failed"
}

warm() {  # SIZE: the torch reference's Triton kernels compiled (scripts/gpu/warm_kernels.py), before its export
  [[ $1 == d1* ]] || [ "${WARM:-1}" = 0 ] || python3 ~/repo/scripts/gpu/warm_kernels.py "$(work_of "$1")/checkpoint" > ~/logs/warm.log 2>&1
}

chain() {  # the first size's checkpoint, then the others' in the background; each export alone once onnxruntime-gpu
  cd ~ || return  # is in and its checkpoint built
  export PYTHONPATH=~/site0:~/repo
  local size t0 first=${sizes%% *}
  t0=$(date +%s)
  [ -f "$(work_of "$first")/checkpoint/config.json" ] || build "$first"
  echo "[$(( $(date +%s) - t0 )) s] $first's checkpoint built"
  for size in $sizes; do
    w=$(work_of "$size")
    if [ "$size" = "$first" ] || [ -f "$w/checkpoint/config.json" ]; then touch "$w.built"
    else nice -n 10 bash -c "build $size" && touch "$w.built" || touch "$w.failed" &
    fi
  done
  warm "$first"
  echo "[$(( $(date +%s) - t0 )) s] the reference's kernels compiled: $(tail -n 1 ~/logs/warm.log 2>/dev/null)"
  until [ -f ~/site/.ready ]; do sleep 1; done
  export PYTHONPATH=~/site:~/repo
  for size in $sizes; do
    w=$(work_of "$size")
    until [ -f "$w.built" ] || [ -f "$w.failed" ]; do sleep 1; done
    [ -f "$w.built" ] || { echo "$size's checkpoint was not built"; continue; }
    echo "[$(( $(date +%s) - t0 )) s] exporting $size (checkpoints building beside it: $(pgrep -fc 'build_d._checkpoint'))"
    export_one "$size"
  done
  wait
  echo "[$(( $(date +%s) - t0 )) s] exports done"
}

case $step in
start)
  mkdir -p ~/p ~/wheels ~/logs ~/work ~/res && cp .device/ort/part00 ~/p/ && cp .device/w0/*.whl ~/wheels/
  rm -f ~/work/*.done ~/work/*.failed ~/work/*.built
  python3 -m pip install -q --no-index --no-deps --no-compile --target ~/site0 ~/wheels/*.whl
  # The chain outlives this call and runs through the next ones, whose checkouts replace this one: it reads a copy.
  rm -rf ~/repo && mkdir ~/repo && cp -a export runtime models server systemone scripts tests pyproject.toml ~/repo/
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nproc; free -g | head -2; df -h ~ | tail -1
  export -f chain build warm export_one sample work_of form_of weights_of init_device && export sizes mode
  setsid nohup bash -c chain > ~/logs/chain.log 2>&1 < /dev/null &
  ;;
gather)
  k=$1
  cp .device/ort/part0"$k" ~/p/ && { [ ! -d .device/w"$k" ] || cp .device/w"$k"/*.whl ~/wheels/; }
  if [ "$k" = 6 ]; then
    gpu_install ~/wheels/*.whl || exit 1
    PYTHONPATH=~/site python3 -c "import onnxruntime as o; print(o.__version__, o.get_available_providers())" \
      && touch ~/site/.ready
  fi
  tail -n 3 ~/logs/chain.log
  ;;
wait)
  end=$(( $(date +%s) + $1 ))
  finished() { local size; for size in $sizes; do w=$(work_of "$size"); [ -f "$w.done" ] || [ -f "$w.failed" ] || return 1; done; }
  until finished || [ "$(date +%s)" -ge "$end" ]; do sleep 2; done
  cut -c1-400 ~/logs/chain.log | tail -n 20
  for size in $sizes; do tail -n 4 ~/logs/"export_$size.log" 2>/dev/null | cut -c1-300; done
  ;;
bench)
  export PYTHONPATH=~/site:~/repo PYTHONUNBUFFERED=1
  for what in "$@"; do
    t0=$(date +%s); echo "=== $what"
    case $what in
    graphs)  # d3-nano's text graph against torch at its best, 1 / 8 / 32 x 200 and 8 x 1000
      (cd ~/repo && OUT=~/res BENCH_ARGS="${BENCH_ARGS:-}" bash scripts/gpu/gpu_bench.sh graphs d3-nano "$mode" "$(form_of d3-nano)") ;;
    mix|mix:*)  # the seeds' mix (d3-nano unless named) and text-only requests, ours and the reference server
      size=${what#mix}; size=${size#:}  # beside, the published figures beside where the seeds publish them
      (cd ~/repo && OUT=~/res bash scripts/gpu/gpu_serve_bench.sh "${size:-d3-nano}" "$mode" "${SECONDS_EACH:-15}") ;;
    concurrency:*)  # answers under 8 clients against the same bodies alone (scripts/concurrency_check.py)
      size=${what#concurrency:}
      (cd ~ && python3 ~/repo/scripts/concurrency_check.py "$(work_of "$size")/artifact" \
        --family "$( [[ $size == d1* ]] && echo d1 || echo d3)" --kinds "${KINDS:-text,image}" --clients 8 \
        --rounds 1 --seconds "${SECONDS_EACH:-8}" --out ~/res/"concurrency_$size${TAG:+_$TAG}.json" -- --device cuda) ;;
    serve:*)  # one size served: the first answer, and the mix at 1 and 8 clients (its five kinds answered)
      size=${what#serve:}
      (cd ~/repo && OUT=~/res REFERENCE=0 CLIENTS="1 8" TEXT1=0 bash scripts/gpu/gpu_serve_bench.sh "$size" \
        "$( [[ $size == d1* ]] && echo - || echo "$mode")" "${SECONDS_EACH:-8}") ;;
    *) echo "unknown bench step $what" >&2 ;;
    esac
    echo "=== $what: $(( $(date +%s) - t0 )) s"
  done
  ;;
drop)
  for size in "$@"; do rm -rf "$(work_of "$size")"; done
  df -h ~ | tail -1
  ;;
more)
  sizes="$*" WARM=0  # the kernels are compiled by now
  export -f chain build warm export_one sample work_of form_of weights_of init_device && export sizes mode WARM
  setsid nohup bash -c chain >> ~/logs/chain.log 2>&1 < /dev/null &
  sleep 1; tail -n 2 ~/logs/chain.log
  ;;
*) echo "unknown step $step (start, gather K, wait SECONDS, bench STEP..., drop SIZE..., more SIZE...)" >&2; exit 2 ;;
esac
cp ~/logs/*.log ~/res/ 2>/dev/null
tar czf "${OUT:-/tmp/out}"/results.tgz -C ~/res . 2>/dev/null
