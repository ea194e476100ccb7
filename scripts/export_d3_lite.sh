#!/usr/bin/env bash
# Export vllm-sr/d3-lite (from the hub or its local cache) to artifacts/d3-lite, parity-checked against torch.
exec "$(dirname "$0")/export_checkpoint.sh" vllm-sr/d3-lite "$@"
