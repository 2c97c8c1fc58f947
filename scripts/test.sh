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
exec "$VENV/bin/python" -m pytest -q -rs "$@"
