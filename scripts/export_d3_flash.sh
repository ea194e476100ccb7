#!/usr/bin/env bash
# Export vllm-sr/d3-flash (from the hub or its local cache) to artifacts/d3-flash, parity-checked against torch.
exec "$(dirname "$0")/export_checkpoint.sh" vllm-sr/d3-flash "$@"
