#!/usr/bin/env bash
# Export vllm-sr/d3-mini (from the hub or its local cache) to artifacts/d3-mini, parity-checked against torch.
exec "$(dirname "$0")/export_checkpoint.sh" vllm-sr/d3-mini "$@"
