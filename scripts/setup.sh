#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment with everything the demo and the tests
# need: the package (editable) with its train/serve extras, SGLang 0.5.23 for the hook's tests,
# and the dev tools. Idempotent: a stamp of pyproject.toml skips the install when nothing changed.
# pip's output is condensed to a progress line per stage and per 25 packages; the full log is
# kept in $VENV/setup.log (its tail is printed if pip fails).
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
LOG="$VENV/setup.log"
: > "$LOG"
T0=$SECONDS

# Reads pip's output; prints progress, errors, and each distinct warning once. Warnings that
# name a package (one per package, e.g. an index folder that lacks it) are counted, not shown.
condense() {
  local line n=0 hidden=0 start=$SECONDS
  local -A seen=()
  while IFS= read -r line; do
    case $line in
      Collecting* | Processing*)
        n=$((n + 1))
        if ((n % 25 == 0)); then echo "setup:       $n packages resolved ($((SECONDS - start)) s)"; fi ;;
      "Installing collected packages:"*)
        local -a pkgs
        IFS=, read -ra pkgs <<<"${line#*: }"
        echo "setup:       unpacking ${#pkgs[@]} packages ($((SECONDS - start)) s)..." ;;
      "Successfully installed"*)
        echo "setup:       installed ($((SECONDS - start)) s)" ;;
      *"is ignored: it is neither a file nor a directory"*)
        hidden=$((hidden + 1)) ;;
      WARNING:* | DEPRECATION:*)
        if [ -z "${seen[$line]:-}" ]; then seen[$line]=1; echo "setup:       $line"; fi ;;
      ERROR:* | error:*)
        echo "$line" ;;
    esac
  done
  if ((hidden > 0)); then echo "setup:       ($hidden warnings about missing index folders hidden; see $LOG)"; fi
}

# pip_run ARGS...: pip with condensed output; on failure, the log's tail. pip is silent while it
# unpacks (torch alone takes minutes), so a ticker says every 30 s that it is still working.
pip_run() {
  echo "\$ pip $*" >> "$LOG"
  (while sleep 30 </dev/null >/dev/null 2>&1; do echo "setup:       ... still working ($((SECONDS - T0)) s)"; done) &
  local ticker=$! ok=1
  "$VENV/bin/python" -m pip --disable-pip-version-check "$@" --progress-bar off 2>&1 \
    | tee -a "$LOG" | condense || ok=0
  kill "$ticker" 2>/dev/null || true
  wait "$ticker" 2>/dev/null || true
  if ((!ok)); then
    echo "setup: pip failed; the last lines of $LOG:" >&2
    tail -n 30 "$LOG" >&2
    exit 1
  fi
}

stage() {  # stage N TEXT: a numbered stage line with the time since setup started
  echo "setup: [$1/3] $2 (at $((SECONDS - T0)) s)"
}

stage 1 "upgrading pip in $VENV"
pip_run install --upgrade pip
# torch is pinned to the release SGLang 0.5.23 pins, so pip resolves it once.
stage 2 "installing torch 2.14.1 + specdepth[dev,sglang], editable (first time: several minutes)"
pip_run install "torch==2.14.1" -e ".[dev,sglang]"
# The hook's contract test also checks SGLang 0.5.17 (the GPU machine's version) statically:
# its source is unpacked, never imported, beside the venv.
src="$VENV/sglang-0.5.17-src"
if [ ! -d "$src/sglang/srt" ]; then
  stage 3 "unpacking SGLang 0.5.17's source for the hook's contract test"
  tmp=$(mktemp -d)
  pip_run download --no-deps "sglang==0.5.17" -d "$tmp"
  "$VENV/bin/python" -m zipfile -e "$tmp"/sglang-0.5.17-*.whl "$tmp/x"
  mkdir -p "$src" && mv "$tmp/x/sglang" "$src/sglang" && rm -rf "$tmp"
else
  stage 3 "SGLang 0.5.17's source is already in $src"
fi
echo "$want" > "$stamp"
echo "setup: done in $((SECONDS - T0)) s"
