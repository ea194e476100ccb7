#!/usr/bin/env bash
# The test command: sets up .venv (export + test extras) and runs the whole suite on tiny random checkpoints, on two
# worker processes, then the tests marked `alone` (latency bounds that another process's load would move) by
# themselves. Both passes share one directory of checkpoints, traces and artifacts made once
# (docs/decisions/test-suite-time.md). TEST_WORKERS=0: one process.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
if [ -z "${SYSTEMONE_TEST_RUN_DIR:-}" ]; then
  SYSTEMONE_TEST_RUN_DIR="$(mktemp -d)"
  trap 'rm -rf "$SYSTEMONE_TEST_RUN_DIR"' EXIT
fi
export SYSTEMONE_TEST_RUN_DIR
passed() { [ "$1" -eq 0 ] || [ "$1" -eq 5 ]; }  # 5: the pass selected no test
first=0 second=0
# The first pass names the `alone` tests it leaves out (tests/conftest.py); the second runs those by id.
export SYSTEMONE_ALONE_TESTS="$SYSTEMONE_TEST_RUN_DIR/alone-tests"
rm -f "$SYSTEMONE_ALONE_TESTS"
.venv/bin/python -m pytest -n "${TEST_WORKERS:-2}" --dist worksteal -m "not alone" "$@" || first=$?
if [ -s "$SYSTEMONE_ALONE_TESTS" ]; then
  mapfile -t alone < <(sort -u "$SYSTEMONE_ALONE_TESTS")
  .venv/bin/python -m pytest -p no:xdist -m alone "${alone[@]}" "$@" || second=$?
fi
passed "$first" && passed "$second"
