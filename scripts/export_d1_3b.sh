#!/usr/bin/env bash
# Export LiquidAI/d1-3B (from the hub or its local cache) to artifacts/d1-3B, parity-checked against torch.
exec "$(dirname "$0")/export_checkpoint.sh" LiquidAI/d1-3B "$@"
