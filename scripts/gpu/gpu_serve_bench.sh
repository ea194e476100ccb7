#!/usr/bin/env bash
# On the lent GPU machine, after `bash scripts/gpu/gpu_bench.sh export SIZE MODE` in the same warm lease: our server
# and the reference server (systemone/reference_server.py: the checkpoint's own runtime in bf16, flash-linear-
# attention where its wheels were carried, vision once a request, a request's questions in one forward) on the
# same GPU, then the seeds' mix at 1, 8 and 64 closed-loop clients against each (`systemone bench --serve`, its
# own ceiling beside every run, the seeds' published figures beside them for d3-nano and d3-mini), and text-only
# one-question requests at 64 clients against each.
# The machine lacks fastapi, uvicorn, pydantic and the rest of the server's dependencies: gather their wheels first
# (scripts/gpu/README.md, step 1).
#   bash scripts/gpu/gpu_serve_bench.sh SIZE MODE [SECONDS]
# SERVE_ARGS: more `systemone serve` flags (e.g. "--gpu-memory 6"); REFERENCE=0: our server alone; TAG: a suffix for
# the result files; CLIENTS (1 8 64): the mix's client counts; TEXT1=0: no text-only run; MP4=1: the mix again with its video also sent as an MPEG-4 file (kind mp4). Each run reports
# the most GPU memory each server process and the device held (nvidia-smi).
set -euo pipefail
size="$1"; mode="$2"; seconds="${3:-30}"
family=$(case "$size" in d1*) echo d1 ;; *) echo d3 ;; esac)
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
work=~/work/"$size-$mode"; out="${OUT:-/tmp/out}"; mkdir -p "$out"
tag="${size}_${mode}${TAG:+_$TAG}"
cd ~  # keep the repo's systemone/ folder off sys.path (see gpu_bench.sh)
# A server of an earlier run still stopping would answer this run's health check (seen: a run's first client count
# met closed ports): wait for both ports to be free.
for port in 8000 8001; do
  for _ in $(seq 120); do curl -s -o /dev/null "http://127.0.0.1:$port/health" || break; sleep 0.5; done
  if curl -s -o /dev/null "http://127.0.0.1:$port/health"; then
    echo "port $port is still served; stop that server first" >&2; exit 1
  fi
done
start=$(date +%s.%N)
# shellcheck disable=SC2086  # SERVE_ARGS is a list of flags
python3 -m systemone.cli serve "$work/artifact" --device cuda --port 8000 ${SERVE_ARGS:-} > "$out/serve_$tag.log" 2>&1 &
pids=(--server-pid $!)
ports=(8000)
if [ "${REFERENCE:-1}" != 0 ]; then
  python3 -m systemone.reference_server "$work/checkpoint" --artifact "$work/artifact" --device cuda --port 8001 \
    > "$out/reference_$tag.log" 2>&1 &
  pids+=(--reference-pid $!)
  ports+=(8001)
fi
trap 'kill $(jobs -p) 2>/dev/null; wait' EXIT  # the servers gone before the next run starts its own
for port in "${ports[@]}"; do
  until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
    sleep 0.5
    if [ "$(jobs -rp | wc -l)" -lt "${#ports[@]}" ]; then  # a server died: say why, stop
      tail -20 "$out/serve_$tag.log" "$out/reference_$tag.log" 2>/dev/null; exit 1
    fi
  done
  if [ "$port" = 8000 ]; then  # the time a user waits from `systemone serve` to the first answer
    curl -sf -o /dev/null http://127.0.0.1:8000/v1/systemone -H 'content-type: application/json' \
      -d '{"state": "The parcel arrived crushed.", "questions": {"q": {"type": "noul", "instructions": "Refund?"}}}'
    python3 -c "import time; print(f\"systemone serve -> first answer after {time.time() - $start:.1f} s\")" \
      | tee "$out/first_answer_$tag.txt"
  fi
done
grep "reference server:" "$out/reference_$tag.log" 2>/dev/null || true  # what the reference runs: dtype, kernels
reference=()
[ "${REFERENCE:-1}" = 0 ] || reference=(--reference http://127.0.0.1:8001/v1/systemone)
published=()
case "$size" in d3-nano|d3-mini) published=(--published "$size") ;; esac
bench() {  # NAME [FLAGS...]: one `systemone bench --serve` against both servers
  local name=$1; shift
  python3 -m systemone.cli bench --serve http://127.0.0.1:8000/v1/systemone "${reference[@]}" --family "$family" \
    --seconds "$seconds" --gpu-memory-peaks "${pids[@]}" --out "$out/serve_bench_${name}$tag.json" "$@"
}
# shellcheck disable=SC2086  # CLIENTS is a list
bench "" --clients ${CLIENTS:-1 8 64} "${published[@]}"
[ "${MP4:-0}" = 0 ] || [ "$family" = d1 ] || bench mp4_ --clients 1 8 64 --kinds text json choice40 image video mp4
[ "${TEXT1:-1}" = 0 ] || bench text1_ --kinds text1 --clients 64  # text-only one-question requests
grep "systemone serve:\|cuda graphs" "$out/serve_$tag.log" || true
