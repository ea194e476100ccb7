#!/usr/bin/env bash
# Export vllm-sr/d3 (from the hub or its local cache) to artifacts/d3, parity-checked against torch.
exec "$(dirname "$0")/export_checkpoint.sh" vllm-sr/d3 "$@"
