#!/usr/bin/env bash
# The main job on an embedded default: build the tiny demo d3 checkpoint (RANDOM weights: the answers mean
# nothing, the pipeline is real), export it to ONNX (with its parity check), serve it, ask it one request.
EXTRAS=export source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
PORT="${PORT:-8765}"
DEMO=.cache/demo
.venv/bin/python scripts/build_d3_checkpoint.py "$DEMO/d3-tiny"
.venv/bin/systemone export "$DEMO/d3-tiny" --out "$DEMO/d3-tiny-onnx" --overwrite
.venv/bin/systemone serve "$DEMO/d3-tiny-onnx" --served-model-name demo/d3-tiny --port "$PORT" \
  --log-level warning &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
.venv/bin/python - "$PORT" <<'PY'
import json, sys, time, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}"
for _ in range(120):
    try:
        urllib.request.urlopen(base + "/health", timeout=1)
        break
    except OSError:
        time.sleep(0.5)
body = open("scripts/demo_request.json", "rb").read()
req = urllib.request.Request(base + "/v1/systemone", data=body, headers={"Content-Type": "application/json"})
print(json.dumps(json.load(urllib.request.urlopen(req, timeout=60)), indent=2, ensure_ascii=False))
print("(random weights: the pipeline is real, the answers are not)", file=sys.stderr)
PY
