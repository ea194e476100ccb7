#!/usr/bin/env bash
# One lease of the GPU machine (../shared/device/README.md) for both families, in as little device time as the
# onnxruntime-gpu wheel's seven parts allow: each family's random checkpoint is built while the parts are gathered,
# then exported with its CUDA form in one `systemone export --jobs N` (the portable and the fused graphs exported at
# once in worker processes), the form gated on the GPU. The twenty-second run (docs/gpu.md) took 16 calls and about
# 1,510 s; the twenty-third, to its first bench, about 810 s. Until the twenty-sixth run the portable export ran
# first and the form after it: d3-nano's form was written 668 s after start; this way is not yet timed on a lease.
#
# Here, first: the parts and the serving wheels the machine lacks (pyproject.toml's dependencies and theirs), by
#   bash ../shared/device/prepare.sh fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 \
#     uvicorn==0.54.0 h11==0.16.0 anyio==4.16.0 annotated-types==0.8.0 typing-inspection==0.4.5 click==8.5.1 \
#     zstandard==0.25.0 opentelemetry-api==1.45.2 annotated-doc==0.0.7 typing_extensions==4.16.0 httptools==0.9.0 \
#     uvloop==0.23.0 pybase64==1.5.1 deflate==0.9.0
# The parts (40 MiB each) and the wheels (14 MiB) cannot travel in one call beside the tree (64 MiB): split the
# wheels then into .device/w0 (all but the two largest), .device/w1 (uvloop) and .device/w2 (zstandard).
#   call 0      bash scripts/gpu_lease.sh start            carry .device/ort/part00 .device/w0
#   calls 1-6   bash scripts/gpu_lease.sh gather K         carry .device/ort/part0K (and .device/wK for K = 1, 2;
#                                                          .device/ort/SHA256 for K = 6, which checks the wheel
#                                                          and installs it and the wheels into ~/site; and
#                                                          .device/old, an earlier revision's package, for
#                                                          d1before: `git archive REV export runtime models server
#                                                          systemone scripts pyproject.toml | tar -x -C .device/old`)
#   then        bash scripts/gpu_lease.sh wait SECONDS     until both families' forms are written (with the
#                                                          portable export first: d3-nano 558 s noncausal, 668 s
#                                                          causal, d1-3B about 700 s after start); the twenty-sixth
#                                                          run lost a machine inside `wait 570` and kept the next
#                                                          one with waits of about 280 s
#   then        bash scripts/gpu_lease.sh bench STEP...    d1stages d1prompts d1bench d1before d3text d3mix d1mix
#                                                          d3reuse d1reuse;
#                                                          RUN and BTAG name the files of a repeated step;
#                                                          SERVE_ARGS (e.g. --no-prefix-reuse, with RUN=noreuse)
#                                                          goes to the mixes' server
# Between calls the machine stays warm for 30 s only: make them back to back, and read results only after the last
# (the twenty-third run lost its machine, and its serve benches, to a pause of a few minutes spent reading a bench's
# figures). Results go to ~/res, and to $OUT as one results.tgz (a call brings back at most 8 files).
# D3_SIZE and D1_SIZE (d3-nano, d1-3B) name the checkpoints' sizes: `tiny` for a dry run of the steps on a CPU
# machine (HOME pointed at a scratch folder), where everything up to the forms' GPU gates runs. FAMILIES (d3 d1)
# names the families `start` exports and `wait` waits for; one alone is not much faster (d1-3B's portable export
# alone took 324 s, 281 s beside d3's). D3_MODE (noncausal_full_attention) is the d3 checkpoint's attention mode:
# `causal` for d3's prefix reuse (the d3reuse step, and the mix in that mode).
set -uo pipefail
step="$1"; shift
GPU_ENV_DEFINE_ONLY=1 source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"  # gpu_install, gpu_package
quiet() {
  grep -v "falling back\|Writing model\|Loading weights\|torchvision\|UserWarning\|warnings.warn\|W:onnxruntime"
}
d3size=${D3_SIZE:-d3-nano}; d1size=${D1_SIZE:-d1-3B}; families=${FAMILIES:-d3 d1}
d3mode=${D3_MODE:-noncausal_full_attention}  # causal: d3's prefix reuse
d3=~/work/$d3size-$d3mode; d1=~/work/$d1size--  # gpu_bench.sh's and gpu_serve_bench.sh's folders

plan() {  # FAMILY -> its checkpoint's size, attention mode and CUDA form, and its folder (SIZE-MODE, as above)
  case $1 in
  d3) echo "$d3size $d3mode cuda-fused-mixed $d3" ;;
  d1) echo "$d1size - cuda-fused $d1" ;;
  *) echo "unknown family $1" >&2; return 1 ;;
  esac
}

chain() {  # FAMILY: a random-init checkpoint, then its export with the CUDA form, gated on the GPU
  local family=$1 size mode form work line t0 jobs
  line=$(plan "$family") || return
  read -r size mode form work <<< "$line"
  t0=$(date +%s)
  stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
  failed() { stamp "$1 failed"; touch "$work.failed"; return 1; }  # `wait` stops on it, not at its time limit
  cd ~ || return
  set -o pipefail  # a failed export fails its step, through `quiet`
  # The exports share the host's cores.
  export OMP_NUM_THREADS=$(( $(nproc) / $(wc -w <<< "$families") )) PYTHONPATH=~/site0:~/pkg:~/repo
  if [ "$family" = d1 ]; then
    python3 ~/repo/scripts/build_d1_checkpoint.py "$work/checkpoint" --size "$size"
  else
    python3 ~/repo/scripts/build_d3_checkpoint.py "$work/checkpoint" --size "$size" --attention-mode "$mode"
  fi || { failed checkpoint; return; }
  stamp checkpoint built
  # The wheel is in by now (the six gathers take about 40 s, the checkpoint 60). The portable graphs and the form's
  # own export at once, each in a worker process with its own fp32 model (four graphs: two text, two vision).
  until [ -f ~/site/.ready ]; do sleep 2; done
  export PYTHONPATH=~/site:~/pkg:~/repo
  jobs=$(( 4 / $(wc -w <<< "$families") ))
  python3 -m systemone.cli export "$work/checkpoint" --out "$work/artifact" --overwrite --gate-device cuda \
    --forms "$form" --jobs "$jobs" 2>&1 | quiet || { failed export; return; }
  grep -q '"refused"' "$work/artifact/manifest.json" && { failed "form (refused; the manifest says why)"; return; }
  stamp export and form written
  touch "$work.done"
}

summary() {  # the runs of a `systemone bench --serve` result
  python3 - "$1" <<'PY'
import json, sys
for name, r in json.load(open(sys.argv[1]))["runs"].items():
    print("   ", name, {k: r.get(k) for k in ("requests_per_s", "p50_ms", "p99_ms", "answered", "non_200",
                                           "gpu_memory_mib_peak")})
PY
}

case $step in
start)
  for family in $families; do plan "$family" > /dev/null || exit 2; done
  mkdir -p ~/p ~/wheels ~/logs ~/work ~/res && cp .device/ort/part00 ~/p/ && cp .device/w0/*.whl ~/wheels/
  rm -f "$d3".done "$d3".failed "$d1".done "$d1".failed
  # The wheels the exports need before onnxruntime-gpu comes; ~/site gets them again beside it.
  python3 -m pip install -q --no-index --no-deps --no-compile --target ~/site0 ~/wheels/*.whl
  # The chains outlive this call and run through the next ones, whose checkouts replace this one: they read a copy.
  rm -rf ~/repo && mkdir ~/repo && cp -r export runtime models server systemone scripts tests pyproject.toml ~/repo/
  gpu_package ~/repo
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  export -f chain plan quiet && export families d3size d3mode d1size d3 d1
  for family in $families; do
    setsid nohup bash -c "chain $family" > ~/logs/"$family".log 2>&1 < /dev/null &
  done
  ;;
gather)
  k=$1
  cp .device/ort/part0"$k" ~/p/ && { [ ! -d .device/w"$k" ] || cp .device/w"$k"/*.whl ~/wheels/; }
  if [ -d .device/old ]; then  # the baseline d1before runs, on this machine's cards
    rm -rf ~/repo_old && cp -r .device/old ~/repo_old && gpu_package ~/repo_old ~/pkg_old
  fi
  if [ "$k" = 6 ]; then
    gpu_install ~/wheels/*.whl || exit 1
    PYTHONPATH=~/site python3 -c "import onnxruntime as o; print(o.__version__, o.get_available_providers())" \
      && touch ~/site/.ready
  fi
  tail -n 3 ~/logs/*.log
  ;;
wait)
  end=$(( $(date +%s) + $1 ))
  finished() {  # every family asked for has its form written, or failed
    local family work
    for family in $families; do
      work=$(plan "$family" | cut -d' ' -f4)
      [ -f "$work.done" ] || [ -f "$work.failed" ] || return 1
    done
  }
  until finished || [ "$(date +%s)" -ge "$end" ]; do sleep 3; done
  tail -n 12 ~/logs/*.log | cut -c1-300
  ;;
bench)
  export PYTHONPATH=~/site:~/pkg:~/repo PYTHONUNBUFFERED=1
  cd ~ || exit 1
  for what in "$@"; do
    t0=$(date +%s); echo "=== $what"
    case $what in
    d1stages)
      python3 ~/repo/scripts/d1_request_stages.py $d1/artifact --device cuda --requests 10 --gpu-kernels 2>&1 | quiet \
        | tee ~/res/d1_request_stages.txt ;;
    d1prompts)  # the prompts' shared start tokenized once against every prompt whole, alternating, on this host
      python3 ~/repo/scripts/prompt_timing.py $d1/artifact --device cuda --repeats 20 2>&1 | quiet \
        | tee ~/res/d1_prompt_timing.txt ;;
    d1bench|d1before)  # d1before: the same bench with the earlier revision's package (gather's .device/old)
      tag=$([ "$what" = d1bench ] && echo "${BTAG:-a}" || echo "before_${BTAG:-a}")
      path=$([ "$what" = d1bench ] && echo "$PYTHONPATH" || echo "$HOME/site:$HOME/pkg_old:$HOME/repo_old")
      PYTHONPATH=$path python3 -m systemone.cli bench $d1/checkpoint --artifact $d1/artifact --device cuda \
        --forms cuda-fused --batches 1 --lengths 200 --repeats 5 --request-repeats 20 --torch-dtypes bfloat16 \
        --out ~/res/d1_bench_"$tag".json 2>&1 | quiet | grep -v '^ \|^{\|^}' ;;
    d3text)  # start-up's rows a call against --max-batch-rows 32, alternating
      for i in 1 2; do
        OUT=~/res bash ~/repo/scripts/event_loop_cost.sh $d3/artifact cuda "measured_${RUN:-a}$i" 12 | tail -1
        grep "batch rows" ~/res/event_loop_serve.log | cut -c1-300
        OUT=~/res bash ~/repo/scripts/event_loop_cost.sh $d3/artifact cuda "rows32_${RUN:-a}$i" 12 \
          -- --max-batch-rows 32 | tail -1
      done ;;
    d3mix|d1mix)
      size=$([ "$what" = d3mix ] && echo "$d3size $d3mode" || echo "$d1size -")
      # The bench's lines are in its files; the time to the first answer and the start-up's choices are not.
      # shellcheck disable=SC2086  # two words: SIZE MODE
      (cd ~/repo && OUT=~/res REFERENCE=0 TAG="${RUN:-lease}" bash scripts/gpu_serve_bench.sh $size 12 \
        | grep "first answer\|systemone serve:\|batch rows\|cuda graphs")
      for f in ~/res/serve_bench_{,text1_}"${size// /_}_${RUN:-lease}".json; do summary "$f"; done ;;
    d3reuse|d1reuse)  # the mix's four-question requests, the shared prefix read once against every whole prompt
      art=$([ "$what" = d3reuse ] && echo "$d3" || echo "$d1")/artifact
      (cd ~ && python3 ~/repo/scripts/prefix_reuse_timing.py "$art" --device cuda --repeats 10 2>&1 | quiet \
        | tee ~/res/"$what".txt) ;;
    *) echo "unknown bench step $what" >&2 ;;
    esac
    echo "=== $what: $(( $(date +%s) - t0 )) s"
  done
  for w in $d3 $d1; do
    [ ! -f "$w/artifact/manifest.json" ] || cp "$w/artifact/manifest.json" ~/res/manifest_"${w##*/}".json
  done
  tar czf "$OUT"/results.tgz -C ~/res . && ls ~/res
  ;;
*) echo "unknown step $step (start, gather K, wait SECONDS, bench STEP...)" >&2; exit 2 ;;
esac
