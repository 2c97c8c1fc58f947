#!/usr/bin/env bash
# Set up (if needed) and run the demo on bundled data: a served policy steering a simulated
# SGLang replica through a load ramp, compared side by side with the static depths.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${SPECDEPTH_VENV:-.venv}
exec "$VENV/bin/controller" demo "$@"
