#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment with everything the demo and the tests
# need: the package (editable) with its train/serve extras, SGLang 0.5.23 for the hook's tests,
# and the dev tools. Idempotent: a stamp of pyproject.toml skips the install when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SPECDEPTH_VENV:-.venv}
PY=${PYTHON:-python3}

if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "setup: Python 3.11+ is required (found $("$PY" --version 2>&1)); set PYTHON=..." >&2
  exit 2
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.specdepth-installed"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "setup: $VENV is up to date"
  exit 0
fi
echo "setup: installing specdepth[dev,sglang] into $VENV (first time: several minutes)"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch is pinned to the release SGLang 0.5.23 pins, so pip resolves it once.
"$VENV/bin/python" -m pip install -q --progress-bar off "torch==2.14.1" -e ".[dev,sglang]"
# The hook's contract test also checks SGLang 0.5.17 (the GPU machine's version) statically:
# its source is unpacked, never imported, beside the venv.
src="$VENV/sglang-0.5.17-src"
if [ ! -d "$src/sglang/srt" ]; then
  tmp=$(mktemp -d)
  "$VENV/bin/python" -m pip download -q --no-deps "sglang==0.5.17" -d "$tmp"
  "$VENV/bin/python" -m zipfile -e "$tmp"/sglang-0.5.17-*.whl "$tmp/x"
  mkdir -p "$src" && mv "$tmp/x/sglang" "$src/sglang" && rm -rf "$tmp"
fi
echo "$want" > "$stamp"
echo "setup: done"
