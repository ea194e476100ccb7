#!/usr/bin/env bash
# The test command: sets up .venv (export + test extras) and runs the whole suite on tiny random checkpoints.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec .venv/bin/python -m pytest "$@"
