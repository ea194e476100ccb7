#!/usr/bin/env bash
# The event loop's CPU time a request: `systemone serve` on ARTIFACT, text-only one-question requests from 64
# closed-loop clients (`systemone bench --serve --kinds text1`), and the server's main thread's CPU time over the
# run (/proc/PID/task/PID/stat) divided by the requests answered. Where the loop is what bounds requests/s, this is
# the figure to bring down; requests/s and p99 alone move with everything else on the machine.
#   bash scripts/event_loop_cost.sh ARTIFACT DEVICE LABEL [SECONDS] [-- serve flags]
set -euo pipefail
artifact="$1"; device="$2"; label="$3"; seconds="${4:-12}"
shift $(( $# < 4 ? $# : 4 )); [ "${1:-}" = "--" ] && shift
python="${PYTHON:-python3}"; port="${PORT:-8010}"; out="${OUT:-/tmp}"
$python -m systemone.cli serve "$artifact" --device "$device" --port "$port" "$@" > "$out/event_loop_serve.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
  sleep 0.5; kill -0 $server 2>/dev/null || { tail -5 "$out/event_loop_serve.log"; exit 1; }
done
bench() { $python -m systemone.cli bench --serve "http://127.0.0.1:$port/v1/systemone" --family d3 --kinds text1 \
  --clients 64 --seconds "$1" --out "$2" > /dev/null 2>&1; }
bench 4 "$out/event_loop_warm.json"
before=$(awk '{print $14 + $15}' /proc/$server/task/$server/stat)
bench "$seconds" "$out/event_loop_$label.json"
after=$(awk '{print $14 + $15}' /proc/$server/task/$server/stat)
$python - "$out/event_loop_$label.json" "$label" "$before" "$after" <<'PY'
import json, os, sys
path, label, before, after = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def run_of(x):
    if isinstance(x, dict):
        if "answered" in x:
            return x
        x = list(x.values())
    for v in x if isinstance(x, list) else []:
        if (found := run_of(v)) is not None:
            return found
    return None
run = run_of(json.load(open(path)))
cpu_ms = (after - before) * 1000 / os.sysconf("SC_CLK_TCK")
print(f"{label}: {run['requests_per_s']:.1f} requests/s, p50 {run['p50_ms']:.1f} ms, p99 {run['p99_ms']:.1f} ms; "
      f"event loop {cpu_ms:.0f} ms of CPU for {run['answered']} requests = {cpu_ms / run['answered']:.3f} ms a request")
PY
