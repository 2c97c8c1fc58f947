#!/usr/bin/env bash
# Set up (if needed), lint, type-check and run the whole test suite, slow tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${SPECDEPTH_VENV:-.venv}
echo "== ruff"
"$VENV/bin/ruff" check controller env agents sglang_hook tests bench
echo "== mypy"
"$VENV/bin/mypy" --no-error-summary  # the packages listed under [tool.mypy] in pyproject.toml
echo "== pytest"
export SPECDEPTH_SGLANG_SRC=${SPECDEPTH_SGLANG_SRC:-$VENV/sglang-0.5.17-src/sglang}
rc=0
"$VENV/bin/python" -m pytest -q -rs "$@" || rc=$?
# pytest exits 5 when it collected nothing: fine for a filter that matched no test, a failure
# for the plain run (CI), where it means the suite itself went missing.
if [ "$rc" -eq 5 ]; then
  if [ $# -gt 0 ]; then
    echo "test: no test matched: $*"
    exit 0
  fi
  echo "test: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
