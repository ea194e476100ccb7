#!/usr/bin/env bash
# Export vllm-sr/d3-edge (from the hub or its local cache) to artifacts/d3-edge, parity-checked against torch.
exec "$(dirname "$0")/export_checkpoint.sh" vllm-sr/d3-edge "$@"
