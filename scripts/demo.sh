#!/usr/bin/env bash
# The main job on an embedded default: build a tiny demo checkpoint (RANDOM weights: the answers mean nothing, the
# pipeline is real), export it to ONNX (with its parity check), serve it, ask it one request.
#   bash scripts/demo.sh [d3|d1]     d3 (default): a Qwen3.5-backbone d3; d1: an LFM2-VL d1
#   PORT=8765                        the loopback port the demo serves on (default 8765); it must be free
FAMILY="${1:-d3}"
case "$FAMILY" in d1|d3) ;; *) echo "usage: bash scripts/demo.sh [d3|d1]" >&2; exit 2 ;; esac
PORT="${PORT:-8765}"
# Checked before the minutes of install and export: a busy port would answer the demo's requests itself.
if python3 -c "import socket, sys; s = socket.socket(); sys.exit(s.connect_ex(('127.0.0.1', int(sys.argv[1]))) != 0)" \
    "$PORT"; then
  echo "port $PORT is in use; run the demo on another one: PORT=8766 bash scripts/demo.sh $FAMILY" >&2
  exit 2
fi
echo "installing the project and its export extra into .venv (log: .cache/pip-install.log)..."
EXTRAS=export,cpu source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
DEMO=.cache/demo
ARTIFACT="$DEMO/$FAMILY-tiny-onnx"
.venv/bin/python "scripts/build_${FAMILY}_checkpoint.py" "$DEMO/$FAMILY-tiny"
.venv/bin/systemone export "$DEMO/$FAMILY-tiny" --out "$ARTIFACT" --overwrite
# The served name defaults to the checkpoint directory's name, "$FAMILY-tiny".
.venv/bin/systemone serve "$ARTIFACT" --port "$PORT" --log-level warning &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
.venv/bin/python - "$PORT" "$SERVER" <<'PY'
import json, os, sys, time, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}"
for _ in range(240):
    try:
        urllib.request.urlopen(base + "/health", timeout=1)
        break
    except OSError:
        os.kill(int(sys.argv[2]), 0)  # the server exited: its error is above
        time.sleep(0.5)
body = json.load(open("scripts/demo_request.json", encoding="utf-8"))  # no model name: the served one answers
print(f"POST {base}/v1/systemone\n{json.dumps(body, indent=2, ensure_ascii=False)}\n")
req = urllib.request.Request(base + "/v1/systemone", data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
print(json.dumps(json.load(urllib.request.urlopen(req, timeout=60)), indent=2, ensure_ascii=False))
print("(random weights: the pipeline is real, the answers are not)", file=sys.stderr)
PY
echo "serve the artifact again with: .venv/bin/systemone serve $ARTIFACT --port $PORT"
