#!/usr/bin/env bash
# The main job on an embedded default: build a tiny demo checkpoint (RANDOM weights: the answers mean nothing, the
# pipeline is real), export it to ONNX (with its parity check), serve it, ask it one request.
#   bash scripts/demo.sh [d3|d1]     d3 (default): a Qwen3.5-backbone d3; d1: an LFM2-VL d1
EXTRAS=export source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
FAMILY="${1:-d3}"
case "$FAMILY" in d1|d3) ;; *) echo "usage: bash scripts/demo.sh [d3|d1]" >&2; exit 2 ;; esac
PORT="${PORT:-8765}"
DEMO=.cache/demo
.venv/bin/python "scripts/build_${FAMILY}_checkpoint.py" "$DEMO/$FAMILY-tiny"
.venv/bin/systemone export "$DEMO/$FAMILY-tiny" --out "$DEMO/$FAMILY-tiny-onnx" --overwrite
.venv/bin/systemone serve "$DEMO/$FAMILY-tiny-onnx" --served-model-name "demo/$FAMILY-tiny" --port "$PORT" \
  --log-level warning &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
.venv/bin/python - "$PORT" "demo/$FAMILY-tiny" <<'PY'
import json, sys, time, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}"
for _ in range(120):
    try:
        urllib.request.urlopen(base + "/health", timeout=1)
        break
    except OSError:
        time.sleep(0.5)
body = json.load(open("scripts/demo_request.json", encoding="utf-8"))
body["model"] = sys.argv[2]
req = urllib.request.Request(base + "/v1/systemone", data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
print(json.dumps(json.load(urllib.request.urlopen(req, timeout=60)), indent=2, ensure_ascii=False))
print("(random weights: the pipeline is real, the answers are not)", file=sys.stderr)
PY
