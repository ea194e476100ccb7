# Sourced by demo.sh and test.sh: a project virtualenv with the export and test extras.
# torch==2.13.0 is the CPU wheel; transformers is pinned to the release the reference behaviour was read from.
# The packages are installed by uv where it can be had (the same resolution as pip's, from pip's own indexes, links
# and constraints, in a fraction of the time: docs/decisions/test-suite-time.md), else by pip. Byte-code is written
# at first import, for the modules the scripts use, rather than for the whole environment at install (the same
# record); where PYTHONDONTWRITEBYTECODE is set (these machines), every process would compile them again.
set -euo pipefail
unset PYTHONDONTWRITEBYTECODE
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
mkdir -p .cache
pip_sources() {  # pip's configured indexes, links and constraints as uv's flags (uv reads no pip.conf)
  .venv/bin/python -m pip config list 2>/dev/null | .venv/bin/python -c '
import shlex, sys
flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}
seen, out = set(), []
for line in sys.stdin:
    key, _, value = line.strip().partition("=")
    flag = flags.get(key.partition(".")[2])
    for item in " ".join(shlex.split(value)).split() if flag else ():
        if (flag, item) not in seen:
            seen.add((flag, item))
            out += [flag, item]
print(shlex.join(out))'
}
install_with_uv() {
  .venv/bin/python -m pip install -q uv || return 1
  # eval: pip_sources prints its flags quoted (shlex.join)
  eval ".venv/bin/uv pip install --python .venv/bin/python --index-strategy unsafe-best-match $(pip_sources)" \
    '-e ".[${EXTRAS:-test}]"'
}
if ! install_with_uv > .cache/pip-install.log 2>&1 \
    && ! .venv/bin/python -m pip install -q -e ".[${EXTRAS:-test}]" >> .cache/pip-install.log 2>&1; then
  cat .cache/pip-install.log >&2
  exit 1
fi
.venv/bin/python -c "import systemone.runtime, torch, transformers" >/dev/null
